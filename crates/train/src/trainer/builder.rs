//! [`TrainerBuilder`]: every part of a [`Trainer`] defaulted from the configuration, and `build`.

use crate::config::RunConfig;
use crate::data::{drift_monitor, prepare_sources, DataSources};
use crate::error::{Result, TrainError};
use crate::model::{ModelContext, TrainModel};
use crate::state::TrainerProgress;
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, Layout, LocalFs, Retention, RngState, SavePolicy, Storage,
};
use kiln_comm::Communicator;
use kiln_data::{DataLoader, DriftMonitor, LoaderConfig, TokenSource, Transform};
use kiln_model::Gpt;
use kiln_monitor::{
    BreakerPolicy, CircuitBreaker, DetectorSet, Event, EventKind, MetricSink, Mfu, MultiSink,
    StepMetrics, Watchdog,
};
use kiln_optim::LrSchedule;
use kiln_parallel::pipeline::{PipelineSpec, Schedule};
use kiln_parallel::{stage_segments, DataParallel, DataParallelConfig, ParallelDims, StageSplit};
use kiln_precision::{ComputeDType, DynamicLossScaler, LossScaler, NoScaler};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{ModelFn, Outputs, StepHook, Trainer, HANG_EXIT_CODE};

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
            quality: Vec::new(),
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
        let mut cfg = self.config;
        cfg.validate()?;
        let dynamic = match &cfg.train.dynamic_batch {
            Some(db) => Some(plan_dynamic_batch(&cfg, db.budget_mib)?),
            None => None,
        };
        if let Some((micro, accumulation, _)) = dynamic {
            cfg.train.micro_batch = micro;
            cfg.train.accumulation = accumulation;
        }
        let gpt = cfg.gpt_config()?;
        let p = &cfg.parallel;
        if world.world_size() != p.world() {
            return Err(TrainError::config(
                "RunConfig.parallel",
                format!(
                    "dp ({}) x tp ({}) x pp ({}) = {} but the communicator has {} ranks",
                    p.dp,
                    p.tp,
                    p.pp,
                    p.world(),
                    world.world_size()
                ),
            ));
        }
        let shape = gpt.shape();
        let dims = ParallelDims::with_pipeline(p.dp, p.tp, p.pp, world.world_size(), &shape)?;
        let groups = dims.build_groups(&*world)?;
        let dp: Arc<dyn Communicator> = Arc::from(groups.dp);
        let tp: Arc<dyn Communicator> = Arc::from(groups.tp);
        let pp_comm: Arc<dyn Communicator> = Arc::from(groups.pp);
        let embedding: Option<Arc<dyn Communicator>> = groups.embedding.map(Arc::from);
        let rank = world.rank();
        let model = (self.model_fn)(&ModelContext {
            config: &cfg,
            tp: tp.clone(),
            rank,
        })?;
        let stage = p.zero;
        let dpc = DataParallelConfig {
            stage,
            bucket_bytes: p.bucket_bytes(),
            overlap: p.overlap,
            max_grad_norm: cfg.optim.clip(),
            optimizer: cfg.optim.optimizer,
            // the param_norm and update_param_ratio metrics, computed inside the update
            update_norms: true,
            recompute: cfg.train.recompute,
        };
        let stage_plan = if p.pp > 1 {
            Some(StagePlan::new(&model, &cfg, dims.pp_rank(rank), &shape)?)
        } else {
            None
        };
        let (lists, splits, kinds) = match &stage_plan {
            Some(sp) => sp.filter(&model),
            None => (
                model.segment_param_lists(),
                model.param_splits(),
                model.param_kinds(),
            ),
        };
        let mut engine = DataParallel::new(&lists, &*dp, dpc)?
            .with_world(world.clone())
            .with_param_splits(&splits)?
            .with_decay_groups(&kinds, &cfg.optim.weight_decay_groups)?;
        if p.tp > 1 {
            engine = engine.with_tensor_parallel(tp.clone());
        }
        if let Some(sp) = &stage_plan {
            let tied: Vec<&str> = sp.tied.iter().map(String::as_str).collect();
            engine = engine.with_pipeline(pp_comm.clone(), embedding, &tied)?;
        }

        // data
        let prepared_here = self.data.is_none();
        let sources = match self.data {
            Some(d) => d,
            None => prepare_sources(&cfg, &*world)?,
        };
        if sources.train.is_empty() {
            return Err(TrainError::Builder("no training source".into()));
        }
        let d = &cfg.data;
        let loader_cfg = LoaderConfig {
            dp: p.dp,
            rank: dp.rank(),
            seed: cfg.seed,
            workers: d.workers,
            prefetch: d.prefetch,
            stall_timeout: Duration::from_secs_f64(d.stall_timeout_s),
            chunk_tokens: d.cache_chunk_tokens,
            cache_chunks: d.cache_chunks,
            ..LoaderConfig::new(cfg.train.seq_len, cfg.train.rank_batch())
        };
        if !d.mixture.is_empty() {
            d.mixture
                .validate(sources.train.len())
                .map_err(|e| TrainError::config("RunConfig.data.mixture", e.to_string()))?;
        }
        let initial_weights = d.mixture.weights_at(1);
        let mut loader =
            DataLoader::new(sources.train.clone(), initial_weights, loader_cfg.clone())?;
        let source_names: Vec<String> =
            sources.train.iter().map(|s| s.name().to_string()).collect();
        for (i, w) in d.skip.iter().enumerate() {
            let Some(src) = source_names.iter().position(|n| *n == w.corpus) else {
                return Err(TrainError::config(
                    format!("RunConfig.data.skip[{i}].corpus"),
                    format!(
                        "{:?} is not a training source (they are {source_names:?})",
                        w.corpus
                    ),
                ));
            };
            loader.skip_range(src as u32, w.start..w.end);
        }
        let mut pending_events = Vec::new();
        let drift = if d.drift.enabled {
            let vocab = cfg.gpt_config()?.vocab_size;
            let mut m = drift_monitor(&d.drift, &sources.train, initial_weights, vocab)?;
            if d.drift.threshold == 0.0 {
                if let Err(why) = calibrate_drift(&mut m, &cfg, &sources.train, initial_weights) {
                    // the metric still runs; only the alert needs a threshold
                    m.set_threshold(f64::MAX);
                    pending_events.push(Event::new(
                        EventKind::Info,
                        0,
                        format!("drift monitor without alerts: {why}"),
                    ));
                }
            }
            Some(m)
        } else {
            None
        };
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
                Box::new(DynamicLossScaler::new(cfg.precision.scaler)?)
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
            let policy = self.breaker.unwrap_or(cfg.monitor.breaker);
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
            let layout = Layout::new(p.dp, p.tp, p.zero)?.with_pp(p.pp)?;
            let mut c = Checkpointer::new(
                storage,
                CheckpointConfig::new(layout, model.config_hash())
                    .with_policy(policy)
                    .with_retention(retention),
            )?;
            c.set_user_meta("run", &cfg.name)?;
            c.set_user_meta("run_hash", cfg.trajectory_hash())?;
            if let Some(g) = model.gpt_config() {
                c.set_user_meta(crate::GPT_META_KEY, g)?;
            }
            if prepared_here && rank == 0 {
                // the tokenizer beside the checkpoints, so they can be sampled and exported
                let tok = cfg.data_cache_dir()?.join(crate::TOKENIZER_FILE);
                if tok.is_file() {
                    let bytes = std::fs::read(&tok).map_err(|source| TrainError::File {
                        op: "read",
                        path: tok.clone(),
                        source,
                    })?;
                    c.storage().put(crate::TOKENIZER_FILE, &bytes)?;
                }
            }
            Some(c)
        } else {
            None
        };

        // MFU against the devices' peak, its basis said once; no figure without a known peak
        let (mfu, mfu_peak) = match (
            model.flops_per_token(cfg.train.seq_len),
            crate::run_peak(&cfg, engine.device()),
        ) {
            (None, _) => (None, None),
            (Some(flops), Ok(peak)) => match Mfu::new(flops, peak.flops_per_s) {
                Ok(mfu) => {
                    pending_events.push(Event::new(
                        EventKind::Info,
                        0,
                        format!("mfu: model FLOPs per second over the {peak}"),
                    ));
                    (Some(mfu), Some(peak))
                }
                Err(_) => (None, None),
            },
            (Some(_), Err(why)) => {
                pending_events.push(Event::new(
                    EventKind::Info,
                    0,
                    format!("mfu not reported: {why}"),
                ));
                (None, None)
            }
        };
        let progress = TrainerProgress {
            run_hash: cfg.trajectory_hash(),
            ..TrainerProgress::default()
        };
        for (name, q) in &sources.quality {
            pending_events.push(Event::new(
                EventKind::Info,
                0,
                format!(
                    "quality filter on {name}: kept {} of {} documents ({} of {} tokens), \
                     perplexity threshold {:.1}",
                    q.docs_kept,
                    q.docs_kept + q.docs_dropped,
                    q.tokens_kept,
                    q.tokens_kept + q.tokens_dropped,
                    q.threshold
                ),
            ));
        }
        // step counts the run is shorter than, said once
        for note in cfg.short_run_notes() {
            pending_events.push(Event::new(EventKind::Info, 0, note));
        }
        if let Some((micro, accumulation, budget)) = dynamic {
            pending_events.push(Event::new(
                EventKind::Info,
                0,
                format!(
                    "dynamic batch: micro-batch {micro} x {accumulation} accumulation fits the \
                     budget of {:.1} MiB per rank",
                    budget as f64 / (1 << 20) as f64
                ),
            ));
        }
        if let Some(m) = drift.as_ref().filter(|m| m.threshold() < f64::MAX) {
            pending_events.push(Event::new(
                EventKind::Info,
                0,
                format!(
                    "drift monitor: window of {} batches, alert above {:.4} nats",
                    d.drift.window,
                    m.threshold()
                ),
            ));
        }
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
            pp: pp_comm,
            stage_plan,
            model,
            engine,
            scaler,
            schedule,
            loader,
            loader_cfg,
            source_names,
            quality: sources.quality,
            drift,
            drift_alerts: 0,
            val_sources: sources.val,
            ckpt,
            sinks: MultiSink::new(),
            detectors,
            breaker,
            watchdog,
            progress,
            mfu,
            mfu_peak,
            last_ckpt: None,
            losses: Vec::new(),
            val_losses: Vec::new(),
            checkpoints: Vec::new(),
            rollbacks: Vec::new(),
            resumed_from: None,
            skipped_checkpoints: Vec::new(),
            staged: Default::default(),
            outputs,
            on_step: self.on_step,
            last_metrics: None,
            pending_events,
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

/// The micro-batch and accumulation kiln-memory's [`kiln_memory::DynamicBatch`] picks for
/// this run's samples per rank under a budget of `budget_mib` (0: the memory available now,
/// shared by this process's ranks); with the budget in bytes.
fn plan_dynamic_batch(cfg: &RunConfig, budget_mib: f64) -> Result<(usize, usize, u64)> {
    use kiln_memory::{DynamicBatch, MemPrecision, MemoryPlan};
    let field = "RunConfig.train.dynamic_batch";
    let p = &cfg.parallel;
    let budget = if budget_mib > 0.0 {
        (budget_mib * (1u64 << 20) as f64) as u64
    } else {
        let avail = available_memory().ok_or_else(|| {
            TrainError::config(
                field,
                "budget_mib = 0 asks for the available memory, which this system does not \
                 report (/proc/meminfo): set budget_mib",
            )
        })?;
        let local_ranks = if p.backend == kiln_comm::Backend::Thread {
            p.world() as u64
        } else {
            1
        };
        avail / local_ranks.max(1)
    };
    let plan = MemoryPlan {
        shape: cfg.gpt_config()?.shape(),
        precision: if cfg.precision.compute == ComputeDType::F32 {
            MemPrecision::F32
        } else {
            MemPrecision::Mixed16
        },
        stage: p.zero,
        dp: p.dp as u64,
        tp: p.tp as u64,
        micro_batch: 1,
        recompute: cfg.train.recompute,
        bucket_bytes: p.bucket_bytes() as u64,
        sequence_parallel: p.sequence_parallel && p.tp > 1,
    };
    let global = (cfg.train.rank_batch() * p.dp) as u64;
    let db = DynamicBatch::new(plan, global, budget)
        .map_err(|e| TrainError::config(field, e.to_string()))?;
    Ok((
        db.micro_batch() as usize,
        db.accumulation_steps() as usize,
        budget,
    ))
}

/// `MemAvailable` of /proc/meminfo in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Sets the drift threshold to `calibrate_margin` times the largest divergence over full
/// windows of batches drawn like the training batches (the training sources, the initial
/// weights, the global batch size) but in another order (their own seed): what the window of a
/// run without drift shows, sampling noise and the estimate's upward bias included. The same
/// on every rank.
fn calibrate_drift(
    m: &mut DriftMonitor,
    cfg: &RunConfig,
    train: &[TokenSource],
    weights: Option<&[f64]>,
) -> Result<()> {
    let dr = &cfg.data.drift;
    let global = cfg.train.rank_batch() * cfg.parallel.dp;
    let lcfg = LoaderConfig {
        seed: cfg.seed ^ 0x0064_7269_6674, // "drift"
        workers: 0,
        prefetch: 1,
        cache_chunks: 0,
        ..LoaderConfig::new(cfg.train.seq_len, global)
    };
    let weights = if train.len() > 1 { weights } else { None };
    let mut loader = DataLoader::new(train.to_vec(), weights, lcfg)?;
    let mut batches = Vec::new();
    for _ in 0..4 * dr.window {
        match loader.next_batch() {
            Ok(b) => batches.push(b.inputs),
            Err(_) if batches.len() >= dr.window => break,
            Err(e) => {
                return Err(TrainError::config(
                    "RunConfig.data.drift.threshold",
                    format!(
                        "0 asks for calibration, and the training data gives fewer than one \
                         window of {} batches ({e}): set a threshold",
                        dr.window
                    ),
                ))
            }
        }
    }
    m.calibrate(batches.iter().map(|b| &b[..]), dr.calibrate_margin)
        .map_err(|e| TrainError::config("RunConfig.data.drift", e.to_string()))?;
    Ok(())
}

/// What one pipeline rank runs: the schedule, the segments of each of its chunks, and the
/// parameters the first and the last stage share (the tied embedding).
#[derive(Debug, Clone)]
pub(super) struct StagePlan {
    pub(super) schedule: Schedule,
    pub(super) chunks: Vec<std::ops::Range<usize>>,
    pub(super) tied: Vec<String>,
    /// Per parameter name: the pipeline rank that owns it (the first stage for a tied one).
    pub(super) owner: std::collections::BTreeMap<String, usize>,
}

impl StagePlan {
    fn new<M: TrainModel>(
        model: &M,
        cfg: &RunConfig,
        pp_rank: usize,
        shape: &kiln_memory::ModelShape,
    ) -> Result<Self> {
        let p = &cfg.parallel;
        let v = p.virtual_stages;
        let n = model.num_segments();
        let layers = shape.n_layers as usize;
        if n != layers + 2 {
            return Err(TrainError::config(
                "RunConfig.parallel.pp",
                format!(
                    "a pipeline cuts a model of an embedding, {layers} blocks and a head \
                     ({} segments); this model runs as {n} segments and cannot be split",
                    layers + 2
                ),
            ));
        }
        let spec = PipelineSpec {
            stages: p.pp,
            virtual_stages: v,
            micro_batches: cfg.train.accumulation,
        };
        let schedule =
            Schedule::build(p.pp_schedule, spec).map_err(kiln_parallel::ParallelError::from)?;
        let stages = stage_segments(shape, p.pp * v, &StageSplit::Balanced)?;
        let chunks: Vec<_> = (0..v)
            .map(|c| stages[spec.stage_of(pp_rank, c)].clone())
            .collect();
        // which pipeline rank each segment is on, and so each parameter's holders
        let rank_of_segment = |seg: usize| {
            stages
                .iter()
                .position(|r| r.contains(&seg))
                .map(|stage| spec.holder(stage).0)
        };
        let mut holders: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
        for (seg, list) in model.segment_param_lists().iter().enumerate() {
            for (name, _) in list {
                if let Some(r) = rank_of_segment(seg) {
                    let h = holders.entry(name.clone()).or_default();
                    if !h.contains(&r) {
                        h.push(r);
                    }
                }
            }
        }
        let mut tied = Vec::new();
        let mut owner = std::collections::BTreeMap::new();
        for (name, ranks) in holders {
            if ranks.len() > 1 {
                let ends = ranks.len() == 2 && ranks.contains(&0) && ranks.contains(&(p.pp - 1));
                if !ends {
                    return Err(TrainError::config(
                        "RunConfig.parallel.pp",
                        format!(
                            "parameter {name} is read on pipeline ranks {ranks:?}: only the \
                             first and the last stage may share one (a tied embedding)"
                        ),
                    ));
                }
                tied.push(name.clone());
            }
            owner.insert(name, ranks.iter().copied().min().unwrap_or(0));
        }
        Ok(StagePlan {
            schedule,
            chunks,
            tied,
            owner,
        })
    }

    /// The model's parameter lists, splits and kinds restricted to this rank's chunks.
    #[allow(clippy::type_complexity)]
    fn filter<M: TrainModel>(
        &self,
        model: &M,
    ) -> (
        Vec<Vec<(String, candle_core::Var)>>,
        Vec<(String, kiln_parallel::tp::TpSplit)>,
        Vec<(String, kiln_optim::ParamKind)>,
    ) {
        let mut lists = model.segment_param_lists();
        for (i, l) in lists.iter_mut().enumerate() {
            if !self.chunks.iter().any(|c| c.contains(&i)) {
                l.clear();
            }
        }
        let held: std::collections::HashSet<String> =
            lists.iter().flatten().map(|(n, _)| n.clone()).collect();
        let splits = model
            .param_splits()
            .into_iter()
            .filter(|(n, _)| held.contains(n))
            .collect();
        let kinds = model
            .param_kinds()
            .into_iter()
            .filter(|(n, _)| held.contains(n))
            .collect();
        (lists, splits, kinds)
    }
}
