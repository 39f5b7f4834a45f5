//! Direct Preference Optimization (Rafailov et al., 2023): preference alignment without a
//! reward model or sampling. For a pair (prompt, chosen `y_w`, rejected `y_l`), with the
//! policy `pi` and a frozen reference `ref`,
//!
//! `z = beta * ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))`,
//! `loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)` (eps: conservative DPO's label
//! smoothing, 0 by default), averaged over pairs.
//!
//! [`DpoObjective`] runs the policy through kiln's segmented executor (so DPO trains under the
//! data-parallel engine, ZeRO, tensor parallelism and activation recomputation like
//! pretraining) with a head that computes this loss. The reference's log-probabilities are
//! computed beforehand ([`crate::model_log_probs`]) and travel with the batch as its named
//! tensor [`REFERENCE_LOG_PROBS`] ([`DpoObjective::micro_batch`]), so gradient accumulation
//! and recomputation need no side channel. What the head saw (rewards, margins,
//! accuracies) is kept in [`DpoStats`] for the caller's metrics.
//!
//! PPO-based RLHF builds on the same parts: a [`crate::RewardModel`] scores sampled responses
//! ([`kiln_model::generate`]), [`crate::sequence_log_probs`] gives the policy's and the
//! reference's log-probabilities of them for the KL penalty, and a clipped-ratio objective
//! takes the place of [`dpo_loss`] in a head like this one.

use crate::batch::RowBatch;
use crate::error::{Result, TuneError};
use crate::logprob::{log_sigmoid, sequence_log_probs};
use candle_core::{DType, Tensor};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_memory::{MicroBatch, SegmentParams, SegmentedModel};
use kiln_model::Gpt;
use serde::{Deserialize, Serialize};
use std::sync::Mutex;

/// The name of the micro-batch tensor that carries the reference model's log-probability of
/// each row (f32 `[rows]`).
pub const REFERENCE_LOG_PROBS: &str = "reference_log_probs";

/// DPO's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoConfig {
    /// The inverse temperature `beta` (TRL's default 0.1).
    pub beta: f64,
    /// Conservative DPO's label smoothing `eps` in `[0, 0.5)`.
    pub label_smoothing: f64,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self {
            beta: 0.1,
            label_smoothing: 0.0,
        }
    }
}

impl DpoConfig {
    /// Checks both fields, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return Err(TuneError::config(
                "dpo.beta",
                format!("must be a positive number, got {}", self.beta),
            ));
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            return Err(TuneError::config(
                "dpo.label_smoothing",
                format!("must be in [0, 0.5), got {}", self.label_smoothing),
            ));
        }
        Ok(())
    }
}

/// The DPO loss (mean over pairs) of per-pair log-probabilities `[n]`: the policy's of the
/// chosen and rejected responses, and the reference's.
pub fn dpo_loss(
    policy_chosen: &Tensor,
    policy_rejected: &Tensor,
    ref_chosen: &Tensor,
    ref_rejected: &Tensor,
    cfg: &DpoConfig,
) -> Result<Tensor> {
    let z = ((policy_chosen - ref_chosen)? - (policy_rejected - ref_rejected)?)?
        .affine(cfg.beta, 0.0)?;
    let eps = cfg.label_smoothing;
    let mut loss = log_sigmoid(&z)?.affine(-(1.0 - eps), 0.0)?;
    if eps > 0.0 {
        loss = (loss + log_sigmoid(&z.neg()?)?.affine(-eps, 0.0)?)?;
    }
    Ok(loss.mean_all()?)
}

/// Sums over the pairs a DPO head saw; [`DpoStats::all_reduce`] adds them over the
/// data-parallel group, and the accessors give the means TRL logs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DpoStats {
    /// Pairs.
    pub pairs: f64,
    /// Sum of the per-pair losses.
    pub loss: f64,
    /// Sum of the chosen rewards `beta (log pi(y_w) - log ref(y_w))`.
    pub chosen_reward: f64,
    /// Sum of the rejected rewards.
    pub rejected_reward: f64,
    /// Pairs whose chosen reward is above the rejected one (a tie counts one half).
    pub reward_correct: f64,
    /// Pairs the policy itself prefers the right way, `log pi(y_w) > log pi(y_l)` (a tie
    /// counts one half).
    pub policy_correct: f64,
}

impl DpoStats {
    fn add(&mut self, o: &DpoStats) {
        self.pairs += o.pairs;
        self.loss += o.loss;
        self.chosen_reward += o.chosen_reward;
        self.rejected_reward += o.rejected_reward;
        self.reward_correct += o.reward_correct;
        self.policy_correct += o.policy_correct;
    }

    /// The sums over every rank of `dp` (collective over it).
    pub fn all_reduce(&self, dp: &dyn Communicator) -> Result<Self> {
        let mut v = [
            self.pairs,
            self.loss,
            self.chosen_reward,
            self.rejected_reward,
            self.reward_correct,
            self.policy_correct,
        ];
        dp.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(Self {
            pairs: v[0],
            loss: v[1],
            chosen_reward: v[2],
            rejected_reward: v[3],
            reward_correct: v[4],
            policy_correct: v[5],
        })
    }

    fn mean(&self, x: f64) -> f64 {
        if self.pairs > 0.0 {
            x / self.pairs
        } else {
            f64::NAN
        }
    }

    /// Mean loss.
    pub fn mean_loss(&self) -> f64 {
        self.mean(self.loss)
    }

    /// Fraction of pairs whose implicit reward prefers the chosen response (TRL's
    /// `rewards/accuracies`).
    pub fn reward_accuracy(&self) -> f64 {
        self.mean(self.reward_correct)
    }

    /// Fraction of pairs where the policy gives the chosen response the higher probability.
    pub fn policy_accuracy(&self) -> f64 {
        self.mean(self.policy_correct)
    }

    /// Mean reward margin, chosen minus rejected (TRL's `rewards/margins`).
    pub fn margin(&self) -> f64 {
        self.mean(self.chosen_reward - self.rejected_reward)
    }

    /// The means as named scalars (`dpo/loss`, `dpo/reward_margin`, `dpo/reward_accuracy`,
    /// `dpo/policy_accuracy`, `dpo/chosen_reward`, `dpo/rejected_reward`), for a metrics
    /// record's extra scalars.
    pub fn metrics(&self) -> Vec<(String, f64)> {
        [
            ("dpo/loss", self.mean_loss()),
            ("dpo/reward_margin", self.margin()),
            ("dpo/reward_accuracy", self.reward_accuracy()),
            ("dpo/policy_accuracy", self.policy_accuracy()),
            ("dpo/chosen_reward", self.mean(self.chosen_reward)),
            ("dpo/rejected_reward", self.mean(self.rejected_reward)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

fn half_credit(a: f32, b: f32) -> f64 {
    if a > b {
        1.0
    } else if a == b {
        0.5
    } else {
        0.0
    }
}

/// The policy under the DPO loss, as a [`SegmentedModel`] for the data-parallel engine: the
/// GPT's embedding and blocks, then a head that scores the batch's chosen rows against its
/// rejected rows. Batches come from [`crate::preference_batch`], as micro-batches from
/// [`DpoObjective::micro_batch`].
#[derive(Debug)]
pub struct DpoObjective<'a> {
    policy: &'a Gpt,
    cfg: DpoConfig,
    stats: Mutex<DpoStats>,
}

impl<'a> DpoObjective<'a> {
    /// DPO over `policy` (the model the engine trains).
    pub fn new(policy: &'a Gpt, cfg: DpoConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            policy,
            cfg,
            stats: Mutex::new(DpoStats::default()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DpoConfig {
        &self.cfg
    }

    /// The micro-batch the engine runs for `batch`: its inputs and token targets `[2n, t]`,
    /// and the reference's log-probability of each row as the f32 tensor
    /// [`REFERENCE_LOG_PROBS`] `[2n]`, from [`crate::model_log_probs`] of the reference on the
    /// same batch.
    pub fn micro_batch(batch: &RowBatch, reference_log_probs: &[f32]) -> Result<MicroBatch> {
        let rows = batch.targets.dim(0)?;
        if reference_log_probs.len() != rows || rows % 2 != 0 {
            return Err(TuneError::input(
                "reference log-probabilities",
                format!("one per row of an even number of rows ({rows})"),
                reference_log_probs.len().to_string(),
            ));
        }
        let refs = Tensor::from_slice(reference_log_probs, rows, batch.targets.device())?;
        Ok(
            MicroBatch::new(batch.inputs.clone(), batch.targets.clone())?
                .with(REFERENCE_LOG_PROBS, refs)?,
        )
    }

    /// What the head saw since the last call, and resets it. On this rank only: add the
    /// data-parallel ranks' with [`DpoStats::all_reduce`].
    pub fn take_stats(&self) -> DpoStats {
        match self.stats.lock() {
            Ok(mut s) => std::mem::take(&mut *s),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        }
    }

    /// The statistics of `batch` under the policy's own weights (no gradient kept), against
    /// the reference's log-probabilities of its rows: held-out evaluation.
    pub fn evaluate(&self, batch: &RowBatch, reference_log_probs: &[f32]) -> Result<DpoStats> {
        let mb = Self::micro_batch(batch, reference_log_probs)?;
        let mut x = self.policy.embed(&batch.inputs)?;
        for i in 0..self.policy.n_blocks() {
            x = self.policy.block(i, &x)?.detach();
        }
        let (_, stats) = self.head(&x, &mb, &self.policy.named_parameters())?;
        Ok(stats)
    }

    fn head(
        &self,
        x: &Tensor,
        batch: &MicroBatch,
        p: &dyn kiln_model::ParamSource,
    ) -> Result<(Tensor, DpoStats)> {
        let (rows, t, _) = x.dims3()?;
        let tok = batch.targets();
        if tok.dims() != [rows, t] || rows % 2 != 0 {
            return Err(TuneError::input(
                "DPO targets",
                format!("[{rows}, {t}] over an even number of rows"),
                format!("{:?}", tok.dims()),
            ));
        }
        let r = batch.require(REFERENCE_LOG_PROBS)?;
        if r.dims() != [rows] || r.dtype() != DType::F32 {
            return Err(TuneError::input(
                REFERENCE_LOG_PROBS,
                format!("f32 [{rows}] (DpoObjective::micro_batch)"),
                format!("{:?} {:?}", r.dtype(), r.dims()),
            ));
        }
        let refs: Vec<f32> = r.to_vec1()?;
        let lp = sequence_log_probs(self.policy, x, tok, p)?;
        let n = rows / 2;
        let dt = lp.dtype();
        let r = r.to_device(lp.device())?.to_dtype(dt)?;
        let (pc, pr) = (lp.narrow(0, 0, n)?, lp.narrow(0, n, n)?);
        let (rc, rr) = (r.narrow(0, 0, n)?, r.narrow(0, n, n)?);
        let loss = dpo_loss(&pc, &pr, &rc, &rr, &self.cfg)?;
        // what the head saw, for the caller's metrics
        let pol: Vec<f32> = lp.detach().to_dtype(DType::F32)?.to_vec1()?;
        let beta = self.cfg.beta as f32;
        let mut s = DpoStats {
            pairs: n as f64,
            loss: loss.detach().to_dtype(DType::F64)?.to_scalar::<f64>()? * n as f64,
            ..DpoStats::default()
        };
        for i in 0..n {
            let cw = beta * (pol[i] - refs[i]);
            let cl = beta * (pol[n + i] - refs[n + i]);
            s.chosen_reward += f64::from(cw);
            s.rejected_reward += f64::from(cl);
            s.reward_correct += half_credit(cw, cl);
            s.policy_correct += half_credit(pol[i], pol[n + i]);
        }
        Ok((loss, s))
    }
}

impl SegmentedModel for DpoObjective<'_> {
    fn num_segments(&self) -> usize {
        self.policy.n_blocks() + 2
    }

    fn forward_segment(
        &self,
        i: usize,
        input: &Tensor,
        batch: &MicroBatch,
        params: &SegmentParams,
    ) -> candle_core::Result<Tensor> {
        if let Some(out) = crate::logprob::trunk_segment(self.policy, i, input, params) {
            return out;
        }
        let (loss, s) = self
            .head(input, batch, params)
            .map_err(candle_core::Error::wrap)?;
        match self.stats.lock() {
            Ok(mut g) => g.add(&s),
            Err(p) => p.into_inner().add(&s),
        }
        Ok(loss)
    }
}
