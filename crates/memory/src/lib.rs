//! Making big models fit: segmented execution with hooks between segments, activation
//! checkpointing, memory estimates and a micro-batch size that follows the memory budget.
//!
//! - [`Executor`] runs a [`SegmentedModel`] (embedding, blocks, head) forward and then backward
//!   one segment at a time. A [`GradHook`] receives each segment's gradients as soon as they
//!   exist (data parallel overlaps its all-reduce with the backward of the segments below), a
//!   [`ParamProvider`] supplies each segment's parameters per call (ZeRO-3 gathers and frees
//!   them), and a [`RecomputePolicy`] drops chosen segments' activations after forward and
//!   recomputes them before backward, whole or selectively (only the cheap ops' outputs,
//!   computed again where the backward needs them, [`tape::Thinned`]). Gradients equal a
//!   whole-model `backward()`.
//! - [`MemoryPlan::estimate`] gives bytes per rank for weights, gradients, optimizer states
//!   (the ZeRO paper's formulas), activations and communication buffers;
//!   [`MemoryPlan::estimate_stage`] those of one pipeline rank under a [`PipelinePlan`] (its
//!   stage's parameters, the micro-batches its [`PipelineSchedule`] holds in flight).
//! - [`DynamicBatch`] picks the largest micro-batch that fits a budget and adapts to
//!   out-of-memory and headroom reports while the global batch stays constant.
//!
//! ```
//! use kiln_memory::{MemPrecision, MemoryPlan, ModelShape, PipelinePlan, PipelineSchedule};
//! use kiln_memory::{RecomputePolicy, ZeroStage};
//! let shape = ModelShape::gpt(96, 12288, 96, 2048, 50257);
//! let plan = MemoryPlan {
//!     shape, precision: MemPrecision::Mixed16, stage: ZeroStage::Zero3,
//!     dp: 64, tp: 1, micro_batch: 1, recompute: RecomputePolicy::EveryBlock, bucket_bytes: 25 << 20,
//!     sequence_parallel: false,
//! };
//! let e = plan.estimate()?;
//! // ZeRO-3: 16 bytes per parameter (2 + 2 + 12) spread over 64 ranks: about 43.6 GB each
//! let want = 16.0 * shape.params() as f64 / 64.0;
//! assert!((e.model_states() as f64 - want).abs() < 4.0);
//! // 16 pipeline stages of 6 blocks under 1F1B: rank 0 holds 16 micro-batches in flight, the
//! // last one; together they hold the model and the tied embedding's copy
//! let pipe = PipelinePlan::new(16, 1, 64, PipelineSchedule::OneFOneB);
//! let stages = plan.estimate_pipeline(&pipe)?;
//! assert_eq!((stages[0].blocks, stages[0].in_flight, stages[15].in_flight), (6, 16, 1));
//! let held: u64 = stages.iter().map(|s| s.memory.params_per_rank).sum();
//! assert_eq!(held, shape.params() + shape.vocab * shape.d_model);
//! # Ok::<(), kiln_memory::MemoryError>(())
//! ```
#![deny(missing_docs)]

mod batch;
mod dynamic_batch;
mod error;
mod estimate;
mod segment;
pub mod tape;

pub use batch::MicroBatch;
pub use dynamic_batch::DynamicBatch;
pub use error::{BoxError, MemoryError, Result};
pub use estimate::{
    MemPrecision, MemoryEstimate, MemoryPlan, ModelShape, PipelinePlan, PipelineSchedule,
    StageEstimate,
};
pub use kiln_state::ZeroStage;
pub use segment::{
    Backwarded, CollectGrads, Executor, Forwarded, GradHook, ParamProvider, Phase, RecomputePolicy,
    SegmentParams, SegmentedModel, StaticParams, StepOutput, WeightPass,
};
