//! The [`Optimizer`] trait: an optimizer over one flat f32 buffer (or a shard of it) that owns
//! its state, so that ZeRO can give each rank the state of its own shard.

use crate::error::Result;

/// An optimizer over a flat f32 buffer of a fixed length: the whole parameter buffer, or the
/// shard of it that this rank owns.
///
/// Element-wise optimizers (AdamW) guarantee that a shard holding elements `a..b` of the buffer
/// computes bitwise the same values as the unsharded optimizer does for `a..b`.
pub trait Optimizer: Send {
    /// Number of parameters this optimizer holds state for.
    fn len(&self) -> usize;

    /// True when the optimizer holds no parameters (an empty shard).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of steps taken so far (0 before the first step). Skipped steps (overflow) are not
    /// counted because [`Optimizer::step`] is not called for them; an LR schedule indexed by
    /// this count does not advance on them.
    fn step_count(&self) -> u64;

    /// Sets the step count (when restoring a checkpoint from tensors).
    fn set_step_count(&mut self, step: u64);

    /// One update of `params` from `grads` at learning rate `lr`. Both slices must have
    /// [`Optimizer::len`] elements, or [`crate::OptimError::LengthMismatch`] is returned and
    /// nothing changes.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()>;

    /// The state buffers, each of [`Optimizer::len`] elements, by name (for checkpoints that
    /// store tensors: AdamW gives `exp_avg` and `exp_avg_sq`, PyTorch's names).
    fn state_buffers(&self) -> Vec<(&'static str, &[f32])>;

    /// The state buffers, writable (to restore them from a checkpoint in place).
    fn state_buffers_mut(&mut self) -> Vec<(&'static str, &mut [f32])>;
}
