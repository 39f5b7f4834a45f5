//! The sections of a [`RunConfig`](super::RunConfig), one per concern, each with its defaults.

use crate::error::{Result, TrainError};
use kiln_comm::launch::Backend;
use kiln_memory::CheckpointPolicy;
use kiln_model::GptConfig;
use kiln_monitor::{BreakerPolicy, Response};
use kiln_parallel::Stage;
use kiln_precision::{ComputeDType, DynamicScalerConfig};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
