//! The reward model, the first half of RLHF (Ouyang et al., 2022): the decoder with a scalar
//! head on the last token of each sequence, trained with the Bradley-Terry loss
//! `-log sigmoid(r(y_w) - r(y_l))` on preference pairs, and scored by pairwise accuracy on
//! held-out pairs.

use crate::batch::RowBatch;
use crate::error::{Result, TuneError};
use crate::logprob::log_sigmoid;
use candle_core::{DType, Tensor, Var};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_memory::{MicroBatch, SegmentParams, SegmentedModel};
use kiln_model::{Gpt, Init, Initializer, ParamSource};
use kiln_optim::ParamKind;
use kiln_parallel::tp::TpSplit;
use std::sync::Mutex;

/// The name of the scalar head's weight `[1, d]`.
pub const SCORE_WEIGHT: &str = "score.weight";
/// The name of the micro-batch tensor that holds each row's last token position (u32
/// `[rows]`), where the reward is read.
pub const LAST_POSITIONS: &str = "last_positions";

/// Sums over the pairs a reward head saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RewardStats {
    /// Pairs.
    pub pairs: f64,
    /// Sum of the per-pair losses.
    pub loss: f64,
    /// Pairs scored the right way (a tie counts one half).
    pub correct: f64,
}

impl RewardStats {
    /// The sums over every rank of `dp` (collective over it).
    pub fn all_reduce(&self, dp: &dyn Communicator) -> Result<Self> {
        let mut v = [self.pairs, self.loss, self.correct];
        dp.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(Self {
            pairs: v[0],
            loss: v[1],
            correct: v[2],
        })
    }

    /// Pairwise accuracy.
    pub fn accuracy(&self) -> f64 {
        self.correct / self.pairs
    }

    /// Mean loss.
    pub fn mean_loss(&self) -> f64 {
        self.loss / self.pairs
    }
}

/// A GPT with a scalar head: the reward of a sequence is `score . ln_f(h_last)`, where
/// `h_last` is the last block's output at the sequence's last token (Hugging Face's
/// `GPT2ForSequenceClassification` with one label). The head is replicated over
/// tensor-parallel ranks. As a [`SegmentedModel`] its loss is the Bradley-Terry loss over a
/// [`crate::preference_batch`] (chosen rows first), as micro-batches from
/// [`RewardModel::micro_batch`].
#[derive(Debug)]
pub struct RewardModel {
    gpt: Gpt,
    score: Var,
    stats: Mutex<RewardStats>,
}

impl RewardModel {
    /// A reward model over `gpt` (trained or fresh; frozen parameters stay frozen), its head
    /// drawn from `N(0, 0.02)` keyed by `(seed, "score.weight")`.
    pub fn new(gpt: Gpt, seed: u64) -> Result<Self> {
        let d = gpt.config().d_model;
        let device = gpt.options().device.clone();
        let init = Initializer::new(seed, &device, gpt.options().param_dtype)?;
        let score = init.var(SCORE_WEIGHT, &[1, d], Init::Normal { std: 0.02 })?;
        Ok(Self {
            gpt,
            score,
            stats: Mutex::new(RewardStats::default()),
        })
    }

    /// The decoder.
    pub fn gpt(&self) -> &Gpt {
        &self.gpt
    }

    /// The head's weight `[1, d]`.
    pub fn score(&self) -> &Var {
        &self.score
    }

    /// Per segment, the trainable parameters: the decoder's, with the head's weight in the
    /// last segment (the input of `kiln_parallel::DataParallel::new`).
    pub fn segment_param_lists(&self) -> Vec<Vec<(String, Var)>> {
        let mut lists = self.gpt.segment_param_lists();
        if let Some(last) = lists.last_mut() {
            last.push((SCORE_WEIGHT.to_string(), self.score.clone()));
        }
        lists
    }

    /// The decoder's splits, and the replicated head.
    pub fn param_splits(&self) -> Vec<(String, TpSplit)> {
        let mut s = self.gpt.param_splits();
        s.push((SCORE_WEIGHT.to_string(), TpSplit::Replicated));
        s
    }

    /// The decoder's parameter kinds, and the head's weight.
    pub fn param_kinds(&self) -> Vec<(String, ParamKind)> {
        let mut k = self.gpt.param_kinds();
        k.push((SCORE_WEIGHT.to_string(), ParamKind::Weight));
        k
    }

    /// The micro-batch the engine runs for `batch`: its inputs and targets, and each row's
    /// last token position as the u32 tensor [`LAST_POSITIONS`] `[rows]`.
    pub fn micro_batch(batch: &RowBatch) -> Result<MicroBatch> {
        Ok(
            MicroBatch::new(batch.inputs.clone(), batch.targets.clone())?
                .with(LAST_POSITIONS, Self::last_positions(batch)?)?,
        )
    }

    fn last_positions(batch: &RowBatch) -> Result<Tensor> {
        let rows = batch.last_positions.len();
        Ok(Tensor::from_slice(
            &batch.last_positions,
            rows,
            batch.inputs.device(),
        )?)
    }

    /// Rewards `[rows]` of hidden states `[rows, t, d]` at the positions `last` `[rows]` (u32),
    /// with the weights `p` supplies.
    pub fn rewards_with(&self, x: &Tensor, last: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let (rows, t, d) = x.dims3()?;
        let pos: Vec<u32> = last.flatten_all()?.to_vec1()?;
        if pos.len() != rows || pos.iter().any(|&i| i as usize >= t) {
            return Err(TuneError::input(
                "reward positions",
                format!("{rows} positions below {t}"),
                format!("{pos:?}"),
            ));
        }
        let h = self.gpt.final_norm_with(x, p)?.reshape((rows * t, d))?;
        let idx: Vec<u32> = pos
            .iter()
            .enumerate()
            .map(|(r, &i)| (r * t) as u32 + i)
            .collect();
        let idx = Tensor::from_vec(idx, rows, x.device())?;
        let h_last = h.index_select(&idx, 0)?;
        let w = p.param(SCORE_WEIGHT)?.to_dtype(h_last.dtype())?;
        Ok(h_last.matmul(&w.t()?)?.squeeze(1)?.to_dtype(DType::F32)?)
    }

    /// The rewards of a batch's rows with the model's own weights, no gradient kept.
    pub fn rewards(&self, batch: &RowBatch) -> Result<Vec<f32>> {
        let mut x = self.gpt.embed(&batch.inputs)?;
        for i in 0..self.gpt.n_blocks() {
            x = self.gpt.block(i, &x)?.detach();
        }
        let mut params = self.gpt.named_parameters();
        params.push((SCORE_WEIGHT.to_string(), self.score.clone()));
        Ok(self
            .rewards_with(&x, &Self::last_positions(batch)?, &params)?
            .detach()
            .to_vec1()?)
    }

    /// The Bradley-Terry loss and accuracy of a preference batch with the model's own weights.
    pub fn evaluate(&self, batch: &RowBatch) -> Result<RewardStats> {
        let r = self.rewards(batch)?;
        Ok(bt_stats(&r))
    }

    /// What the head saw since the last call, and resets it (this rank only).
    pub fn take_stats(&self) -> RewardStats {
        match self.stats.lock() {
            Ok(mut s) => std::mem::take(&mut *s),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        }
    }

    fn head(&self, x: &Tensor, batch: &MicroBatch, p: &dyn ParamSource) -> Result<Tensor> {
        let rows = x.dim(0)?;
        if rows % 2 != 0 {
            return Err(TuneError::input(
                "a reward batch",
                "an even number of rows (chosen, then rejected)",
                rows.to_string(),
            ));
        }
        let r = self.rewards_with(x, batch.require(LAST_POSITIONS)?, p)?;
        let n = rows / 2;
        let diff = (r.narrow(0, 0, n)? - r.narrow(0, n, n)?)?;
        let loss = log_sigmoid(&diff)?.neg()?.mean_all()?;
        let s = bt_stats(&r.detach().to_vec1()?);
        match self.stats.lock() {
            Ok(mut g) => {
                g.pairs += s.pairs;
                g.loss += s.loss;
                g.correct += s.correct;
            }
            Err(p) => {
                let mut g = p.into_inner();
                g.pairs += s.pairs;
                g.loss += s.loss;
                g.correct += s.correct;
            }
        }
        Ok(loss)
    }
}

/// Bradley-Terry loss and accuracy of rewards `[2n]` (chosen first).
fn bt_stats(r: &[f32]) -> RewardStats {
    let n = r.len() / 2;
    let mut s = RewardStats {
        pairs: n as f64,
        ..Default::default()
    };
    for i in 0..n {
        let z = f64::from(r[i]) - f64::from(r[n + i]);
        // -log sigmoid(z), stably
        s.loss += (-z).max(0.0) + (-z.abs()).exp().ln_1p();
        s.correct += if z > 0.0 {
            1.0
        } else if z == 0.0 {
            0.5
        } else {
            0.0
        };
    }
    s
}

impl SegmentedModel for RewardModel {
    fn num_segments(&self) -> usize {
        self.gpt.n_blocks() + 2
    }

    fn forward_segment(
        &self,
        i: usize,
        input: &Tensor,
        batch: &MicroBatch,
        params: &SegmentParams,
    ) -> candle_core::Result<Tensor> {
        if let Some(out) = crate::logprob::trunk_segment(&self.gpt, i, input, params) {
            return out;
        }
        self.head(input, batch, params)
            .map_err(candle_core::Error::wrap)
    }
}
