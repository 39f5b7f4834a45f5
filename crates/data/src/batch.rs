//! A batch as the loader hands it to the trainer.

use crate::sample::SampleId;

/// One rank's batch of `batch_size` samples of `ctx` input tokens each, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The global batch index (the step it is meant for, counted from the start of training).
    pub step: u64,
    /// Rows.
    pub batch_size: usize,
    /// Tokens per row.
    pub ctx: usize,
    /// Input tokens, `batch_size * ctx`, after any transforms.
    pub inputs: Vec<u32>,
    /// Next-token targets, `batch_size * ctx`: `targets[r*ctx + i]` follows `inputs[r*ctx + i]`
    /// in the source.
    pub targets: Vec<u32>,
    /// The sample of each row (which also names its source).
    pub sample_ids: Vec<SampleId>,
    /// The epoch, in its source, of each row's sample.
    pub epochs: Vec<u64>,
}

impl Batch {
    /// The source of each row.
    pub fn sources(&self) -> Vec<u32> {
        self.sample_ids.iter().map(|s| s.source).collect()
    }

    /// Input tokens of row `r`.
    pub fn row_inputs(&self, r: usize) -> &[u32] {
        &self.inputs[r * self.ctx..(r + 1) * self.ctx]
    }

    /// Targets of row `r`.
    pub fn row_targets(&self, r: usize) -> &[u32] {
        &self.targets[r * self.ctx..(r + 1) * self.ctx]
    }

    /// Input tokens in the batch (`batch_size * ctx`).
    pub fn num_tokens(&self) -> usize {
        self.inputs.len()
    }
}
