//! Data parallel and ZeRO stages 1 to 3 over the segmented executor.
//!
//! One engine, four stages, all on the same [`FlatLayout`] units:
//! - [`ZeroStage::Replicated`] (PyTorch DDP): every rank keeps full gradients, all-reduces them (mean)
//!   unit by unit as soon as a unit's segment has finished its backward, on a communication
//!   thread that overlaps the backward of the segments below, and steps the full optimizer.
//! - [`ZeroStage::Zero1`]: the fp32 master weights and the AdamW moments are sharded: each rank steps
//!   only its chunk of every unit (per [`kiln_comm::chunk_range`]) and the updated weights are
//!   all-gathered.
//! - [`ZeroStage::Zero2`]: gradients are reduce-scattered instead, so each rank keeps only its chunk
//!   (full unit buffers are transient, taken from a pool and returned after the collective).
//! - [`ZeroStage::Zero3`]: parameters are sharded too: the model holds no persistent weights; each
//!   segment's units are all-gathered just before the segment runs (forward, and again for the
//!   recompute of a checkpointed segment) and dropped after, through the executor's
//!   [`ParamProvider`].
//!
//! Every stage reduces each element in the same rank order and the optimizer is element-wise, so
//! without gradient accumulation all four produce bitwise the same parameters. With accumulation,
//! stages 0 and 1 sum micro-batches locally and communicate once (`no_sync`), while stages 2 and 3
//! reduce-scatter every micro-batch into the shard (DeepSpeed's behaviour); the results then agree
//! to rounding.
//!
//! Loss scaling: the found-inf flag is all-reduced (MAX) over the whole world, so every rank
//! skips together. Clipping uses the global norm computed from each rank's chunks.

mod config;
mod data_parallel;
mod hooks;
mod worker;

pub use config::{DataParallelConfig, StepPreview, StepReport};
pub use data_parallel::{DataParallel, DeferredGrads, PipelineTrace};
