//! Fine-tuning data: instruction examples and preference pairs as model batches (each sequence
//! in its own row, padded, with the loss masked to the response tokens), and
//! [`ExampleLoader`], the deterministic, resumable order in which data-parallel ranks read
//! them.
//!
//! A row holds `prompt ++ response` shifted by one: `inputs[j] = seq[j]`, `targets[j] =
//! seq[j + 1]` where `seq[j + 1]` is a response token and [`IGNORE_INDEX`] where it is a prompt
//! token or padding. Rows never share a sequence, so causal attention needs no extra mask: a
//! response attends to its own prompt only, and the padding after it changes nothing before
//! it. [`RowBatch::micro_batch`] adds the loss mask that leaves the prompts and padding out
//! under the engine; a model's own `loss` needs `GptOptions { ignore_index:
//! Some(IGNORE_INDEX), .. }`.

use crate::error::{Result, TuneError};
use candle_core::{Device, Tensor};
use kiln_data::{DistributedSampler, SamplerConfig, SkipSet, TailPolicy};
use kiln_memory::MicroBatch;
use kiln_state::{StateDict, Stateful};
use serde::{Deserialize, Serialize};

/// The target id that the loss leaves out: prompt positions and padding.
pub const IGNORE_INDEX: u32 = u32::MAX;
/// The input id of padding positions (their targets are [`IGNORE_INDEX`]).
pub const PAD_ID: u32 = 0;

/// One instruction example: a prompt and the response to learn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Example {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The response's token ids (at least one).
    pub response: Vec<u32>,
}

/// One preference pair: a prompt with a preferred and a dispreferred response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreferencePair {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The preferred response.
    pub chosen: Vec<u32>,
    /// The dispreferred response.
    pub rejected: Vec<u32>,
}

/// A batch of rows: inputs and targets `[rows, ctx]` (u32), with the number of response
/// tokens the loss counts.
#[derive(Debug, Clone)]
pub struct RowBatch {
    /// Input ids `[rows, ctx]`.
    pub inputs: Tensor,
    /// Target ids `[rows, ctx]`, [`IGNORE_INDEX`] off the responses.
    pub targets: Tensor,
    /// Response tokens in the batch (targets that count).
    pub response_tokens: usize,
    /// Per row, the position of its last token (the last non-padding input).
    pub last_positions: Vec<u32>,
}

/// The inputs and targets of one `prompt ++ response` row of width `ctx`.
pub fn encode_row(
    prompt: &[u32],
    response: &[u32],
    ctx: usize,
    what: &dyn Fn() -> String,
) -> Result<(Vec<u32>, Vec<u32>)> {
    if prompt.is_empty() || response.is_empty() {
        return Err(TuneError::input(
            what(),
            "a prompt and a response of at least one token each",
            format!(
                "a prompt of {} and a response of {} tokens",
                prompt.len(),
                response.len()
            ),
        ));
    }
    let len = prompt.len() + response.len();
    if len - 1 > ctx {
        return Err(TuneError::input(
            what(),
            format!("at most {} tokens (the context {ctx} plus one)", ctx + 1),
            format!(
                "{len} ({} of prompt, {} of response)",
                prompt.len(),
                response.len()
            ),
        ));
    }
    let seq: Vec<u32> = prompt.iter().chain(response).copied().collect();
    if let Some(&bad) = seq.iter().find(|&&t| t == IGNORE_INDEX) {
        return Err(TuneError::input(
            what(),
            "token ids below the ignore index",
            bad.to_string(),
        ));
    }
    let mut inputs = vec![PAD_ID; ctx];
    let mut targets = vec![IGNORE_INDEX; ctx];
    for j in 0..len - 1 {
        inputs[j] = seq[j];
        if j + 1 >= prompt.len() {
            targets[j] = seq[j + 1];
        }
    }
    Ok((inputs, targets))
}

fn to_batch(
    rows: Vec<(Vec<u32>, Vec<u32>)>,
    ctx: usize,
    device: &Device,
    lens: Vec<usize>,
) -> Result<RowBatch> {
    let n = rows.len();
    let response_tokens = rows
        .iter()
        .map(|(_, t)| t.iter().filter(|&&x| x != IGNORE_INDEX).count())
        .sum();
    let (inputs, targets): (Vec<Vec<u32>>, Vec<Vec<u32>>) = rows.into_iter().unzip();
    Ok(RowBatch {
        inputs: Tensor::from_vec(inputs.concat(), (n, ctx), device)?,
        targets: Tensor::from_vec(targets.concat(), (n, ctx), device)?,
        response_tokens,
        last_positions: lens.into_iter().map(|l| (l - 2) as u32).collect(),
    })
}

impl RowBatch {
    /// The micro-batch the engine trains on: the inputs, the targets and a loss mask that is 1
    /// on the response positions (the targets not equal to [`IGNORE_INDEX`]), so a model
    /// counts only the responses whatever its own `ignore_index`.
    pub fn micro_batch(&self) -> Result<MicroBatch> {
        let mask = self.targets.ne(IGNORE_INDEX)?;
        Ok(MicroBatch::new(self.inputs.clone(), self.targets.clone())?.with_loss_mask(mask)?)
    }
}

/// Instruction examples as one row each, width `ctx`.
pub fn sft_batch(examples: &[&Example], ctx: usize, device: &Device) -> Result<RowBatch> {
    let mut rows = Vec::with_capacity(examples.len());
    let mut lens = Vec::with_capacity(examples.len());
    for (i, e) in examples.iter().enumerate() {
        rows.push(encode_row(&e.prompt, &e.response, ctx, &|| {
            format!("example {i} of the batch")
        })?);
        lens.push(e.prompt.len() + e.response.len());
    }
    to_batch(rows, ctx, device, lens)
}

/// Preference pairs as `2 n` rows of width `ctx`: the chosen responses in rows `0..n`, the
/// rejected ones in rows `n..2n` (pair `i` is rows `i` and `n + i`).
pub fn preference_batch(
    pairs: &[&PreferencePair],
    ctx: usize,
    device: &Device,
) -> Result<RowBatch> {
    let mut rows = Vec::with_capacity(2 * pairs.len());
    let mut lens = Vec::with_capacity(2 * pairs.len());
    for (side, pick) in [("chosen", true), ("rejected", false)] {
        for (i, p) in pairs.iter().enumerate() {
            let r = if pick { &p.chosen } else { &p.rejected };
            rows.push(encode_row(&p.prompt, r, ctx, &|| {
                format!("the {side} response of pair {i} of the batch")
            })?);
            lens.push(p.prompt.len() + r.len());
        }
    }
    to_batch(rows, ctx, device, lens)
}

/// Which examples each data-parallel rank reads, step by step: kiln-data's
/// [`DistributedSampler`] over example indices (a fresh keyed permutation every epoch, every
/// example once per epoch across the group, the same number of batches on every rank). It is
/// [`Stateful`] (its epoch and position in the global order), so a run resumes on the same
/// examples, at the same or another data-parallel degree with the same global batch.
#[derive(Debug, Clone)]
pub struct ExampleLoader {
    sampler: DistributedSampler,
    skip: SkipSet,
}

impl ExampleLoader {
    /// `batch` examples per rank per step out of `num_examples`, for rank `rank` of `dp`,
    /// ordered by `seed`. Rejects fewer examples than one global batch.
    pub fn new(
        num_examples: usize,
        dp: usize,
        rank: usize,
        batch: usize,
        seed: u64,
    ) -> Result<Self> {
        let sampler = DistributedSampler::new(SamplerConfig {
            num_samples: num_examples as u64,
            dp,
            rank,
            batch_size: batch,
            seed,
            tail: TailPolicy::Drop,
        })?;
        Ok(Self {
            sampler,
            skip: SkipSet::new(),
        })
    }

    /// This rank's next batch of example indices.
    pub fn next_indices(&mut self) -> Result<Vec<usize>> {
        Ok(self
            .sampler
            .next_batch(&self.skip)?
            .into_iter()
            .map(|s| s.id.index as usize)
            .collect())
    }

    /// The epoch of the next batch.
    pub fn epoch(&self) -> u64 {
        self.sampler.cursor().epoch
    }
}

impl Stateful for ExampleLoader {
    fn state(&self) -> kiln_state::Result<StateDict> {
        let mut sd = StateDict::new();
        let c = self.sampler.cursor();
        let cfg = self.sampler.config();
        sd.set_meta("epoch", c.epoch)?;
        sd.set_meta("pos", c.pos)?;
        sd.set_meta("num_examples", cfg.num_samples)?;
        sd.set_meta("global_batch", (cfg.dp * cfg.batch_size) as u64)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
        let cfg = *self.sampler.config();
        let n: u64 = state.meta("num_examples")?;
        let g: u64 = state.meta("global_batch")?;
        let mine = (cfg.dp * cfg.batch_size) as u64;
        if n != cfg.num_samples || g != mine {
            return Err(kiln_state::StateError::component(
                "example loader",
                format!(
                    "saved over {n} examples in global batches of {g}, but this loader has {} \
                     examples in global batches of {mine}",
                    cfg.num_samples
                ),
            ));
        }
        self.sampler.set_cursor(kiln_data::Cursor {
            epoch: state.meta("epoch")?,
            pos: state.meta("pos")?,
        });
        Ok(())
    }
}
