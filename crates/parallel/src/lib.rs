//! Data parallel, ZeRO stages 1 to 3 and Megatron-style tensor parallel, proven equal to one
//! rank.
//!
//! - [`ParallelDims`] validates the dp x tp grid against the world and the model and builds the
//!   data-parallel and tensor-parallel groups.
//! - [`FlatLayout`]: the trainable variables in flat f32 units (buckets) in backward order, with
//!   gradient copy-out straight from candle's storage and in-place parameter write-back.
//! - [`DataParallel`]: plain data parallel ([`ZeroStage::Replicated`], bucketed all-reduce overlapped
//!   with the backward on a communication thread, gradient accumulation with `no_sync`) and ZeRO
//!   stages 1, 2 and 3, all driving kiln-memory's segmented executor; loss scaling with a
//!   world-wide found-inf flag and global-norm clipping.
//! - [`tp`]: tensor-parallel building blocks (the f/g conjugate operators, column- and
//!   row-parallel linear layers, a vocab-parallel embedding and cross-entropy).
//!
//! ```
//! use kiln_memory::ModelShape;
//! use kiln_parallel::ParallelDims;
//! let shape = ModelShape::gpt(4, 256, 4, 128, 8192);
//! let dims = ParallelDims::new(2, 2, 4, &shape)?;
//! assert_eq!(dims.world(), 4);
//! # Ok::<(), kiln_parallel::ParallelError>(())
//! ```
#![deny(missing_docs)]

#[cfg(feature = "cuda")]
mod cuda;
mod dims;
mod engine;
mod error;
mod flat;
pub mod pipeline;
mod stages;
mod state;
pub mod tp;

pub use dims::{Groups, ParallelDims};
pub use engine::{
    DataParallel, DataParallelConfig, DeferredGrads, PipelineTrace, StepPreview, StepReport,
};
pub use error::{ParallelError, Result};
pub use flat::{tensor_into_slice, write_var, FlatLayout, ParamSlot, Unit, DEFAULT_BUCKET_BYTES};
pub use kiln_state::ZeroStage;
pub use pipeline::{Action, Costs, PipelineSpec, Schedule, ScheduleError, ScheduleKind, Timeline};
pub use stages::{segment_flops, stage_segments, StageSplit};
pub use state::{checkpoint_geometry, PlannedParam, ShardPlan, StagedState};
