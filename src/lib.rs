//! kiln: reusable Rust libraries for training large language models.
//!
//! This facade re-exports each of kiln's crates as a module (each behind a cargo feature of
//! the same name, all on by default), so a project can depend on `kiln` alone:
//!
//! - [`comm`]: the `Communicator` trait, the thread backend and the collectives.
//! - `launch`: who a process is under its launcher, the rendezvous store, the local launcher
//!   and the restart supervisor.
//! - `precision`: precision policy, loss scaling, non-finite checks.
//! - `optim`: AdamW on flat f32 shards, learning-rate schedules, global-norm clipping.
//! - `memory`: the segmented executor, activation recomputation, memory estimates.
//! - `kernels`: the computation: the CPU matrix products every dense layer uses, the fused ops'
//!   CPU and CUDA kernels.
//! - `model`: the GPT-3-style decoder and its trainable fused ops.
//! - `parallel`: data parallel, ZeRO stages 1-3, tensor parallel.
//! - `data`: tokenizer, token shards, distributed sampler, mixture, quality filters, prefetch.
//! - `ckpt`: sharded, atomic, checksummed checkpoints with resharding.
//! - `monitor`: metrics, sinks (JSONL, console, TensorBoard, PNG), detectors, circuit breaker.
//! - `tune`: post-training: instruction fine-tuning, LoRA, a reward model, DPO, int8 QAT.
//! - `train`: the reference `Trainer` assembled from all of the above, and `RunConfig`.
//! - `alloc` (feature `mimalloc`): `KilnAlloc`, the global allocator kiln's binaries and
//!   published figures use (mimalloc with purging off).
//!
//! ```
//! use kiln::comm::{spawn, CommExt, Communicator, ReduceOp};
//! let maxes = spawn(2, |comm| comm.all_reduce_scalar(comm.rank() as f64, ReduceOp::Max)).unwrap();
//! assert_eq!(maxes, vec![1.0, 1.0]);
//! ```
#![deny(missing_docs)]

#[cfg(feature = "ckpt")]
pub use kiln_ckpt as ckpt;
pub use kiln_comm as comm;
#[cfg(feature = "data")]
pub use kiln_data as data;
#[cfg(feature = "kernels")]
pub use kiln_kernels as kernels;
#[cfg(feature = "launch")]
pub use kiln_launch as launch;
#[cfg(feature = "memory")]
pub use kiln_memory as memory;
#[cfg(feature = "model")]
pub use kiln_model as model;
#[cfg(feature = "monitor")]
pub use kiln_monitor as monitor;
#[cfg(feature = "optim")]
pub use kiln_optim as optim;
#[cfg(feature = "parallel")]
pub use kiln_parallel as parallel;
#[cfg(feature = "precision")]
pub use kiln_precision as precision;
pub use kiln_state as state;
#[cfg(feature = "train")]
pub use kiln_train as train;
#[cfg(feature = "mimalloc")]
pub use kiln_train::alloc;
#[cfg(feature = "tune")]
pub use kiln_tune as tune;
