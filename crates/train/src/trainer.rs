//! [`Trainer`]: every kiln crate assembled into one training loop, and its builder.

use crate::config::RunConfig;
use crate::data::{
    decode_sample_id, encode_sample_id, micro_batches, prepare_sources, DataSources,
};
use crate::error::{Result, TrainError};
use crate::model::{ModelContext, TrainModel};
use crate::state::TrainerProgress;
use candle_core::{Tensor, Var};
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, Latest, Layout, LoadOptions, Loaded, LocalFs, RankState,
    Retention, RngState, SavePolicy, Storage,
};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_data::{Batch, DataLoader, LoaderConfig, TokenSource, Transform};
use kiln_memory::{ModelShape, SegmentParams};
use kiln_model::Gpt;
use kiln_monitor::{
    Action, BatchInfo, BreakerPolicy, CircuitBreaker, ConsoleSink, Decision, DetectorSet, Event,
    EventKind, JsonlSink, MetricSink, Mfu, MultiSink, PlotSink, RankStats, RankSummary,
    ScalerEvent, StepMetrics, TensorBoardSink, Watchdog,
};
use kiln_optim::LrSchedule;
use kiln_parallel::ShardPlan;
use kiln_parallel::{DataParallel, DataParallelConfig, ParallelDims, Stage};
use kiln_precision::{ComputeDType, DynamicLossScaler, LossScaler, NoScaler, ScaleEvent};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
}

/// Builds a [`Trainer`]: every part has a default made from the [`RunConfig`] and can be
/// replaced.
pub struct TrainerBuilder<M: TrainModel = Gpt> {
    config: RunConfig,
    model_fn: ModelFn<M>,
    sinks: Vec<Box<dyn MetricSink>>,
    default_sinks: bool,
    detectors: Option<DetectorSet>,
    breaker: Option<BreakerPolicy>,
    scaler: Option<Box<dyn LossScaler>>,
    schedule: Option<Box<dyn LrSchedule>>,
    data: Option<DataSources>,
    transforms: Vec<Arc<dyn Transform>>,
    storage: Option<Arc<dyn Storage>>,
    on_step: Option<StepHook>,
}

impl<M: TrainModel> std::fmt::Debug for TrainerBuilder<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainerBuilder")
            .field("config", &self.config.name)
            .field("sinks", &self.sinks.len())
            .finish_non_exhaustive()
    }
}

impl<M: TrainModel> TrainerBuilder<M> {
    /// Replaces the model: `f` builds this rank's model (use [`ModelContext::tp`] to split it
    /// over the tensor-parallel group).
    pub fn model<N: TrainModel>(
        self,
        f: impl FnOnce(&ModelContext<'_>) -> Result<N> + 'static,
    ) -> TrainerBuilder<N> {
        TrainerBuilder {
            config: self.config,
            model_fn: Box::new(f),
            sinks: self.sinks,
            default_sinks: self.default_sinks,
            detectors: self.detectors,
            breaker: self.breaker,
            scaler: self.scaler,
            schedule: self.schedule,
            data: self.data,
            transforms: self.transforms,
            storage: self.storage,
            on_step: self.on_step,
        }
    }

    /// Adds a metric sink (on rank 0, beside the configured ones).
    pub fn sink(mut self, sink: impl MetricSink + 'static) -> Self {
        self.sinks.push(Box::new(sink));
        self
    }

    /// Turns the sinks of `RunConfig.metrics` off (or on); added sinks stay.
    pub fn default_sinks(mut self, on: bool) -> Self {
        self.default_sinks = on;
        self
    }

    /// Replaces the detectors (default from `RunConfig.monitor`).
    pub fn detectors(mut self, detectors: DetectorSet) -> Self {
        self.detectors = Some(detectors);
        self
    }

    /// Replaces the circuit breaker's policy (default from `RunConfig.monitor`).
    pub fn breaker(mut self, policy: BreakerPolicy) -> Self {
        self.breaker = Some(policy);
        self
    }

    /// Replaces the loss scaler (default: dynamic for f16, none otherwise).
    pub fn scaler(mut self, scaler: Box<dyn LossScaler>) -> Self {
        self.scaler = Some(scaler);
        self
    }

    /// Replaces the learning-rate schedule, indexed by optimizer steps (default from
    /// `RunConfig.optim`).
    pub fn schedule(mut self, schedule: Box<dyn LrSchedule>) -> Self {
        self.schedule = Some(schedule);
        self
    }

    /// Trains on these sources instead of the configured corpus; `val` may be empty.
    pub fn data(mut self, train: Vec<TokenSource>, val: Vec<TokenSource>) -> Self {
        self.data = Some(DataSources {
            train,
            val,
            vocab_size: None,
        });
        self
    }

    /// Adds a per-sample transform to the training loader (runs on its worker threads).
    pub fn transform(mut self, t: Arc<dyn Transform>) -> Self {
        self.transforms.push(t);
        self
    }

    /// Keeps checkpoints in `storage` instead of the local checkpoint directory.
    pub fn storage(mut self, storage: Arc<dyn Storage>) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Calls `f` on every rank after every step with the step's record.
    pub fn on_step(mut self, f: impl FnMut(&StepMetrics) + 'static) -> Self {
        self.on_step = Some(Box::new(f));
        self
    }

    /// Builds this rank's trainer over the world communicator `comm` (collective: every rank
    /// of the world calls it): validates the configuration, splits the world into
    /// data-parallel and tensor-parallel groups, builds the model, the engine, the data
    /// loader, the checkpointer, the sinks (rank 0), the detectors, the breaker and the
    /// watchdog, and resumes from a checkpoint when asked to.
    pub fn build(self, comm: impl Communicator + 'static) -> Result<Trainer<M>> {
        let world: Arc<dyn Communicator> = Arc::new(comm);
        self.build_shared(world)
    }

    /// [`TrainerBuilder::build`] over a shared communicator.
    pub fn build_shared(self, world: Arc<dyn Communicator>) -> Result<Trainer<M>> {
        let cfg = self.config;
        cfg.validate()?;
        let gpt = cfg.gpt_config()?;
        let p = &cfg.parallel;
        if world.world_size() != p.world() {
            return Err(TrainError::config(
                "RunConfig.parallel",
                format!(
                    "dp ({}) x tp ({}) = {} but the communicator has {} ranks",
                    p.dp,
                    p.tp,
                    p.world(),
                    world.world_size()
                ),
            ));
        }
        let shape = ModelShape {
            n_layers: gpt.n_layers as u64,
            d_model: gpt.d_model as u64,
            n_heads: gpt.n_heads as u64,
            ctx: gpt.n_ctx as u64,
            vocab: gpt.vocab_size as u64,
        };
        let dims = ParallelDims::new(p.dp, p.tp, world.world_size(), &shape)?;
        let groups = dims.build_groups(&*world)?;
        let dp: Arc<dyn Communicator> = Arc::from(groups.dp);
        let tp: Arc<dyn Communicator> = Arc::from(groups.tp);
        let rank = world.rank();
        let model = (self.model_fn)(&ModelContext {
            config: &cfg,
            tp: tp.clone(),
            rank,
        })?;
        let stage = p.stage()?;
        let dpc = DataParallelConfig {
            stage,
            bucket_bytes: p.bucket_bytes(),
            overlap: p.overlap,
            max_grad_norm: cfg.optim.clip(),
            adamw: cfg.optim.adamw(),
            checkpoint: cfg.train.checkpoint_policy()?,
        };
        let mut engine = DataParallel::new(&model.segment_param_lists(), &*dp, dpc)?
            .with_world(world.clone())
            .with_param_splits(&model.param_splits())?;
        if p.tp > 1 {
            engine = engine.with_tensor_parallel(tp.clone());
        }
        let plan = engine.shard_plan()?;

        // data
        let sources = match self.data {
            Some(d) => d,
            None => prepare_sources(&cfg, &*world)?,
        };
        if sources.train.is_empty() {
            return Err(TrainError::Builder("no training source".into()));
        }
        let loader_cfg = LoaderConfig {
            dp: p.dp,
            rank: dp.rank(),
            seed: cfg.seed,
            workers: cfg.data.workers,
            prefetch: cfg.data.prefetch,
            ..LoaderConfig::new(cfg.train.seq_len, cfg.train.rank_batch())
        };
        let mut loader = DataLoader::new(sources.train.clone(), None, loader_cfg.clone())?;
        let evaluates = cfg.eval.batches > 0 && (cfg.eval.every > 0 || cfg.eval.at_end);
        if evaluates && !sources.val.is_empty() {
            // fail now, not at the first evaluation, on a validation split too small to batch
            let val_cfg = LoaderConfig {
                batch_size: cfg.train.micro_batch,
                workers: 0,
                ..loader_cfg.clone()
            };
            DataLoader::new(sources.val.clone(), None, val_cfg).map_err(|e| {
                TrainError::config(
                    "RunConfig.eval",
                    format!(
                        "the validation split cannot make batches of {} x {} sequences of {} \
                         tokens: {e}",
                        p.dp, cfg.train.micro_batch, cfg.train.seq_len
                    ),
                )
            })?;
        }
        for t in self.transforms {
            loader.add_transform(t);
        }

        // precision, schedule
        let scaler: Box<dyn LossScaler> = match self.scaler {
            Some(s) => s,
            None if cfg.precision.compute == ComputeDType::F16 => {
                Box::new(DynamicLossScaler::new(cfg.precision.scaler_config())?)
            }
            None => Box::new(NoScaler),
        };
        let schedule = match self.schedule {
            Some(s) => s,
            None => cfg.optim.schedule(cfg.train.steps)?,
        };

        // monitoring
        let (detectors, breaker) = if cfg.monitor.detectors {
            let d = match self.detectors {
                Some(d) => d,
                None => cfg.monitor.detector_set()?,
            };
            let policy = self.breaker.unwrap_or_else(|| cfg.monitor.breaker_policy());
            (Some(d), Some(CircuitBreaker::new(policy)?))
        } else {
            (None, None)
        };
        let watchdog = if cfg.monitor.watchdog_s > 0.0 {
            let timeout = Duration::from_secs_f64(cfg.monitor.watchdog_s);
            let comms = vec![world.clone()];
            Some(if world.backend() == "thread" {
                Watchdog::start(timeout, comms)?
            } else {
                // One rank per process: a rank stuck inside a collective cannot return an
                // error, so the watchdog ends the process with the dump and a non-zero status,
                // and the launcher (mpirun, srun) tears the job down.
                Watchdog::start_with(timeout, comms, move |report| {
                    eprintln!("kiln-train watchdog, rank {rank}: {report}; exiting with status {HANG_EXIT_CODE}");
                    std::process::exit(HANG_EXIT_CODE)
                })?
            })
        } else {
            None
        };

        // checkpoints
        let ck = &cfg.checkpoint;
        let mut outputs = Outputs::default();
        let wants_ckpt = ck.enabled() || ck.resume || ck.resume_step.is_some();
        let ckpt = if wants_ckpt || self.storage.is_some() {
            let storage: Arc<dyn Storage> = match self.storage {
                Some(s) => s,
                None => {
                    let dir = cfg.checkpoint_dir();
                    outputs.checkpoints = Some(dir.clone());
                    Arc::new(LocalFs::new(dir)?)
                }
            };
            let mut policy = SavePolicy::default();
            if ck.every_steps > 0 {
                policy.every_steps = Some(ck.every_steps);
            }
            if ck.every_minutes > 0.0 {
                policy.every = Some(Duration::from_secs_f64(ck.every_minutes * 60.0));
            }
            let mut retention = if ck.keep_last > 0 {
                Retention::keep_last(ck.keep_last)
            } else {
                Retention::keep_all()
            };
            if ck.keep_every > 0 {
                retention = retention.and_every(ck.keep_every);
            }
            let layout = Layout::new(p.dp, p.tp, p.zero)?;
            let mut c = Checkpointer::new(
                storage,
                CheckpointConfig::new(layout, model.config_hash())
                    .with_policy(policy)
                    .with_retention(retention),
            )?;
            c.set_user_meta("run", &cfg.name)?;
            c.set_user_meta("run_hash", cfg.trajectory_hash())?;
            Some(c)
        } else {
            None
        };

        let mfu = model
            .flops_per_token(cfg.train.seq_len)
            .and_then(|f| Mfu::new(f, cfg.metrics.peak_flops_per_s).ok());
        let progress = TrainerProgress {
            run_hash: cfg.trajectory_hash(),
            ..TrainerProgress::default()
        };
        let mut trainer = Trainer {
            rng: RngState {
                seed: cfg.seed,
                stream: 0,
                counter: 0,
            },
            world,
            dp,
            tp,
            dims,
            model,
            engine,
            plan,
            scaler,
            schedule,
            loader,
            loader_cfg,
            val_sources: sources.val,
            ckpt,
            sinks: MultiSink::new(),
            detectors,
            breaker,
            watchdog,
            progress,
            mfu,
            last_ckpt: None,
            losses: Vec::new(),
            val_losses: Vec::new(),
            checkpoints: Vec::new(),
            rollbacks: Vec::new(),
            resumed_from: None,
            skipped_checkpoints: Vec::new(),
            outputs,
            on_step: self.on_step,
            last_metrics: None,
            pending_events: Vec::new(),
            run_tokens: 0,
            started: Instant::now(),
            cfg,
        };
        trainer.resume_if_asked()?;
        if trainer.world.rank() == 0 {
            trainer.open_sinks(self.default_sinks, self.sinks)?;
        }
        let header = trainer.header();
        trainer.emit_events(&[header])?;
        let pending = std::mem::take(&mut trainer.pending_events);
        trainer.emit_events(&pending)?;
        Ok(trainer)
    }
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
    model: M,
    engine: DataParallel,
    plan: ShardPlan,
    scaler: Box<dyn LossScaler>,
    schedule: Box<dyn LrSchedule>,
    loader: DataLoader,
    loader_cfg: LoaderConfig,
    val_sources: Vec<TokenSource>,
    ckpt: Option<Checkpointer>,
    sinks: MultiSink,
    detectors: Option<DetectorSet>,
    breaker: Option<CircuitBreaker>,
    watchdog: Option<Watchdog>,
    progress: TrainerProgress,
    rng: RngState,
    mfu: Option<Mfu>,
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

impl Trainer<Gpt> {
    /// A builder with every part made from `config` (the model: its GPT preset).
    pub fn builder(config: RunConfig) -> TrainerBuilder<Gpt> {
        TrainerBuilder {
            config,
            model_fn: Box::new(|ctx: &ModelContext<'_>| ctx.build_gpt()),
            sinks: Vec::new(),
            default_sinks: true,
            detectors: None,
            breaker: None,
            scaler: None,
            schedule: None,
            data: None,
            transforms: Vec::new(),
            storage: None,
            on_step: None,
        }
    }
}

/// The breaker's view of a step's outcome.
fn scaler_event(e: ScaleEvent) -> ScalerEvent {
    match e {
        ScaleEvent::Grew => ScalerEvent::Grew,
        ScaleEvent::Skipped => ScalerEvent::Skipped,
        ScaleEvent::BackedOff => ScalerEvent::BackedOff,
        _ => ScalerEvent::Stepped,
    }
}

/// Everything the detectors and the breaker look at for one step, the same on every rank.
struct Observation<'a> {
    step: u64,
    loss: f32,
    grad_norm: Option<f64>,
    lr: f32,
    loss_scale: f32,
    event: ScaleEvent,
    elapsed_s: f64,
    ids: &'a [u64],
    last_ckpt: Option<u64>,
}

/// Runs the detectors on an observation (after gathering every rank's elapsed time, for the
/// straggler detector) and asks the breaker what to do. Collective over `world`.
fn observe(
    world: &dyn Communicator,
    detectors: &mut DetectorSet,
    breaker: &mut CircuitBreaker,
    o: &Observation<'_>,
) -> Result<Decision> {
    let summary = RankSummary::gather(
        world,
        &RankStats {
            loss: o.loss as f64,
            step_time_s: o.elapsed_s,
            tokens: 0,
            samples: 0,
        },
    )?;
    let mut m = StepMetrics::new(o.step);
    summary.apply(&mut m);
    m.tokens_per_s = None;
    m.samples_per_s = None;
    m.loss = Some(o.loss as f64);
    m.grad_norm = o.grad_norm;
    m.lr = Some(o.lr as f64);
    m.loss_scale = Some(o.loss_scale as f64);
    m.scaler_event = Some(scaler_event(o.event));
    let verdicts = detectors.observe(&m);
    Ok(breaker.decide(
        o.step,
        &verdicts,
        &BatchInfo {
            sample_ids: o.ids,
            last_checkpoint_step: o.last_ckpt,
        },
    ))
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

    fn header(&self) -> Event {
        let c = &self.cfg;
        let params: usize = self.engine.layout().params().iter().map(|p| p.numel).sum();
        Event::new(
            EventKind::Info,
            self.progress.step,
            format!(
                "{}: model {} ({:.2}M parameters per tp rank), dp={} tp={} zero={}, {}, \
                 micro-batch {} x {} accumulation x seq {}, {} steps",
                c.name,
                c.model.preset,
                params as f64 / 1e6,
                c.parallel.dp,
                c.parallel.tp,
                c.parallel.zero,
                c.precision.compute,
                c.train.micro_batch,
                c.train.accumulation,
                c.train.seq_len,
                c.train.steps
            ),
        )
    }

    fn open_sinks(&mut self, defaults: bool, extra: Vec<Box<dyn MetricSink>>) -> Result<()> {
        let m = &self.cfg.metrics;
        let dir = self.cfg.output_dir.clone();
        let mk = |op: &'static str| {
            let dir = dir.clone();
            move |e| TrainError::File {
                op,
                path: dir.clone(),
                source: e,
            }
        };
        if defaults && (m.jsonl || m.tensorboard || m.png) {
            std::fs::create_dir_all(&dir).map_err(mk("create directory"))?;
        }
        if defaults && m.jsonl {
            let path = dir.join("metrics.jsonl");
            let sink = if self.resumed_from.is_some() && path.exists() {
                JsonlSink::append(&path)?
            } else {
                JsonlSink::create(&path)?
            };
            self.sinks.push(Box::new(sink));
            self.outputs.jsonl = Some(path);
        }
        if defaults && m.tensorboard {
            let tb = dir.join("tb");
            self.sinks.push(Box::new(TensorBoardSink::create(&tb)?));
            self.outputs.tensorboard = Some(tb);
        }
        if defaults && m.png {
            let png = dir.join("loss.png");
            self.sinks.push(Box::new(PlotSink::new(&png)));
            self.outputs.png = Some(png);
        }
        if defaults && m.console {
            self.sinks.push(Box::new(ConsoleSink::new(
                Some(self.cfg.train.steps),
                m.console_every,
            )));
        }
        for s in extra {
            self.sinks.push(s);
        }
        Ok(())
    }

    fn emit_events(&mut self, events: &[Event]) -> Result<()> {
        if self.world.rank() == 0 && !events.is_empty() {
            self.sinks.events(events)?;
        }
        Ok(())
    }

    /// The reshard request of this rank's layout.
    fn request(&self) -> Result<kiln_ckpt::ReshardRequest> {
        let p = &self.cfg.parallel;
        Ok(
            kiln_ckpt::ReshardRequest::new(Layout::new(p.dp, p.tp, p.zero)?)
                .component("engine", &self.engine),
        )
    }

    /// Loads the checkpoint `resume_step` or the latest good one, when the configuration asks.
    /// A run that does not resume refuses a checkpoint folder that already holds committed
    /// checkpoints: a later `--resume` would otherwise pick up the earlier run's newest one.
    fn resume_if_asked(&mut self) -> Result<()> {
        let ck = &self.cfg.checkpoint;
        if !(ck.resume || ck.resume_step.is_some()) {
            if let Some(c) = &self.ckpt {
                if let Some(newest) = c.committed_steps()?.into_iter().max() {
                    return Err(TrainError::config(
                        "RunConfig.checkpoint.resume",
                        format!(
                            "{} already holds checkpoints of an earlier run (the newest of step \
                             {newest}): pass --resume to continue it, or --out DIR to start a \
                             new run in another folder",
                            self.cfg.checkpoint_dir().display()
                        ),
                    ));
                }
            }
            return Ok(());
        }
        let req = self.request()?;
        let Some(c) = &self.ckpt else {
            return Ok(());
        };
        let loaded = match ck.resume_step {
            Some(step) => Some(c.load_resharded(&*self.world, step, &req)?),
            None => {
                let Latest { loaded, skipped } = c.load_latest_resharded(&*self.world, &req)?;
                for s in &skipped {
                    self.skipped_checkpoints.push(s.step);
                    let why: Vec<String> = s
                        .problems
                        .iter()
                        .map(|p| format!("rank {}: {}", p.rank, p.reason))
                        .collect();
                    self.pending_events.push(Event::new(
                        EventKind::Info,
                        s.step,
                        format!(
                            "skipped the damaged checkpoint of step {}: {}",
                            s.step,
                            why.join("; ")
                        ),
                    ));
                }
                loaded
            }
        };
        let Some(Loaded {
            step,
            manifest,
            state,
        }) = loaded
        else {
            self.pending_events.push(Event::new(
                EventKind::Info,
                0,
                "no checkpoint to resume from: starting at step 0",
            ));
            return Ok(());
        };
        self.restore(state, true)?;
        if self.progress.step != step {
            return Err(TrainError::Checkpoint {
                step,
                reason: format!("its trainer state says step {}", self.progress.step),
            });
        }
        self.last_ckpt = Some(step);
        self.resumed_from = Some(step);
        let mut msg = format!(
            "resumed from the checkpoint of step {step} (saved as {})",
            manifest.layout
        );
        if self.progress.run_hash != self.cfg.trajectory_hash() {
            msg.push_str(&format!(
                "; its run configuration differs from this one (hash {} vs {})",
                self.progress.run_hash,
                self.cfg.trajectory_hash()
            ));
            self.progress.run_hash = self.cfg.trajectory_hash();
        }
        self.pending_events
            .push(Event::new(EventKind::Info, step, msg));
        Ok(())
    }

    /// Restores every part of a loaded checkpoint (the breaker and the detectors only when
    /// `with_breaker`: a rollback keeps their memory of what went wrong) and makes the loader
    /// skip every sample the breaker has skipped.
    fn restore(&mut self, mut st: RankState, with_breaker: bool) -> Result<()> {
        let strict = LoadOptions::default();
        st.restore("engine", &mut self.engine, strict)?;
        st.restore("scaler", &mut self.scaler, strict)?;
        st.restore("loader", &mut self.loader, strict)?;
        st.restore("trainer", &mut self.progress, strict)?;
        st.restore("rng", &mut self.rng, strict)?;
        if with_breaker {
            if let (Some(b), true) = (self.breaker.as_mut(), st.part("breaker").is_some()) {
                st.restore("breaker", b, strict)?;
            }
            if let (Some(d), true) = (self.detectors.as_mut(), st.part("detectors").is_some()) {
                st.restore("detectors", d, strict)?;
            }
        }
        if let Some(b) = &self.breaker {
            let ids: Vec<_> = b
                .breaker_state()
                .skipped_sample_ids()
                .into_iter()
                .map(decode_sample_id)
                .collect();
            if !ids.is_empty() {
                self.loader.skip_samples(ids);
            }
        }
        Ok(())
    }

    /// This rank's state, as a checkpoint saves it (collective over the data-parallel group
    /// when `tp > 1`).
    pub fn capture_state(&mut self) -> Result<RankState> {
        let mut st = RankState::new();
        st.capture("engine", &self.engine)?;
        st.capture("scaler", &self.scaler)?;
        st.capture("loader", &self.loader)?;
        if let Some(b) = self.breaker.as_ref() {
            st.capture("breaker", b)?;
        }
        if let Some(d) = self.detectors.as_ref() {
            st.capture("detectors", d)?;
        }
        st.capture("trainer", &self.progress)?;
        st.capture("rng", &self.rng)?;
        Ok(st)
    }

    /// Saves a checkpoint of the current step (collective); returns the seconds the training
    /// loop spent on it.
    pub fn save_checkpoint(&mut self) -> Result<f64> {
        let t = Instant::now();
        let step = self.progress.step;
        let state = self.capture_state()?;
        let Some(c) = self.ckpt.as_mut() else {
            return Err(TrainError::Builder(
                "no checkpointer: set RunConfig.checkpoint.every_steps or a storage".into(),
            ));
        };
        if self.cfg.checkpoint.async_save {
            c.save_async(&*self.world, step, state)?;
        } else {
            c.save(&*self.world, step, &state)?;
        }
        self.last_ckpt = Some(step);
        self.checkpoints.push(step);
        if let Some(b) = self.breaker.as_mut() {
            b.checkpoint_saved(step);
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Loads the checkpoint of `step` (saved with any layout) into this rank, every part but
    /// the breaker's (collective).
    fn load_checkpoint(&mut self, step: u64) -> Result<()> {
        let req = self.request()?;
        let Some(c) = self.ckpt.as_mut() else {
            return Err(TrainError::Checkpoint {
                step,
                reason: "no checkpointer to load it from".into(),
            });
        };
        c.wait()?;
        let loaded = c.load_resharded(&*self.world, step, &req)?;
        self.restore(loaded.state, false)
    }

    fn rollback(&mut self, at_step: u64, to_step: u64, skip: Vec<u64>) -> Result<()> {
        self.load_checkpoint(to_step)?;
        if self.progress.step != to_step {
            return Err(TrainError::Checkpoint {
                step: to_step,
                reason: format!("its trainer state says step {}", self.progress.step),
            });
        }
        if let Some(d) = self.detectors.as_mut() {
            d.rollback(to_step);
        }
        self.losses.retain(|(s, _)| *s <= to_step);
        self.val_losses.retain(|(s, _)| *s <= to_step);
        self.rollbacks.push(RollbackRecord {
            at_step,
            to_step,
            skipped_samples: skip,
        });
        Ok(())
    }

    /// The ids of the global batch (every data-parallel rank's samples, in rank order).
    fn global_sample_ids(&self, batch: &Batch) -> Result<Vec<u64>> {
        let local: Vec<i64> = batch
            .sample_ids
            .iter()
            .map(|&id| encode_sample_id(id) as i64)
            .collect();
        let mut all = vec![0i64; local.len() * self.dp.world_size()];
        self.dp.all_gather(&local, &mut all)?;
        Ok(all.into_iter().map(|v| v as u64).collect())
    }

    /// `(parameter norm, update norm / parameter norm)` over the whole model from every rank's
    /// master chunk and the chunk before the step (collective over the world).
    fn norms(&self, before: &[Vec<f32>]) -> Result<(f64, f64)> {
        let mut params = kiln_optim::SquareSum::new();
        let mut delta = kiln_optim::SquareSum::new();
        let master = self.engine.master();
        let replicated_skip = self.dims.tp > 1 && self.dims.tp_rank(self.world.rank()) != 0;
        let stage = self.engine.config().stage;
        let mut diff = Vec::new();
        for p in self.plan.params() {
            if p.save.is_empty() || (replicated_skip && p.region.is_none()) {
                continue;
            }
            let unit_start = if stage == Stage::Replicated {
                0
            } else {
                kiln_comm::chunk_range(
                    self.engine.layout().units()[p.unit].len,
                    self.dims.dp,
                    self.dims.dp_rank(self.world.rank()),
                )
                .start
            };
            let base = p.offset + p.save.start - unit_start;
            let now = &master[p.unit][base..base + p.save.len()];
            let old = &before[p.unit][base..base + p.save.len()];
            params.add(now);
            diff.clear();
            diff.extend(now.iter().zip(old).map(|(a, b)| a - b));
            delta.add(&diff);
        }
        params.all_reduce(&*self.world)?;
        delta.all_reduce(&*self.world)?;
        let pn = params.norm();
        Ok((pn, if pn > 0.0 { delta.norm() / pn } else { 0.0 }))
    }

    /// Mean loss over `RunConfig.eval.batches` validation batches per data-parallel rank (the
    /// same batches at every evaluation), averaged over the data-parallel group; `None`
    /// without validation data. Collective.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        if self.val_sources.is_empty() || self.cfg.eval.batches == 0 {
            return Ok(None);
        }
        let cfg = LoaderConfig {
            batch_size: self.cfg.train.micro_batch,
            seed: self.cfg.seed ^ 0x7661_6c69_6461_7465,
            workers: 0,
            ..self.loader_cfg.clone()
        };
        let mut val = DataLoader::new(self.val_sources.clone(), None, cfg)?;
        let lists = self.model.segment_param_lists();
        let gathered: Option<std::collections::HashMap<String, Var>> =
            if self.engine.config().stage == Stage::Zero3 {
                let layout = self.engine.layout();
                let mut map = std::collections::HashMap::new();
                for (name, values) in self.engine.full_params()? {
                    let shape = layout
                        .index(&name)
                        .map(|i| layout.params()[i].shape.clone())
                        .unwrap_or_else(|| vec![values.len()]);
                    let t = Tensor::from_vec(values, shape, &candle_core::Device::Cpu)?;
                    map.insert(name, Var::from_tensor(&t)?);
                }
                Some(map)
            } else {
                None
            };
        let segs: Vec<SegmentParams> = lists
            .into_iter()
            .map(|seg| {
                SegmentParams::new(
                    seg.into_iter()
                        .map(|(n, v)| {
                            let v = gathered
                                .as_ref()
                                .and_then(|g| g.get(&n).cloned())
                                .unwrap_or(v);
                            (n, v)
                        })
                        .collect(),
                )
            })
            .collect();
        let mut sum = 0.0f64;
        for _ in 0..self.cfg.eval.batches {
            let b = val.next_batch()?;
            let mut mb = micro_batches(&b, 1)?;
            let (x, y) = mb.remove(0);
            let mut h = x;
            for (i, p) in segs.iter().enumerate() {
                h = self.model.forward_segment(i, &h, &y, p)?;
            }
            sum += h.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        }
        let mean = sum / self.cfg.eval.batches as f64;
        Ok(Some(self.dp.all_reduce_scalar(mean, ReduceOp::Avg)?))
    }

    /// Runs one training step (collective): the next batch, forward and backward with
    /// gradient reduction, the detectors and the breaker (whose verdict may skip the update or
    /// roll back to a checkpoint), the learning rate from the schedule at the optimizer step,
    /// evaluation and checkpoint when due, and the step record to every sink. Returns the
    /// record.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let step = self.progress.step + 1;
        let total = self.cfg.train.steps;
        let t0 = Instant::now();
        let batch = self.loader.next_batch()?;
        let data_wait = t0.elapsed().as_secs_f64();
        let ids = if self.breaker.is_some() {
            self.global_sample_ids(&batch)?
        } else {
            Vec::new()
        };
        let micro = micro_batches(&batch, self.cfg.train.accumulation)?;
        let lr_factor = self.breaker.as_ref().map_or(1.0, |b| b.lr_factor(step));
        let lr = (self.schedule.lr(self.progress.optimizer_steps) as f64 * lr_factor) as f32;
        let tp_lead = self.dims.tp_rank(self.world.rank()) == 0;
        let (tokens, samples) = if tp_lead {
            (batch.num_tokens() as u64, batch.batch_size as u64)
        } else {
            (0, 0)
        };
        let before: Vec<Vec<f32>> = self.engine.master().to_vec();

        let last_ckpt = self.last_ckpt;
        // the open engine: backward, let the detectors and the breaker judge the step, then
        // apply or discard its update
        let preview = self
            .engine
            .backward(&self.model, &micro, &mut *self.scaler)?;
        let decision = match (self.detectors.as_mut(), self.breaker.as_mut()) {
            (Some(d), Some(b)) => {
                let o = Observation {
                    step,
                    loss: preview.loss,
                    grad_norm: preview.grad_norm,
                    lr,
                    loss_scale: preview.loss_scale,
                    event: preview.scale_event,
                    elapsed_s: t0.elapsed().as_secs_f64(),
                    ids: &ids,
                    last_ckpt,
                };
                match observe(&*self.world, d, b, &o) {
                    Ok(dec) => Some(dec),
                    Err(e) => {
                        self.engine.discard()?;
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        let apply =
            !preview.found_inf && decision.as_ref().is_none_or(|d| d.action.applies_update());
        let (report, applied) = if apply {
            (self.engine.apply(lr)?, true)
        } else {
            (self.engine.discard()?, false)
        };

        // the record
        let (param_norm, ratio) = self.norms(&before)?;
        let step_time = t0.elapsed().as_secs_f64();
        let summary = RankSummary::gather(
            &*self.world,
            &RankStats {
                loss: report.loss as f64,
                step_time_s: step_time,
                tokens,
                samples,
            },
        )?;
        let mut m = StepMetrics::new(step);
        summary.apply(&mut m);
        if let Some(mfu) = &self.mfu {
            m.set_mfu(mfu);
        }
        m.loss = Some(report.loss as f64);
        m.epoch = batch.epochs.iter().copied().max();
        m.grad_norm = report.grad_norm;
        m.grad_norm_clipped = match (report.grad_norm, self.cfg.optim.clip()) {
            (Some(n), Some(c)) if report.clipped => Some(n.min(c as f64)),
            (n, _) => n,
        };
        m.lr = Some(lr as f64);
        m.loss_scale = Some(report.loss_scale as f64);
        m.scaler_event = Some(scaler_event(report.scale_event));
        m.data_wait_s = Some(data_wait);
        m.comm_s = Some(report.comm_wait_s);
        m.optimizer_s = Some(report.optim_s);
        m.extra.insert("compute_s".into(), report.compute_s);
        m.param_norm = Some(param_norm);
        m.update_param_ratio = Some(ratio);
        m.set_memory();

        self.progress.step = step;
        self.progress.tokens_seen += summary.tokens;
        self.progress.samples_seen += summary.samples;
        self.run_tokens += summary.tokens;
        if applied {
            self.progress.optimizer_steps += 1;
        } else {
            self.progress.skipped_steps += 1;
        }
        m.skipped_steps = Some(self.progress.skipped_steps);
        m.tokens_seen = Some(self.progress.tokens_seen);
        m.samples_seen = Some(self.progress.samples_seen);
        self.losses.push((step, report.loss));

        let (action, events) = match decision {
            Some(d) => (d.action, d.events),
            None => (Action::Continue, Vec::new()),
        };
        match action {
            Action::Halt(reason) => {
                self.finish_record(&m, &events)?;
                self.close_sinks()?;
                return Err(kiln_monitor::MonitorError::Halted(Box::new(reason)).into());
            }
            Action::Rollback {
                to_step,
                skip_samples,
            } => {
                self.finish_record(&m, &events)?;
                self.rollback(step, to_step, skip_samples)?;
                return Ok(m);
            }
            _ => {}
        }

        let eval_due = (self.cfg.eval.every > 0 && step % self.cfg.eval.every == 0)
            || (step == total && self.cfg.eval.at_end);
        if eval_due {
            if let Some(v) = self.evaluate()? {
                m.extra.insert("val_loss".into(), v);
                self.val_losses.push((step, v));
            }
        }
        let mut events = events;
        if let Some(c) = &self.ckpt {
            let due = self.cfg.checkpoint.enabled()
                && (c.should_save(&*self.world, step)?
                    || (step == total && self.cfg.checkpoint.save_final));
            if due {
                let secs = self.save_checkpoint()?;
                m.ckpt_time_s = Some(secs);
                events.push(Event::new(
                    EventKind::Info,
                    step,
                    format!(
                        "checkpoint of step {step} {} in {:.3} s",
                        if self.cfg.checkpoint.async_save {
                            "staged"
                        } else {
                            "saved"
                        },
                        secs
                    ),
                ));
            }
        }
        self.finish_record(&m, &events)?;
        Ok(m)
    }

    fn finish_record(&mut self, m: &StepMetrics, events: &[Event]) -> Result<()> {
        if self.world.rank() == 0 {
            self.sinks.record(m)?;
            if !events.is_empty() {
                self.sinks.events(events)?;
            }
        }
        if let Some(f) = self.on_step.as_mut() {
            f(m);
        }
        if let Some(w) = &self.watchdog {
            w.heartbeat(m.step);
            w.check()?;
        }
        self.last_metrics = Some(m.clone());
        Ok(())
    }

    fn close_sinks(&mut self) -> Result<()> {
        if self.world.rank() == 0 {
            self.sinks.flush()?;
            self.sinks.close()?;
        }
        Ok(())
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
        })
    }

    /// Makes the model's own variables hold the trained weights, so it can be used outside
    /// the engine (generation, export): under ZeRO-3 the engine keeps only shards and the
    /// model's variables still hold their initial values; this gathers the shards into them
    /// (collective over the data-parallel group). A no-op for the other stages, whose
    /// variables the engine updates after every step.
    pub fn materialize_weights(&self) -> Result<()> {
        if self.engine.config().stage != Stage::Zero3 {
            return Ok(());
        }
        let vars: std::collections::HashMap<String, Var> = self
            .model
            .segment_param_lists()
            .into_iter()
            .flatten()
            .collect();
        for (name, values) in self.engine.full_params()? {
            if let Some(v) = vars.get(&name) {
                kiln_parallel::write_var(v, &values)?;
            }
        }
        Ok(())
    }

    /// Every parameter, whole (tensor-parallel shards joined), by name in layout order: the
    /// same on every rank (collective over the world).
    pub fn dense_parameters(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let local = self.engine.full_params()?;
        let tp = self.dims.tp;
        if tp == 1 {
            return Ok(local);
        }
        let layout = self.engine.layout();
        let mut out = Vec::with_capacity(local.len());
        for (name, values) in local {
            let mut all = vec![0.0f32; values.len() * tp];
            self.tp.all_gather(&values, &mut all)?;
            let split = layout
                .index(&name)
                .map_or(kiln_parallel::tp::TpSplit::Replicated, |i| {
                    self.engine.param_splits()[i]
                });
            if split == kiln_parallel::tp::TpSplit::Replicated {
                out.push((name, values));
                continue;
            }
            let shape = layout
                .index(&name)
                .map(|i| layout.params()[i].shape.clone())
                .unwrap_or_else(|| vec![values.len()]);
            let shards: Vec<Tensor> = all
                .chunks(values.len())
                .map(|c| Tensor::from_slice(c, shape.as_slice(), &candle_core::Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let full = split.unshard(&shards)?;
            out.push((name, full.flatten_all()?.to_vec1::<f32>()?));
        }
        Ok(out)
    }
}
