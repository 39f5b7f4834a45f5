//! [`Trainer`]: every kiln crate assembled into one training loop, and its builder.

mod builder;
mod checkpoint;
mod eval;
mod record;
mod step;

pub use builder::TrainerBuilder;

use crate::config::RunConfig;
use crate::error::Result;
use crate::model::{ModelContext, TrainModel};
use crate::state::TrainerProgress;
use kiln_ckpt::{Checkpointer, RngState};
use kiln_comm::Communicator;
use kiln_data::{DataLoader, DriftMonitor, LoaderConfig, QualityReport, TokenSource};
use kiln_model::Gpt;
use kiln_monitor::{
    CircuitBreaker, DetectorSet, Event, EventKind, Mfu, MultiSink, PeakFlops, StepMetrics, Watchdog,
};
use kiln_optim::LrSchedule;
use kiln_parallel::{DataParallel, ParallelDims, StagedState};
use kiln_precision::LossScaler;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The exit status of a process whose hang watchdog fired in a multi-process run (the MPI
/// backend): the process prints the hang report and exits so that the launcher ends the job.
pub const HANG_EXIT_CODE: i32 = 75;

/// A model factory: builds this rank's model from the run configuration and its
/// tensor-parallel group.
pub type ModelFn<M> = Box<dyn FnOnce(&ModelContext<'_>) -> Result<M>>;

/// A callback run on every rank after every step with its record.
pub type StepHook = Box<dyn FnMut(&StepMetrics)>;

/// Where a run's outputs went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outputs {
    /// The JSONL metrics log.
    pub jsonl: Option<PathBuf>,
    /// The TensorBoard event directory.
    pub tensorboard: Option<PathBuf>,
    /// The loss plot (written when the run ends).
    pub png: Option<PathBuf>,
    /// The checkpoint directory (when checkpoints go to the local filesystem).
    pub checkpoints: Option<PathBuf>,
}

/// A rollback the circuit breaker ordered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackRecord {
    /// The step whose result triggered it.
    pub at_step: u64,
    /// The checkpoint step restored.
    pub to_step: u64,
    /// The samples skipped from then on ([`crate::encode_sample_id`] form).
    pub skipped_samples: Vec<u64>,
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    /// The last step completed.
    pub steps: u64,
    /// The loss of the last step.
    pub final_loss: Option<f32>,
    /// The last validation loss.
    pub val_loss: Option<f64>,
    /// Tokens per second over this run (all data-parallel ranks, wall time).
    pub tokens_per_s: f64,
    /// Wall time of this run in seconds.
    pub wall_s: f64,
    /// Tokens trained on since step 0 (all data-parallel ranks).
    pub tokens_seen: u64,
    /// `(step, loss)` of every step this run kept (steps undone by a rollback removed).
    pub losses: Vec<(u64, f32)>,
    /// `(step, validation loss)` of every evaluation.
    pub val_losses: Vec<(u64, f64)>,
    /// The step of the checkpoint this run resumed from.
    pub resumed_from: Option<u64>,
    /// Damaged checkpoints passed over when resuming, newest first.
    pub skipped_checkpoints: Vec<u64>,
    /// Checkpoints this run saved.
    pub checkpoints: Vec<u64>,
    /// Rollbacks this run made.
    pub rollbacks: Vec<RollbackRecord>,
    /// Steps whose update was not applied (loss-scaler overflows and skipped batches), since
    /// step 0.
    pub skipped_steps: u64,
    /// The last step record.
    pub last_metrics: Option<StepMetrics>,
    /// Where the outputs went.
    pub outputs: Outputs,
    /// What the perplexity filter kept and dropped of each corpus (when it ran).
    pub quality: Vec<(String, QualityReport)>,
    /// Samples trained on from each training source since step 0, all data-parallel ranks
    /// (the realised mixture).
    pub source_samples: Vec<(String, u64)>,
    /// The drift monitor's divergence after the last step, and its threshold.
    pub drift: Option<(f64, f64)>,
    /// Steps of this run at which the drift monitor's alert was raised.
    pub drift_alerts: u64,
    /// The peak FLOP/s the `mfu` metric divides by, with its basis (none when no peak is
    /// known: see [`crate::run_peak`]).
    pub mfu_peak: Option<PeakFlops>,
}

/// One rank of a training run: the model, the data-parallel engine, the loss scaler, the
/// schedule, the data loader, the checkpointer, the metric sinks (rank 0), the detectors, the
/// circuit breaker and the watchdog.
///
/// ```no_run
/// use kiln_train::{RunConfig, Trainer};
/// // one rank; see run_threads for several
/// let cfg = RunConfig::preset("tiny")?;
/// let comm = kiln_comm::ThreadComm::group(1, Default::default())?.remove(0);
/// let summary = Trainer::builder(cfg).build(comm)?.run()?;
/// println!("final loss {:?}", summary.final_loss);
/// # Ok::<(), kiln_train::TrainError>(())
/// ```
pub struct Trainer<M: TrainModel = Gpt> {
    cfg: RunConfig,
    world: Arc<dyn Communicator>,
    dp: Arc<dyn Communicator>,
    tp: Arc<dyn Communicator>,
    dims: ParallelDims,
    /// The pipeline group (this rank alone without a pipeline).
    pp: Arc<dyn Communicator>,
    /// This rank's pipeline schedule and chunks, when `parallel.pp > 1`.
    stage_plan: Option<builder::StagePlan>,
    model: M,
    engine: DataParallel,
    scaler: Box<dyn LossScaler>,
    schedule: Box<dyn LrSchedule>,
    loader: DataLoader,
    loader_cfg: LoaderConfig,
    source_names: Vec<String>,
    quality: Vec<(String, QualityReport)>,
    drift: Option<DriftMonitor>,
    drift_alerts: u64,
    val_sources: Vec<TokenSource>,
    ckpt: Option<Checkpointer>,
    /// The engine's state for async saves, copied on this thread and turned into its
    /// checkpoint part on the writer's; its buffers are kept from one save to the next.
    staged: Arc<Mutex<StagedState>>,
    sinks: MultiSink,
    detectors: Option<DetectorSet>,
    breaker: Option<CircuitBreaker>,
    watchdog: Option<Watchdog>,
    progress: TrainerProgress,
    rng: RngState,
    mfu: Option<Mfu>,
    mfu_peak: Option<PeakFlops>,
    last_ckpt: Option<u64>,
    losses: Vec<(u64, f32)>,
    val_losses: Vec<(u64, f64)>,
    checkpoints: Vec<u64>,
    rollbacks: Vec<RollbackRecord>,
    resumed_from: Option<u64>,
    skipped_checkpoints: Vec<u64>,
    outputs: Outputs,
    on_step: Option<StepHook>,
    last_metrics: Option<StepMetrics>,
    pending_events: Vec<Event>,
    run_tokens: u64,
    started: Instant,
}

impl<M: TrainModel> std::fmt::Debug for Trainer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("run", &self.cfg.name)
            .field("rank", &self.world.rank())
            .field("step", &self.progress.step)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl<M: TrainModel> Trainer<M> {
    /// The run configuration.
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The data-parallel engine.
    pub fn engine(&self) -> &DataParallel {
        &self.engine
    }

    /// The data loader.
    pub fn loader(&self) -> &DataLoader {
        &self.loader
    }

    /// The drift monitor, when `RunConfig.data.drift.enabled`.
    pub fn drift_monitor(&self) -> Option<&DriftMonitor> {
        self.drift.as_ref()
    }

    /// The circuit breaker, when monitoring is on.
    pub fn breaker(&self) -> Option<&CircuitBreaker> {
        self.breaker.as_ref()
    }

    /// The last step completed.
    pub fn step(&self) -> u64 {
        self.progress.step
    }

    /// The counters a checkpoint saves.
    pub fn progress(&self) -> &TrainerProgress {
        &self.progress
    }

    /// This rank's global index.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The parallel layout.
    pub fn dims(&self) -> ParallelDims {
        self.dims
    }

    /// Trains until `RunConfig.train.steps` (collective), then waits for the last checkpoint,
    /// closes the sinks (the PNG is drawn then) and returns the summary.
    pub fn run(mut self) -> Result<TrainSummary> {
        while self.progress.step < self.cfg.train.steps {
            self.train_step()?;
        }
        self.finish()
    }

    /// Waits for an async save in flight, closes the sinks and stops the watchdog; returns the
    /// summary (collective).
    pub fn finish(mut self) -> Result<TrainSummary> {
        if let Some(c) = self.ckpt.as_mut() {
            c.wait()?;
        }
        let done = Event::new(
            EventKind::Info,
            self.progress.step,
            format!(
                "done at step {} in {:.1} s",
                self.progress.step,
                self.started.elapsed().as_secs_f64()
            ),
        );
        self.emit_events(&[done])?;
        self.close_sinks()?;
        if let Some(w) = self.watchdog.take() {
            w.stop();
        }
        let wall_s = self.started.elapsed().as_secs_f64();
        Ok(TrainSummary {
            steps: self.progress.step,
            final_loss: self.losses.last().map(|(_, l)| *l),
            val_loss: self.val_losses.last().map(|(_, v)| *v),
            tokens_per_s: if wall_s > 0.0 {
                self.run_tokens as f64 / wall_s
            } else {
                0.0
            },
            wall_s,
            tokens_seen: self.progress.tokens_seen,
            losses: self.losses,
            val_losses: self.val_losses,
            resumed_from: self.resumed_from,
            skipped_checkpoints: self.skipped_checkpoints,
            checkpoints: self.checkpoints,
            rollbacks: self.rollbacks,
            skipped_steps: self.progress.skipped_steps,
            last_metrics: self.last_metrics,
            outputs: self.outputs,
            quality: self.quality,
            source_samples: self
                .source_names
                .iter()
                .cloned()
                .zip(
                    self.progress
                        .source_samples
                        .iter()
                        .copied()
                        .chain(std::iter::repeat(0)),
                )
                .collect(),
            drift: self.drift.as_ref().map(|m| (m.kl(), m.threshold())),
            drift_alerts: self.drift_alerts,
            mfu_peak: self.mfu_peak,
        })
    }
}
