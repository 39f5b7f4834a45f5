//! [`RunConfig`]: everything a training run is configured with, loadable from TOML, validated
//! with errors that name the field, and overridable from command-line flags.

use crate::error::{Result, TrainError};
use kiln_comm::launch::Backend;
use kiln_memory::{CheckpointPolicy, ModelShape};
use kiln_model::GptConfig;
use kiln_monitor::{BreakerPolicy, Response};
use kiln_parallel::{ParallelDims, Stage};
use kiln_precision::{ComputeDType, DynamicScalerConfig};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The names [`RunConfig::preset`] knows.
pub const RUN_PRESETS: &[&str] = &["tiny", "train_gpt", "train_gpt_zero3", "train_gpt_tp"];

/// The model: a kiln-model preset with optional overrides of its sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// A [`GptConfig::by_name`] preset (`tiny`, `small_cpu`, `gpt3_small`, ...).
    pub preset: String,
    /// Overrides the preset's context length (learned positions).
    pub n_ctx: Option<usize>,
    /// Overrides the preset's vocabulary size.
    pub vocab_size: Option<usize>,
    /// Overrides the preset's width.
    pub d_model: Option<usize>,
    /// Overrides the preset's number of blocks.
    pub n_layers: Option<usize>,
    /// Overrides the preset's number of heads.
    pub n_heads: Option<usize>,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            preset: "tiny".into(),
            n_ctx: None,
            vocab_size: None,
            d_model: None,
            n_layers: None,
            n_heads: None,
        }
    }
}

impl ModelSection {
    /// The architecture: the preset with the overrides applied (not validated).
    pub fn gpt_config(&self) -> Result<GptConfig> {
        let mut c = GptConfig::by_name(&self.preset)
            .map_err(|e| TrainError::config("RunConfig.model.preset", e.to_string()))?;
        if let Some(v) = self.n_ctx {
            c.n_ctx = v;
        }
        if let Some(v) = self.vocab_size {
            c.vocab_size = v;
        }
        if let Some(v) = self.d_model {
            c.d_model = v;
        }
        if let Some(v) = self.n_layers {
            c.n_layers = v;
        }
        if let Some(v) = self.n_heads {
            c.n_heads = v;
        }
        Ok(c)
    }
}

/// Parallelism: data-parallel and tensor-parallel degrees and the ZeRO stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelSection {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree (must divide heads, width and vocabulary).
    pub tp: usize,
    /// ZeRO stage: 0 (plain data parallel), 1, 2 or 3.
    pub zero: u8,
    /// Gradient bucket size in MiB.
    pub bucket_mb: f64,
    /// Overlap the gradient communication with the backward.
    pub overlap: bool,
    /// The collective backend: `thread` (every rank a thread of this process, the default)
    /// or `mpi` (one rank per process, started by `mpirun -np <dp*tp>` or srun; needs the
    /// `mpi` feature).
    pub backend: Backend,
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            dp: 1,
            tp: 1,
            zero: 0,
            bucket_mb: 25.0,
            overlap: true,
            backend: Backend::Thread,
        }
    }
}

impl ParallelSection {
    /// The world size, `dp * tp`.
    pub fn world(&self) -> usize {
        self.dp.saturating_mul(self.tp)
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> Result<Stage> {
        Stage::from_number(self.zero)
            .map_err(|e| TrainError::config("RunConfig.parallel.zero", e.to_string()))
    }

    /// The bucket size in bytes.
    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_mb * 1024.0 * 1024.0).max(4.0) as usize
    }
}

/// Mixed precision: the compute dtype and, for f16, the dynamic loss scaler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionSection {
    /// Compute dtype: `f32`, `f16` (with dynamic loss scaling) or `bf16`.
    pub compute: ComputeDType,
    /// The initial loss scale (f16).
    pub init_scale: f32,
    /// Clean steps before the loss scale doubles (f16).
    pub growth_interval: u32,
}

impl Default for PrecisionSection {
    fn default() -> Self {
        let d = DynamicScalerConfig::default();
        PrecisionSection {
            compute: ComputeDType::F32,
            init_scale: d.init_scale,
            growth_interval: d.growth_interval,
        }
    }
}

impl PrecisionSection {
    /// The candle dtype of the compute.
    pub fn dtype(&self) -> candle_core::DType {
        match self.compute {
            ComputeDType::F16 => candle_core::DType::F16,
            ComputeDType::BF16 => candle_core::DType::BF16,
            _ => candle_core::DType::F32,
        }
    }

    /// The dynamic scaler's options.
    pub fn scaler_config(&self) -> DynamicScalerConfig {
        DynamicScalerConfig {
            init_scale: self.init_scale,
            growth_interval: self.growth_interval,
            ..DynamicScalerConfig::default()
        }
    }
}

/// The training loop: length, batch shape and activation checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// Training steps (iterations; a skipped step counts).
    pub steps: u64,
    /// Samples per micro-batch on each data-parallel rank.
    pub micro_batch: usize,
    /// Micro-batches accumulated per step.
    pub accumulation: usize,
    /// Tokens per sample (at most the model's context).
    pub seq_len: usize,
    /// Activation checkpointing: `none`, `every_block`, or `every_<k>` (every k-th block).
    pub activation_checkpointing: String,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: 100,
            micro_batch: 4,
            accumulation: 1,
            seq_len: 64,
            activation_checkpointing: "none".into(),
        }
    }
}

impl TrainSection {
    /// The activation-checkpointing policy.
    pub fn checkpoint_policy(&self) -> Result<CheckpointPolicy> {
        let s = self.activation_checkpointing.trim().to_ascii_lowercase();
        let bad = || {
            TrainError::config(
                "RunConfig.train.activation_checkpointing",
                format!(
                    "expected none, every_block or every_<k> with k >= 1, got {:?}",
                    self.activation_checkpointing
                ),
            )
        };
        match s.as_str() {
            "none" | "off" | "false" | "" => Ok(CheckpointPolicy::None),
            "every_block" | "all" | "true" | "on" => Ok(CheckpointPolicy::EveryBlock),
            other => {
                let k: usize = other
                    .strip_prefix("every_")
                    .and_then(|k| k.parse().ok())
                    .ok_or_else(bad)?;
                match k {
                    0 => Err(bad()),
                    1 => Ok(CheckpointPolicy::EveryBlock),
                    k => Ok(CheckpointPolicy::EveryKth(k)),
                }
            }
        }
    }

    /// Samples per step on one data-parallel rank.
    pub fn rank_batch(&self) -> usize {
        self.micro_batch.saturating_mul(self.accumulation)
    }
}

/// AdamW, the learning-rate schedule and clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSection {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the decay.
    pub min_lr: f64,
    /// Linear warmup steps (from 0).
    pub warmup_steps: u64,
    /// The decay after warmup: `cosine`, `linear` or `constant`.
    pub decay: String,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Clip gradients to this global L2 norm (0 disables clipping).
    pub max_grad_norm: f32,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 10,
            decay: "cosine".into(),
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            max_grad_norm: 1.0,
        }
    }
}

impl OptimSection {
    /// The AdamW hyperparameters.
    pub fn adamw(&self) -> kiln_optim::AdamWConfig {
        kiln_optim::AdamWConfig {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }

    /// The clipping norm, if clipping is on.
    pub fn clip(&self) -> Option<f32> {
        (self.max_grad_norm > 0.0).then_some(self.max_grad_norm)
    }

    /// The learning-rate schedule over `total_steps` optimizer steps.
    pub fn schedule(&self, total_steps: u64) -> Result<Box<dyn kiln_optim::LrSchedule>> {
        let named =
            |e: kiln_optim::OptimError| TrainError::config("RunConfig.optim", e.to_string());
        let warmup = self.warmup_steps.min(total_steps);
        Ok(match self.decay.trim().to_ascii_lowercase().as_str() {
            "cosine" => Box::new(
                kiln_optim::WarmupDecay::cosine(self.lr, self.min_lr, warmup, total_steps)
                    .map_err(named)?,
            ),
            "linear" => Box::new(
                kiln_optim::WarmupDecay::linear(self.lr, self.min_lr, warmup, total_steps)
                    .map_err(named)?,
            ),
            "constant" => Box::new(
                kiln_optim::Constant::with_warmup(self.lr, kiln_optim::Warmup::linear(warmup))
                    .map_err(named)?,
            ),
            other => {
                return Err(TrainError::config(
                    "RunConfig.optim.decay",
                    format!("expected cosine, linear or constant, got {other:?}"),
                ))
            }
        })
    }
}

/// Checkpoints: where, how often, how many to keep, and resuming.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// The checkpoint directory (default `<output_dir>/checkpoints`).
    pub dir: Option<PathBuf>,
    /// Save every this many steps (0: never by step count).
    pub every_steps: u64,
    /// Save every this many minutes of wall time as well (0: off).
    pub every_minutes: f64,
    /// Keep the newest this many checkpoints (0: keep all).
    pub keep_last: usize,
    /// Also keep every checkpoint whose step is a multiple of this (0: none).
    pub keep_every: u64,
    /// Write checkpoints on a background thread (the loop stalls only for the copy).
    pub async_save: bool,
    /// Save a checkpoint after the last step too (when checkpointing is on).
    pub save_final: bool,
    /// Resume from the latest good checkpoint in `dir`, if there is one.
    pub resume: bool,
    /// Resume from this step's checkpoint instead of the latest.
    pub resume_step: Option<u64>,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            dir: None,
            every_steps: 0,
            every_minutes: 0.0,
            keep_last: 3,
            keep_every: 0,
            async_save: true,
            save_final: true,
            resume: false,
            resume_step: None,
        }
    }
}

impl CheckpointSection {
    /// Whether any save policy is on.
    pub fn enabled(&self) -> bool {
        self.every_steps > 0 || self.every_minutes > 0.0
    }
}

/// Periodic evaluation on the validation split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate every this many steps (0: only at the end, if `at_end`).
    pub every: u64,
    /// Batches of `train.micro_batch` samples per data-parallel rank per evaluation.
    pub batches: usize,
    /// Evaluate after the last step.
    pub at_end: bool,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            every: 0,
            batches: 4,
            at_end: true,
        }
    }
}

/// The corpus: text files turned into a tokenizer and token shards under a cache folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// Folder holding `<corpus>.txt` for every corpus.
    pub data_dir: PathBuf,
    /// Cache folder for the tokenizer and shards (default `$KILN_DATA_CACHE` or
    /// `.cache/kiln-data`).
    pub cache_dir: Option<PathBuf>,
    /// Corpus names (file stems); several are mixed with equal weights.
    pub corpora: Vec<String>,
    /// Fraction of each file held out for validation.
    pub val_fraction: f64,
    /// Training shards per corpus.
    pub train_shards: usize,
    /// Bytes of text the tokenizer is trained on.
    pub tokenizer_sample_bytes: usize,
    /// Loader worker threads (0 loads on the training thread).
    pub workers: usize,
    /// Batches staged ahead.
    pub prefetch: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            data_dir: PathBuf::from("data"),
            cache_dir: None,
            corpora: kiln_data::DEFAULT_CORPORA
                .iter()
                .map(|s| s.to_string())
                .collect(),
            val_fraction: 0.05,
            train_shards: 4,
            tokenizer_sample_bytes: 4 << 20,
            workers: 1,
            prefetch: 4,
        }
    }
}

/// Metric sinks (rank 0 writes them) and the throughput reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// `metrics.jsonl` in the output directory.
    pub jsonl: bool,
    /// TensorBoard event files under `tb/` in the output directory.
    pub tensorboard: bool,
    /// `loss.png` in the output directory at the end.
    pub png: bool,
    /// Progress bar (or plain lines when stderr is not a terminal).
    pub console: bool,
    /// Console line interval in steps.
    pub console_every: u64,
    /// Peak FLOP/s of the whole machine, the denominator of MFU.
    pub peak_flops_per_s: f64,
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            jsonl: true,
            tensorboard: true,
            png: true,
            console: true,
            console_every: 10,
            peak_flops_per_s: 2e11,
        }
    }
}

/// Anomaly detection, the circuit breaker and the hang watchdog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorSection {
    /// Run the detectors and the breaker.
    pub detectors: bool,
    /// Robust standard deviations of a spike.
    pub spike_k: f64,
    /// Values in the spike detectors' rolling window.
    pub spike_window: usize,
    /// Values needed before a spike detector may fire.
    pub spike_warmup: usize,
    /// Smallest relative jump of a loss spike.
    pub loss_min_rel_jump: f64,
    /// Smallest relative jump of a gradient-norm spike.
    pub grad_min_rel_jump: f64,
    /// A rank slower than this many times the median is a straggler (0: no straggler
    /// detector).
    pub straggler_factor: f64,
    /// Answer to a non-finite loss or gradient norm.
    pub on_non_finite: Response,
    /// Answer to a loss spike.
    pub on_loss_spike: Response,
    /// Answer to a gradient-norm spike.
    pub on_grad_spike: Response,
    /// Answer to a straggler.
    pub on_straggler: Response,
    /// Learning-rate factor of a cool-down.
    pub cooldown_lr_factor: f64,
    /// Length of a cool-down in steps.
    pub cooldown_steps: u64,
    /// Cool down after every rollback.
    pub cooldown_after_rollback: bool,
    /// Batches before the spike's own to skip as well on a rollback.
    pub skip_preceding_batches: usize,
    /// Halt after this many events ...
    pub halt_after_events: usize,
    /// ... within this many steps.
    pub halt_window_steps: u64,
    /// Fail the run when no step completes within this many seconds (0: no watchdog).
    pub watchdog_s: f64,
}

impl Default for MonitorSection {
    fn default() -> Self {
        let b = BreakerPolicy::default();
        MonitorSection {
            detectors: true,
            spike_k: 3.0,
            spike_window: 100,
            spike_warmup: 50,
            loss_min_rel_jump: 0.15,
            grad_min_rel_jump: 1.0,
            straggler_factor: 3.0,
            on_non_finite: b.on_non_finite,
            on_loss_spike: b.on_loss_spike,
            on_grad_spike: b.on_grad_spike,
            on_straggler: b.on_straggler,
            cooldown_lr_factor: b.cooldown_lr_factor,
            cooldown_steps: b.cooldown_steps,
            cooldown_after_rollback: b.cooldown_after_rollback,
            skip_preceding_batches: b.skip_preceding_batches,
            halt_after_events: b.halt_after_events,
            halt_window_steps: b.halt_window_steps,
            watchdog_s: 600.0,
        }
    }
}

impl MonitorSection {
    /// The breaker policy.
    pub fn breaker_policy(&self) -> BreakerPolicy {
        BreakerPolicy {
            on_non_finite: self.on_non_finite,
            on_loss_spike: self.on_loss_spike,
            on_grad_spike: self.on_grad_spike,
            on_straggler: self.on_straggler,
            cooldown_lr_factor: self.cooldown_lr_factor,
            cooldown_steps: self.cooldown_steps,
            cooldown_after_rollback: self.cooldown_after_rollback,
            skip_preceding_batches: self.skip_preceding_batches,
            halt_after_events: self.halt_after_events,
            halt_window_steps: self.halt_window_steps,
        }
    }

    /// The detectors: non-finite, loss spike, gradient-norm spike and (when
    /// `straggler_factor > 0`) straggler.
    pub fn detector_set(&self) -> Result<kiln_monitor::DetectorSet> {
        use kiln_monitor::{
            DetectorSet, Metric, NonFiniteDetector, SpikeConfig, SpikeDetector, StragglerDetector,
        };
        let named =
            |e: kiln_monitor::MonitorError| TrainError::config("RunConfig.monitor", e.to_string());
        let spike = |metric, jump| {
            SpikeDetector::new(
                metric,
                SpikeConfig {
                    k: self.spike_k,
                    window: self.spike_window,
                    warmup: self.spike_warmup,
                    min_rel_jump: jump,
                },
            )
            .map_err(named)
        };
        // remember enough records to rebuild every window on resume
        let mut set = DetectorSet::new()
            .with_history(2 * self.spike_window + 16)
            .with(NonFiniteDetector::default())
            .with(spike(Metric::Loss, self.loss_min_rel_jump)?)
            .with(spike(Metric::GradNorm, self.grad_min_rel_jump)?);
        if self.straggler_factor > 0.0 {
            set = set.with(StragglerDetector::new(self.straggler_factor).map_err(named)?);
        }
        Ok(set)
    }
}

/// Everything a training run is configured with.
///
/// Every section has defaults, so a TOML file only names what it changes; unknown keys are
/// errors. [`RunConfig::validate`] checks the whole configuration and names the field at fault;
/// [`RunConfig::apply_overrides`] and [`RunConfig::from_args`] set fields from command-line
/// flags (`--steps 30 --dp 2`, or any dotted path: `--optim.lr 1e-3`).
///
/// ```
/// use kiln_train::RunConfig;
/// let mut cfg = RunConfig::from_toml_str("seed = 7\n[parallel]\ndp = 2\n[train]\nsteps = 20\n")?;
/// cfg.apply_overrides(&[("tp", "2"), ("optim.lr", "1e-3")])?;
/// assert_eq!((cfg.seed, cfg.parallel.dp, cfg.parallel.tp, cfg.train.steps), (7, 2, 2, 20));
/// assert_eq!(cfg.optim.lr, 1e-3);
/// cfg.parallel.tp = 3;
/// let err = cfg.validate().unwrap_err().to_string();
/// assert!(err.contains("tensor_parallel_degree (3) must divide n_heads (4)"), "{err}");
/// # Ok::<(), kiln_train::TrainError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Name of the run (printed, and recorded in checkpoints).
    pub name: String,
    /// Seed of the initialisation and of the data order.
    pub seed: u64,
    /// Where metrics, plots and (by default) checkpoints go.
    pub output_dir: PathBuf,
    /// The model.
    pub model: ModelSection,
    /// Parallelism.
    pub parallel: ParallelSection,
    /// Mixed precision.
    pub precision: PrecisionSection,
    /// The training loop.
    pub train: TrainSection,
    /// Optimizer, schedule and clipping.
    pub optim: OptimSection,
    /// Checkpoints.
    pub checkpoint: CheckpointSection,
    /// Evaluation.
    pub eval: EvalSection,
    /// The corpus.
    pub data: DataSection,
    /// Metric sinks.
    pub metrics: MetricsSection,
    /// Detectors, breaker and watchdog.
    pub monitor: MonitorSection,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            name: "run".into(),
            seed: 1337,
            output_dir: PathBuf::from("runs/run"),
            model: ModelSection::default(),
            parallel: ParallelSection::default(),
            precision: PrecisionSection::default(),
            train: TrainSection::default(),
            optim: OptimSection::default(),
            checkpoint: CheckpointSection::default(),
            eval: EvalSection::default(),
            data: DataSection::default(),
            metrics: MetricsSection::default(),
            monitor: MonitorSection::default(),
        }
    }
}

/// Short flag names and the field each one sets.
const ALIASES: &[(&str, &str)] = &[
    ("steps", "train.steps"),
    ("micro_batch", "train.micro_batch"),
    ("batch", "train.micro_batch"),
    ("accumulation", "train.accumulation"),
    ("accum", "train.accumulation"),
    ("seq_len", "train.seq_len"),
    ("ctx", "train.seq_len"),
    ("activation_checkpointing", "train.activation_checkpointing"),
    ("dp", "parallel.dp"),
    ("tp", "parallel.tp"),
    ("zero", "parallel.zero"),
    ("backend", "parallel.backend"),
    ("precision", "precision.compute"),
    ("preset", "model.preset"),
    ("lr", "optim.lr"),
    ("min_lr", "optim.min_lr"),
    ("warmup", "optim.warmup_steps"),
    ("clip", "optim.max_grad_norm"),
    ("out", "output_dir"),
    ("output", "output_dir"),
    ("ckpt_dir", "checkpoint.dir"),
    ("ckpt_every", "checkpoint.every_steps"),
    ("resume_step", "checkpoint.resume_step"),
    ("eval_every", "eval.every"),
    ("eval_batches", "eval.batches"),
    ("data_dir", "data.data_dir"),
    ("cache_dir", "data.cache_dir"),
    ("corpora", "data.corpora"),
    ("workers", "data.workers"),
];

fn canonical_key(key: &str) -> String {
    let k = key.trim().trim_start_matches('-').replace('-', "_");
    ALIASES
        .iter()
        .find(|(a, _)| *a == k)
        .map_or(k, |(_, full)| full.to_string())
}

/// A value for the field at `path` whose current value is `current`, parsed from `text`.
fn parse_value(path: &str, current: &Value, text: &str) -> Result<Value> {
    let field = format!("RunConfig.{path}");
    let t = text.trim();
    let parse_bool = |s: &str| match s.to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Some(true),
        "false" | "no" | "off" | "0" => Some(false),
        _ => None,
    };
    let scalar = |s: &str| -> Value {
        if let Ok(u) = s.parse::<u64>() {
            Value::from(u)
        } else if let Ok(i) = s.parse::<i64>() {
            Value::from(i)
        } else if let Some(f) = s.parse::<f64>().ok().filter(|f| f.is_finite()) {
            Value::from(f)
        } else if let Some(b) = parse_bool(s) {
            Value::from(b)
        } else {
            Value::from(s)
        }
    };
    Ok(match current {
        Value::Bool(_) => Value::from(parse_bool(t).ok_or_else(|| {
            TrainError::config(&field, format!("expected true or false, got {t:?}"))
        })?),
        Value::Number(n) if n.is_f64() => Value::from(
            t.parse::<f64>()
                .map_err(|_| TrainError::config(&field, format!("expected a number, got {t:?}")))?,
        ),
        Value::Number(_) => match t.parse::<u64>() {
            Ok(u) => Value::from(u),
            Err(_) => match t.parse::<f64>() {
                Ok(f) if f.fract() == 0.0 && f >= 0.0 && f <= u64::MAX as f64 => {
                    Value::from(f as u64)
                }
                _ => {
                    return Err(TrainError::config(
                        &field,
                        format!("expected a whole number, got {t:?}"),
                    ))
                }
            },
        },
        Value::String(_) => Value::from(t),
        Value::Array(items) => {
            let numeric = items.first().is_some_and(Value::is_number);
            Value::Array(
                t.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| if numeric { scalar(s) } else { Value::from(s) })
                    .collect(),
            )
        }
        Value::Null => scalar(t),
        Value::Object(map) => {
            return Err(TrainError::config(
                &field,
                format!(
                    "is a section; set one of its fields: {}",
                    map.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ))
        }
    })
}

impl RunConfig {
    /// A named starting point (see [`RUN_PRESETS`]):
    /// - `tiny`: the `tiny` model, one rank, f32, 50 steps; for tests and quick checks.
    /// - `train_gpt`: the GPT-3 architecture scaled down (`small_cpu`), dp=2 x tp=2, ZeRO-1,
    ///   f16 with dynamic loss scaling, activation checkpointing, warmup + cosine, clipping,
    ///   checkpoints, spike detection with rollback, JSONL + TensorBoard + PNG.
    /// - `train_gpt_zero3`: `train_gpt` on dp=4 with ZeRO-3.
    /// - `train_gpt_tp`: `train_gpt` on tp=4.
    pub fn preset(name: &str) -> Result<Self> {
        let key = name.trim().to_ascii_lowercase().replace('-', "_");
        let base = RunConfig::default();
        let gpt = |dp: usize, tp: usize, zero: u8, run: &str| RunConfig {
            name: run.to_string(),
            output_dir: PathBuf::from("runs").join(run),
            model: ModelSection {
                preset: "small_cpu".into(),
                ..ModelSection::default()
            },
            parallel: ParallelSection {
                dp,
                tp,
                zero,
                ..ParallelSection::default()
            },
            precision: PrecisionSection {
                compute: ComputeDType::F16,
                ..PrecisionSection::default()
            },
            train: TrainSection {
                steps: 200,
                micro_batch: 8 / dp,
                accumulation: 1,
                seq_len: 128,
                activation_checkpointing: "every_block".into(),
            },
            optim: OptimSection {
                lr: 2e-3,
                min_lr: 2e-4,
                warmup_steps: 20,
                ..OptimSection::default()
            },
            checkpoint: CheckpointSection {
                every_steps: 50,
                keep_last: 2,
                ..CheckpointSection::default()
            },
            eval: EvalSection {
                every: 50,
                batches: 8,
                at_end: true,
            },
            ..RunConfig::default()
        };
        Ok(match key.as_str() {
            "tiny" => RunConfig {
                name: "tiny".into(),
                output_dir: PathBuf::from("runs/tiny"),
                train: TrainSection {
                    steps: 50,
                    micro_batch: 4,
                    seq_len: 32,
                    ..TrainSection::default()
                },
                ..base
            },
            "train_gpt" => gpt(2, 2, 1, "train_gpt"),
            "train_gpt_zero3" => gpt(4, 1, 3, "train_gpt_zero3"),
            "train_gpt_tp" => gpt(1, 4, 0, "train_gpt_tp"),
            _ => {
                return Err(TrainError::config(
                    "RunConfig preset",
                    format!("unknown preset {name:?}; known: {}", RUN_PRESETS.join(", ")),
                ))
            }
        })
    }

    /// Parses a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| TrainError::Parse {
            path: PathBuf::from("<string>"),
            reason: e.to_string(),
        })
    }

    /// Reads and parses a TOML file.
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::File {
            op: "read",
            path: path.to_path_buf(),
            source: e,
        })?;
        toml::from_str(&text).map_err(|e| TrainError::Parse {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// The configuration as TOML.
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| TrainError::Parse {
            path: PathBuf::from("<string>"),
            reason: e.to_string(),
        })
    }

    /// Sets fields from `(key, value)` pairs, in order. A key is a dotted path
    /// (`optim.lr`, `parallel.dp`, `seed`) or a short alias (`steps`, `dp`, `tp`, `zero`,
    /// `precision`, `preset`, `lr`, `micro_batch`, `seq_len`, `out`, ...); `-` and `_` are
    /// interchangeable. The value is parsed for the field's type (lists are comma-separated).
    pub fn apply_overrides<K: AsRef<str>, V: AsRef<str>>(
        &mut self,
        pairs: &[(K, V)],
    ) -> Result<()> {
        let mut doc = serde_json::to_value(&*self)
            .map_err(|e| TrainError::config("RunConfig", e.to_string()))?;
        for (k, v) in pairs {
            let path = canonical_key(k.as_ref());
            let mut node = &mut doc;
            let parts: Vec<&str> = path.split('.').collect();
            for (i, part) in parts.iter().enumerate() {
                let here = parts[..=i].join(".");
                let Value::Object(map) = node else {
                    return Err(TrainError::config(
                        format!("RunConfig.{here}"),
                        "is not a section",
                    ));
                };
                let known: Vec<String> = map.keys().cloned().collect();
                node = map.get_mut(*part).ok_or_else(|| {
                    TrainError::config(
                        format!("RunConfig.{here}"),
                        format!(
                            "no such field (flag --{}); known here: {}",
                            k.as_ref().trim_start_matches('-'),
                            known.join(", ")
                        ),
                    )
                })?;
            }
            *node = if path == "precision.compute" {
                let d: ComputeDType = v.as_ref().trim().parse().map_err(|e| {
                    TrainError::config("RunConfig.precision.compute", format!("{e}"))
                })?;
                Value::from(d.name())
            } else {
                parse_value(&path, node, v.as_ref())?
            };
        }
        *self = serde_json::from_value(doc)
            .map_err(|e| TrainError::config("RunConfig (after overrides)", e.to_string()))?;
        Ok(())
    }

    /// Builds a configuration from command-line arguments (the program name excluded):
    /// `--config FILE` loads a TOML file instead of `preset`'s configuration, `--resume`
    /// turns resuming on, and every other `--key value` or `--key=value` is an override
    /// ([`RunConfig::apply_overrides`]). Flags apply in order.
    ///
    /// ```
    /// use kiln_train::RunConfig;
    /// let args = ["--steps", "30", "--dp=2", "--precision", "bf16", "--resume"].map(String::from);
    /// let cfg = RunConfig::from_args("tiny", args)?;
    /// assert_eq!((cfg.train.steps, cfg.parallel.dp, cfg.checkpoint.resume), (30, 2, true));
    /// assert_eq!(cfg.precision.compute, kiln_precision::ComputeDType::BF16);
    /// # Ok::<(), kiln_train::TrainError>(())
    /// ```
    pub fn from_args<I: IntoIterator<Item = String>>(preset: &str, args: I) -> Result<Self> {
        let mut cfg = RunConfig::preset(preset)?;
        let mut it = args.into_iter().peekable();
        let mut pairs: Vec<(String, String)> = Vec::new();
        while let Some(arg) = it.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(TrainError::config(
                    "command line",
                    format!("expected a --flag, got {arg:?}"),
                ));
            };
            let (key, value) = match flag.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (flag.to_string(), None),
            };
            let key_norm = key.replace('-', "_");
            match key_norm.as_str() {
                "resume" | "no_resume" => {
                    let on = key_norm == "resume";
                    let v = value.unwrap_or_else(|| on.to_string());
                    pairs.push(("checkpoint.resume".into(), v));
                    continue;
                }
                _ => {}
            }
            let value = match value {
                Some(v) => v,
                None => match it.peek() {
                    Some(v) if !v.starts_with("--") => it.next().unwrap_or_default(),
                    _ => {
                        return Err(TrainError::config(
                            format!("--{key}"),
                            "expects a value (--key value or --key=value)",
                        ))
                    }
                },
            };
            if key_norm == "config" {
                if !pairs.is_empty() {
                    cfg.apply_overrides(&pairs)?;
                    pairs.clear();
                }
                cfg = RunConfig::from_toml_file(&value)?;
                continue;
            }
            pairs.push((key, value));
        }
        cfg.apply_overrides(&pairs)?;
        Ok(cfg)
    }

    /// The model architecture.
    pub fn gpt_config(&self) -> Result<GptConfig> {
        self.model.gpt_config()
    }

    /// The checkpoint directory.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| self.output_dir.join("checkpoints"))
    }

    /// The data cache folder for this model's vocabulary and corpora.
    pub fn data_cache_dir(&self) -> Result<PathBuf> {
        let root = self
            .data
            .cache_dir
            .clone()
            .unwrap_or_else(kiln_data::default_cache_dir);
        let vocab = self.gpt_config()?.vocab_size;
        Ok(root.join(format!("{}-v{vocab}", self.data.corpora.join("+"))))
    }

    /// A short hash of everything that shapes the training trajectory (model, precision,
    /// batch shape, optimizer, data, seed), excluding the parallel layout, the step count and
    /// the outputs. Recorded in every checkpoint.
    pub fn trajectory_hash(&self) -> String {
        let v = serde_json::json!({
            "seed": self.seed,
            "model": self.model,
            "precision": self.precision,
            "micro_batch_global": self.train.rank_batch() * self.parallel.dp,
            "seq_len": self.train.seq_len,
            "optim": self.optim,
            "corpora": self.data.corpora,
            "val_fraction": self.data.val_fraction,
        });
        let digest = Sha256::digest(v.to_string().as_bytes());
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }

    /// Checks the whole configuration; the error names the field (`RunConfig.parallel.dp`) and
    /// the values that conflict.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(TrainError::config(format!("RunConfig.{field}"), reason))
        };
        let model = self.gpt_config()?;
        model
            .validate()
            .map_err(|e| TrainError::config("RunConfig.model", e.to_string()))?;
        let p = &self.parallel;
        let shape = ModelShape {
            n_layers: model.n_layers as u64,
            d_model: model.d_model as u64,
            n_heads: model.n_heads as u64,
            ctx: model.n_ctx as u64,
            vocab: model.vocab_size as u64,
        };
        ParallelDims::new(p.dp, p.tp, p.world(), &shape).map_err(|e| {
            TrainError::config(
                "RunConfig.parallel",
                format!("dp ({}) x tp ({}): {e}", p.dp, p.tp),
            )
        })?;
        p.stage()?;
        if !p.backend.is_built() {
            return bad(
                "parallel.backend",
                format!(
                    "{} is not built in: build with --features mpi (Open MPI needed: apt-get \
                     install openmpi-bin libopenmpi-dev libclang-dev)",
                    p.backend
                ),
            );
        }
        if !(p.bucket_mb.is_finite() && p.bucket_mb > 0.0) {
            return bad(
                "parallel.bucket_mb",
                format!("must be > 0, got {}", p.bucket_mb),
            );
        }
        let t = &self.train;
        if t.steps == 0 {
            return bad("train.steps", "must be at least 1, got 0".into());
        }
        if t.micro_batch == 0 {
            return bad("train.micro_batch", "must be at least 1, got 0".into());
        }
        if t.accumulation == 0 {
            return bad("train.accumulation", "must be at least 1, got 0".into());
        }
        if t.seq_len == 0 || t.seq_len > model.n_ctx {
            return bad(
                "train.seq_len",
                format!(
                    "must be in 1..={} (the model's n_ctx), got {}",
                    model.n_ctx, t.seq_len
                ),
            );
        }
        t.checkpoint_policy()?;
        let o = &self.optim;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return bad("optim.lr", format!("must be finite and > 0, got {}", o.lr));
        }
        if !(o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
            return bad(
                "optim.min_lr",
                format!("must be in [0, optim.lr ({})], got {}", o.lr, o.min_lr),
            );
        }
        if o.warmup_steps > t.steps {
            return bad(
                "optim.warmup_steps",
                format!(
                    "{} must not exceed train.steps ({})",
                    o.warmup_steps, t.steps
                ),
            );
        }
        if !(o.max_grad_norm.is_finite() && o.max_grad_norm >= 0.0) {
            return bad(
                "optim.max_grad_norm",
                format!("must be finite and >= 0 (0: off), got {}", o.max_grad_norm),
            );
        }
        o.adamw()
            .validate()
            .map_err(|e| TrainError::config("RunConfig.optim", e.to_string()))?;
        o.schedule(t.steps)?;
        if self.precision.compute == ComputeDType::F16 {
            self.precision
                .scaler_config()
                .validate()
                .map_err(|e| TrainError::config("RunConfig.precision", e.to_string()))?;
        }
        let c = &self.checkpoint;
        if !(c.every_minutes.is_finite() && c.every_minutes >= 0.0) {
            return bad(
                "checkpoint.every_minutes",
                format!("must be finite and >= 0, got {}", c.every_minutes),
            );
        }
        if self.eval.batches == 0 && (self.eval.every > 0 || self.eval.at_end) {
            return bad(
                "eval.batches",
                "must be at least 1 when evaluation is on (eval.every > 0 or eval.at_end)".into(),
            );
        }
        let d = &self.data;
        if d.corpora.is_empty() {
            return bad("data.corpora", "names no corpus".into());
        }
        if !(0.0..1.0).contains(&d.val_fraction) {
            return bad(
                "data.val_fraction",
                format!("must be in [0, 1), got {}", d.val_fraction),
            );
        }
        if d.prefetch == 0 {
            return bad("data.prefetch", "must be at least 1, got 0".into());
        }
        if !(self.metrics.peak_flops_per_s.is_finite() && self.metrics.peak_flops_per_s > 0.0) {
            return bad(
                "metrics.peak_flops_per_s",
                format!("must be > 0, got {}", self.metrics.peak_flops_per_s),
            );
        }
        let m = &self.monitor;
        if !(m.watchdog_s.is_finite() && m.watchdog_s >= 0.0) {
            return bad(
                "monitor.watchdog_s",
                format!("must be finite and >= 0 (0: off), got {}", m.watchdog_s),
            );
        }
        if m.detectors {
            m.detector_set()?;
            kiln_monitor::CircuitBreaker::new(m.breaker_policy())
                .map_err(|e| TrainError::config("RunConfig.monitor", e.to_string()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_round_trip_through_toml() {
        for name in RUN_PRESETS {
            let cfg = RunConfig::preset(name).unwrap();
            cfg.validate().unwrap();
            let text = cfg.to_toml_string().unwrap();
            assert_eq!(RunConfig::from_toml_str(&text).unwrap(), cfg, "{name}");
        }
        assert!(RunConfig::preset("nope")
            .unwrap_err()
            .to_string()
            .contains("train_gpt_zero3"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = RunConfig::from_toml_str("[train]\nstepz = 3\n").unwrap_err();
        assert!(e.to_string().contains("stepz"), "{e}");
        let mut c = RunConfig::default();
        c.parallel.dp = 3;
        c.parallel.tp = 8;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("RunConfig.parallel"), "{e}");
        assert!(
            e.contains("tensor_parallel_degree (8) must divide n_heads (4)"),
            "{e}"
        );
        let mut c = RunConfig::default();
        c.train.seq_len = 65;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid run config: RunConfig.train.seq_len: must be in 1..=64 (the model's n_ctx), got 65"
        );
        let mut c = RunConfig::default();
        c.optim.warmup_steps = 500;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.ends_with("RunConfig.optim.warmup_steps: 500 must not exceed train.steps (100)"),
            "{e}"
        );
        let mut c = RunConfig::default();
        c.train.activation_checkpointing = "every_0".into();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("RunConfig.train.activation_checkpointing"));
        let mut c = RunConfig::default();
        c.parallel.zero = 4;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("RunConfig.parallel.zero"));
    }

    #[test]
    fn overrides_parse_by_field_type() {
        let mut c = RunConfig::default();
        c.apply_overrides(&[
            ("steps", "30"),
            ("--dp", "2"),
            ("optim.max-grad-norm", "0.5"),
            ("metrics.png", "off"),
            ("corpora", "austen, shakespeare"),
            ("checkpoint.resume_step", "20"),
            ("precision", "fp16"),
            ("activation_checkpointing", "every_2"),
        ])
        .unwrap();
        assert_eq!(c.train.steps, 30);
        assert_eq!(c.parallel.dp, 2);
        assert_eq!(c.optim.max_grad_norm, 0.5);
        assert!(!c.metrics.png);
        assert_eq!(c.data.corpora, ["austen", "shakespeare"]);
        assert_eq!(c.checkpoint.resume_step, Some(20));
        assert_eq!(c.precision.compute, ComputeDType::F16);
        assert_eq!(
            c.train.checkpoint_policy().unwrap(),
            CheckpointPolicy::EveryKth(2)
        );
        let e = c
            .apply_overrides(&[("stepz", "1")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RunConfig.stepz") && e.contains("--stepz"),
            "{e}"
        );
        let e = c
            .apply_overrides(&[("steps", "1.5")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RunConfig.train.steps: expected a whole number"),
            "{e}"
        );
        let e = c
            .apply_overrides(&[("optim", "1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a section"), "{e}");
        let e = c
            .apply_overrides(&[("precision", "f8")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RunConfig"), "{e}");
        assert_eq!(
            c.train.steps, 30,
            "a failed override leaves the config alone"
        );
    }

    #[test]
    fn args_apply_in_order() {
        let dir = std::env::temp_dir().join(format!("kiln-train-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("run.toml");
        std::fs::write(&file, "seed = 5\n[train]\nsteps = 9\n").unwrap();
        let args = [
            "--steps",
            "3",
            "--config",
            file.to_str().unwrap(),
            "--tp",
            "2",
        ]
        .map(String::from);
        let c = RunConfig::from_args("tiny", args).unwrap();
        assert_eq!((c.seed, c.train.steps, c.parallel.tp), (5, 9, 2));
        assert!(RunConfig::from_args("tiny", ["--steps".to_string()]).is_err());
        assert!(RunConfig::from_args("tiny", ["steps".to_string()]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn trajectory_hash_ignores_layout_and_outputs() {
        let a = RunConfig::default();
        let mut b = a.clone();
        b.parallel.zero = 3;
        b.output_dir = "elsewhere".into();
        b.train.steps = 7;
        assert_eq!(a.trajectory_hash(), b.trajectory_hash());
        b.optim.lr *= 2.0;
        assert_ne!(a.trajectory_hash(), b.trajectory_hash());
    }
}
