//! The reference trainer of kiln: every kiln crate assembled into one training loop, built from
//! a TOML [`RunConfig`] and replaceable part by part.
//!
//! - [`RunConfig`]: the whole run (model preset, dp x tp, ZeRO stage, precision, batch shape,
//!   schedule, clipping, activation recomputation, checkpoints, evaluation, data, sinks,
//!   detectors and breaker), with [`RunConfig::preset`]s, TOML files, validation that names the
//!   field, and command-line overrides ([`RunConfig::from_args`]).
//! - [`Trainer`] and its [`TrainerBuilder`]: one rank of a run over any
//!   [`kiln_comm::Communicator`]. The model ([`TrainModel`], implemented for kiln-model's
//!   GPT), the loss scaler, the schedule, the data, per-sample transforms, the checkpoint
//!   storage, the metric sinks, the detectors and the breaker policy each have a default made
//!   from the configuration and can be replaced. [`run_threads`] runs `dp * tp` thread ranks
//!   and returns a [`TrainSummary`].
//! - The loop: each data-parallel rank loads its slice of the global batch (the tensor-parallel
//!   ranks of one replica load the same one), kiln-parallel's engine runs forward and backward
//!   segment by segment with overlapped gradient reduction and ZeRO, the detectors and the
//!   circuit breaker judge the step before its update is applied (skip the batch, roll back to
//!   the last checkpoint and skip the window, cool the learning rate down, or halt; the same
//!   decision on every rank), the learning rate follows the schedule at the optimizer step (a
//!   skipped step does not advance it), and rank 0 writes the step record to every sink.
//! - Checkpoints ([`state`]): kiln-ckpt [`kiln_ckpt::Stateful`] parts for the master weights,
//!   the AdamW moments, the scaler, the loader position (skip set included), the breaker and
//!   the trainer's counters, stored per parameter with global shapes, so a checkpoint resumes
//!   bitwise on the same layout and reshards to another dp, ZeRO stage or tp. Each checkpoint
//!   records the model's [`kiln_model::GptConfig`] and its folder keeps the run's tokenizer,
//!   so [`Pretrained`] reads any checkpoint back as whole parameters (to export to Hugging
//!   Face's GPT-2 layout, sample, evaluate), and [`ModelSection::init_from`] starts a run from
//!   a checkpoint's or a Hugging Face folder's weights at any dp and tp.
//!
//! ```
//! use kiln_data::{write_shard, TokenDtype, TokenSource, Verify};
//! use kiln_train::{RunConfig, Trainer};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::env::temp_dir().join(format!("kiln-train-doc-{}", std::process::id()));
//! let path = dir.join("toy.bin");
//! std::fs::create_dir_all(&dir)?;
//! write_shard(&path, &(0..8192u32).map(|i| i % 16).collect::<Vec<_>>(), TokenDtype::U16)?;
//! let source = TokenSource::open("toy", &[&path], Verify::Full)?; // 0, 1, ..., 15, 0, 1, ...
//! let mut cfg = RunConfig::preset("tiny")?;
//! cfg.apply_overrides(&[("steps", "25"), ("lr", "1e-2"), ("warmup", "2"), ("out", dir.to_str().ok_or("non-UTF-8 temp dir")?)])?;
//! cfg.apply_overrides(&[("metrics.console", "off"), ("metrics.tensorboard", "off"), ("metrics.png", "off")])?;
//! let comm = kiln_comm::ThreadComm::group(1, Default::default())?.remove(0);
//! let summary = Trainer::builder(cfg).data(vec![source], vec![]).build(comm)?.run()?;
//! // a cyclic sequence is learned: from ln(512) = 6.2 to well under half of it
//! let (first, last) = (summary.losses[0].1, summary.final_loss.ok_or("no loss")?);
//! assert!(first > 6.0 && last < 0.5 * first, "{first} -> {last}");
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

#[cfg(feature = "mimalloc")]
pub mod alloc;
mod config;
mod data;
mod error;
mod model;
mod peak;
mod pretrained;
mod run;
pub mod state;
mod trainer;

pub use config::{
    CheckpointSection, DataSection, DriftSection, DynamicBatchSection, EvalSection, MetricsSection,
    ModelSection, MonitorSection, OptimSection, ParallelSection, PrecisionSection, RunConfig,
    SkipWindows, TrainSection, RUN_PRESETS,
};
pub use data::{decode_sample_id, encode_sample_id, micro_batches, prepare_sources, DataSources};
pub use error::{Result, TrainError};
pub use model::{gpt_config_hash, ModelContext, TrainModel};
pub use peak::run_peak;
pub use pretrained::{Pretrained, PretrainedSource, GPT_META_KEY, TOKENIZER_FILE};
pub use run::{one_op_thread_per_rank, run_threads, run_threads_with, run_with, RankContext};
pub use state::TrainerProgress;
pub use trainer::{
    ModelFn, Outputs, RollbackRecord, StepHook, TrainSummary, Trainer, TrainerBuilder,
    HANG_EXIT_CODE,
};
