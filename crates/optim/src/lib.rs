//! Optimizers for kiln: AdamW on flat f32 shards, learning-rate schedules, and global-norm
//! gradient clipping over shards.
//!
//! - [`Optimizer`]: `step(params, grads, lr)` on a flat f32 buffer or one rank's shard of it,
//!   with its state exposed as named buffers for checkpoints.
//! - [`AdamW`]: `torch.optim.AdamW` operation for operation, one fused vectorised pass over
//!   parameters, gradients and both moments; a shard computes bitwise what the whole buffer
//!   does, and [`AdamWState`] (serde) resumes bitwise.
//! - [`LrSchedule`]: a pure function of the step. [`WarmupDecay`] (linear warmup, then cosine
//!   or linear decay to a floor) and [`Constant`].
//! - [`clip_grad_norm`]: PyTorch's global-norm clipping where each rank holds a shard; the sum
//!   of squares ([`SquareSum`]) is exact, so the result does not depend on the sharding.
//!   Non-finite norms leave the gradients alone and are reported in the [`ClipReport`].
//!
//! ```
//! use kiln_optim::{clip_grad_norm_local, AdamW, AdamWConfig, LrSchedule, Optimizer, WarmupDecay};
//!
//! let sched = WarmupDecay::cosine(1e-2, 1e-3, 10, 100)?;
//! assert_eq!((sched.lr(0), sched.lr(5), sched.lr(10), sched.lr(100)), (0.0, 5e-3, 1e-2, 1e-3));
//!
//! let mut grads = vec![3.0f32, 4.0]; // norm 5
//! let report = clip_grad_norm_local(&mut grads, 1.0)?;
//! assert_eq!(report.norm, 5.0);
//! assert!((grads[0] - 0.6).abs() < 1e-6 && (grads[1] - 0.8).abs() < 1e-6);
//!
//! let mut params = vec![1.0f32, 1.0];
//! let mut opt = AdamW::new(2, AdamWConfig::default())?;
//! opt.step(&mut params, &grads, sched.lr(opt.step_count() + 10))?;
//! // decay by 1 - lr * 0.01, then a first Adam step of lr * sign(grad)
//! assert!((params[0] - (1.0 - 1e-4 - 1e-2)).abs() < 1e-6);
//! # Ok::<(), kiln_optim::OptimError>(())
//! ```
#![deny(missing_docs)]

mod adamw;
mod clip;
mod error;
mod groups;
mod optimizer;
mod schedule;
mod sgd;

pub use adamw::{AdamW, AdamWConfig, AdamWState, StepConsts, PARALLEL_MIN_LEN};
pub use clip::{
    clip_grad_norm, clip_grad_norm_local, clip_to_norm, global_grad_norm, ClipReport, SquareSum,
};
pub use error::{OptimError, Result};
pub use groups::{DecayOverride, ParamKind, WeightDecayGroups};
pub use optimizer::{Optimizer, OptimizerConfig, OptimizerFactory, ParallelRunner};
pub use schedule::{Constant, Decay, DecayShape, LrSchedule, ScheduleConfig, Warmup, WarmupDecay};
pub use sgd::{Sgd, SgdConfig};
