//! The sections of a [`RunConfig`](super::RunConfig), one per concern, each with its defaults.

use crate::error::{Result, TrainError};
use kiln_comm::Backend;
use kiln_data::{MixtureSchedule, QualityConfig};
use kiln_memory::RecomputePolicy;
use kiln_model::GptConfig;
use kiln_monitor::{BreakerPolicy, SpikeConfig};
use kiln_optim::{AdamWConfig, OptimizerConfig, ScheduleConfig, WeightDecayGroups};
use kiln_parallel::pipeline::ScheduleKind;
use kiln_precision::{ComputeDType, DynamicScalerConfig};
use kiln_state::ZeroStage;
use kiln_tune::LoraConfig;
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
    /// Overrides the preset's key/value heads (grouped-query attention).
    pub n_kv_heads: Option<usize>,
    /// Overrides the preset's MLP width.
    pub ffn_hidden_size: Option<usize>,
    /// Overrides the preset's rotary base.
    pub rope_theta: Option<f64>,
    /// Overrides the preset's norm epsilon.
    pub norm_eps: Option<f64>,
    /// Overrides whether the preset's LM head is the token embedding.
    pub tied_embeddings: Option<bool>,
    /// Llama 3.1-style rotary frequency scaling (`--model.rope_scaling '{"factor": 8.0,
    /// "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings":
    /// 8192}'`), as a Hugging Face folder's `rope_scaling` says. None: the preset's.
    pub rope_scaling: Option<kiln_model::ops::Llama3Scaling>,
    /// Starts from trained weights instead of the seeded initialisation: a kiln checkpoint
    /// folder (any dp, tp and ZeRO stage; its newest step, or a `step-NNNNNNNN` folder) or a
    /// Hugging Face GPT-2 or Llama folder (`config.json` + `model.safetensors`). Only the
    /// weights are read (the optimizer, the data position and the step start afresh, as
    /// fine-tuning does); the architecture above must match theirs. None: a fresh model.
    pub init_from: Option<PathBuf>,
    /// Fine-tunes LoRA adapters instead of the whole model (kiln-tune's [`LoraConfig`]): the
    /// base (seeded, or read from `init_from`) is frozen and only the adapters train, so
    /// checkpoints hold the adapters alone. None: every parameter trains.
    pub lora: Option<LoraConfig>,
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
            n_kv_heads: None,
            ffn_hidden_size: None,
            rope_theta: None,
            norm_eps: None,
            tied_embeddings: None,
            rope_scaling: None,
            init_from: None,
            lora: None,
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
        if let Some(v) = self.n_kv_heads {
            c.n_kv_heads = Some(v);
        }
        if let Some(v) = self.ffn_hidden_size {
            c.ffn_hidden_size = Some(v);
        }
        if let Some(v) = self.rope_theta {
            c.rope_theta = v;
        }
        if let Some(v) = self.norm_eps {
            c.layer_norm_eps = v;
        }
        if let Some(v) = self.tied_embeddings {
            c.tied_embeddings = v;
        }
        if let Some(v) = self.rope_scaling {
            c.rope_scaling = Some(v);
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
    /// ZeRO stage: 0 (plain data parallel), 1, 2 or 3 (or its name: `zero2`, ...).
    pub zero: ZeroStage,
    /// Gradient bucket size in MiB.
    pub bucket_mb: f64,
    /// Overlap the gradient communication with the backward.
    pub overlap: bool,
    /// Megatron-LM's sequence parallelism when `tp > 1` (no effect at `tp = 1`): the
    /// LayerNorms, residual adds and row-parallel biases run on each tensor-parallel rank's
    /// `1 / tp` of the token rows, and the activations kept between blocks are those rows
    /// (see `kiln_model::GptOptions::sequence_parallel`). Needs `train.seq_len` and the
    /// model's `n_ctx` to be multiples of `tp`; not with `model.lora`.
    pub sequence_parallel: bool,
    /// The collective backend: `thread` (every rank a thread of this process, the default)
    /// or `mpi` (one rank per process, started by `mpirun -np <dp*tp*pp>` or srun; needs the
    /// `mpi` feature).
    pub backend: Backend,
    /// Pipeline-parallel degree: the blocks cut into `pp` stages (the embedding on the first,
    /// the head and the loss on the last, balanced by compute), each stage held by `dp x tp`
    /// ranks; ranks are ordered tp fastest, then dp, then pp (Megatron-LM).
    pub pp: usize,
    /// The pipeline schedule when `pp > 1`: `gpipe`, `1f1b` (the default), `interleaved`
    /// (with `virtual_stages >= 2`) or `zb_h1`. A step's micro-batches are
    /// `train.accumulation`.
    pub pp_schedule: ScheduleKind,
    /// Model chunks per pipeline rank for the interleaved schedule (1 otherwise).
    pub virtual_stages: usize,
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            dp: 1,
            tp: 1,
            zero: ZeroStage::Replicated,
            bucket_mb: 25.0,
            overlap: true,
            sequence_parallel: false,
            backend: Backend::Thread,
            pp: 1,
            pp_schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
        }
    }
}

impl ParallelSection {
    /// The world size, `dp * tp * pp`.
    pub fn world(&self) -> usize {
        self.dp.saturating_mul(self.tp).saturating_mul(self.pp)
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
    /// The dynamic loss scaler of f16 compute (kiln-precision's own options, every one of
    /// them: `init_scale`, `growth_factor`, `backoff_factor`, `growth_interval`, `hysteresis`,
    /// `consecutive_hysteresis`, `min_scale`, `max_scale`).
    pub scaler: DynamicScalerConfig,
}

impl Default for PrecisionSection {
    fn default() -> Self {
        PrecisionSection {
            compute: ComputeDType::F32,
            scaler: DynamicScalerConfig::default(),
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
}

/// The training loop: length, batch shape and activation recomputation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// Training steps (iterations; a skipped step counts).
    pub steps: u64,
    /// Samples per micro-batch on each data-parallel rank.
    pub micro_batch: usize,
    /// Micro-batches accumulated per step.
    pub accumulation: usize,
    /// Tokens per sample, at most the model's context. A TOML file without it, or flags that
    /// choose the model (`--preset`, `--model.n_ctx`) without `--ctx`, take the model's
    /// context length.
    pub seq_len: usize,
    /// Activation recompute: `none`, `every_block`, or `every_<k>` (every k-th block).
    pub recompute: RecomputePolicy,
    /// Let a memory budget choose the micro-batch: the samples per step on each rank
    /// (`micro_batch * accumulation`) stay fixed, and kiln-memory's [`kiln_memory::DynamicBatch`]
    /// picks the largest micro-batch dividing them whose estimated memory fits the budget,
    /// accumulating over the rest. None: `micro_batch` and `accumulation` as given.
    pub dynamic_batch: Option<DynamicBatchSection>,
}

/// The memory budget of [`TrainSection::dynamic_batch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DynamicBatchSection {
    /// The budget of one rank in MiB; 0: the memory the system reports available at start
    /// (`MemAvailable`), shared by the ranks of this process.
    pub budget_mib: f64,
}

impl Default for DynamicBatchSection {
    fn default() -> Self {
        DynamicBatchSection { budget_mib: 0.0 }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            steps: 100,
            micro_batch: 4,
            accumulation: 1,
            seq_len: 64,
            recompute: RecomputePolicy::None,
            dynamic_batch: None,
        }
    }
}

impl TrainSection {
    /// Samples per step on one data-parallel rank.
    pub fn rank_batch(&self) -> usize {
        self.micro_batch.saturating_mul(self.accumulation)
    }
}

/// The optimizer, its parameter groups, the learning-rate schedule and clipping: kiln-optim's
/// own configuration types.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSection {
    /// The optimizer and its hyperparameters (`type = "adamw"` or `"sgd"`; omitted fields
    /// take the optimizer's defaults). Default: AdamW with betas 0.9 and 0.95, eps 1e-8,
    /// weight decay 0.1 (GPT-3's).
    pub optimizer: OptimizerConfig,
    /// Which parameters decay (default: only linear weights; no decay on biases, LayerNorm
    /// gains and embeddings).
    pub weight_decay_groups: WeightDecayGroups,
    /// The learning-rate schedule (`lr`, `min_lr`, `warmup_steps`, `decay`).
    pub schedule: ScheduleConfig,
    /// Clip gradients to this global L2 norm (0 disables clipping).
    pub max_grad_norm: f32,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            optimizer: OptimizerConfig::AdamW(AdamWConfig {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            }),
            weight_decay_groups: WeightDecayGroups::default(),
            schedule: ScheduleConfig::default(),
            max_grad_norm: 1.0,
        }
    }
}

impl OptimSection {
    /// The clipping norm, if clipping is on.
    pub fn clip(&self) -> Option<f32> {
        (self.max_grad_norm > 0.0).then_some(self.max_grad_norm)
    }

    /// The learning-rate schedule over `total_steps` optimizer steps.
    pub fn schedule(&self, total_steps: u64) -> Result<Box<dyn kiln_optim::LrSchedule>> {
        self.schedule
            .build(total_steps)
            .map_err(|e| TrainError::config("RunConfig.optim.schedule", e.to_string()))
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
    /// Folder holding `<corpus>.txt` for every corpus (override key `data.data_dir`, flag
    /// `--data_dir`). Default `data`: kiln's own corpus when run from the repository root. A
    /// relative path is resolved against the working directory, so a program depending on
    /// kiln sets it to where that folder is (`../kiln/data` beside a clone).
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
    /// Seconds the loader waits for a batch before it reports a stall (an error naming the
    /// wait, not a hang).
    pub stall_timeout_s: f64,
    /// Tokens per chunk of the loader's shard cache.
    pub cache_chunk_tokens: usize,
    /// Chunks the loader's LRU cache keeps (0 disables it).
    pub cache_chunks: usize,
    /// Sample windows never trained on: `[[data.skip]] corpus = "austen", start = 0, end = 64`
    /// (window indices of that corpus's training split).
    pub skip: Vec<SkipWindows>,
    /// The perplexity filter applied when the corpus is prepared: documents (paragraphs) whose
    /// n-gram perplexity is among the highest `drop_fraction` of their corpus are left out of
    /// the training split. None keeps every document.
    pub quality: Option<QualityConfig>,
    /// Mixture weights of the corpora by training step (`[[data.mixture]] step = 1, weights =
    /// [...]`, one weight per corpus); empty: equal weights throughout.
    pub mixture: MixtureSchedule,
    /// The token-distribution drift monitor.
    pub drift: DriftSection,
    /// A tokenizer (`tokenizer.json`) to tokenize the corpora with instead of training one on
    /// them: the tokenizer of a model the run starts from ([`ModelSection::init_from`]). Its
    /// vocabulary must be the model's; the prepared corpus gets a cache folder of its own.
    pub tokenizer: Option<PathBuf>,
}

/// Windows of one corpus's training split to skip (see [`DataSection::skip`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkipWindows {
    /// The corpus name (one of `data.corpora`, or a source's name with custom sources).
    pub corpus: String,
    /// The first window skipped.
    pub start: u64,
    /// One past the last window skipped.
    pub end: u64,
}

/// The drift monitor: the KL divergence of the token distribution of the last `window` global
/// batches from a reference (the training corpora mixed with the initial weights), a metric
/// (`drift_kl`) every step, and a warning event when it rises above the threshold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DriftSection {
    /// Run the monitor.
    pub enabled: bool,
    /// Global batches in the window.
    pub window: usize,
    /// Add-alpha smoothing of the reference counts.
    pub alpha: f64,
    /// Alert threshold in nats; 0: calibrated at start as `calibrate_margin` times the largest
    /// divergence of full windows of training batches drawn with the initial weights in
    /// another order (sampling noise and the estimate's bias, no drift).
    pub threshold: f64,
    /// The margin of the calibrated threshold.
    pub calibrate_margin: f64,
    /// Tokens of the training corpora the reference distribution is counted from (spread over
    /// each corpus, in proportion to the initial weights).
    pub reference_tokens: usize,
}

impl Default for DriftSection {
    fn default() -> Self {
        DriftSection {
            enabled: true,
            window: 16,
            alpha: 0.5,
            threshold: 0.0,
            calibrate_margin: 1.5,
            reference_tokens: 1 << 20,
        }
    }
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
            stall_timeout_s: 60.0,
            cache_chunk_tokens: 1 << 16,
            cache_chunks: 64,
            skip: Vec::new(),
            quality: None,
            mixture: MixtureSchedule::default(),
            drift: DriftSection::default(),
            tokenizer: None,
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
    /// Peak FLOP/s of every device of the run together, the denominator of MFU. None (the
    /// default): asked of the device in the compute dtype ([`crate::run_peak`]: a CPU's cores
    /// x clock x vector units, a GPU's published dense peak by its name), and the basis is
    /// printed at the start of the run.
    pub peak_flops_per_s: Option<f64>,
    /// Steps between records of `param_norm` and `update_param_ratio`, as Megatron logs its
    /// parameter norm at the log interval: computed inside the update on the steps that are
    /// multiples of it (1: every step, 0: never). Each costs two exact square sums over the
    /// rank's shard of the parameters and of the update, and two collectives: every step, they
    /// took 5.9% of the main job's tokens/s on 2 cores (1.021-1.148x over 4 pairs).
    pub update_norms_every: u64,
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            jsonl: true,
            tensorboard: true,
            png: true,
            console: true,
            console_every: 10,
            peak_flops_per_s: None,
            update_norms_every: 10,
        }
    }
}

/// Anomaly detection, the circuit breaker and the hang watchdog: kiln-monitor's own
/// configuration types.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorSection {
    /// Run the detectors and the breaker.
    pub detectors: bool,
    /// The loss-spike detector (`k`, `window`, `warmup`, `min_rel_jump`; all four when the
    /// table is given).
    pub loss_spike: SpikeConfig,
    /// The gradient-norm spike detector.
    pub grad_spike: SpikeConfig,
    /// A rank slower than this many times the median is a straggler (0: no straggler
    /// detector).
    pub straggler_factor: f64,
    /// What the circuit breaker does about each event, its cool-down and when it halts.
    pub breaker: BreakerPolicy,
    /// Fail the run when no step completes within this many seconds (0: no watchdog).
    pub watchdog_s: f64,
}

impl Default for MonitorSection {
    fn default() -> Self {
        MonitorSection {
            detectors: true,
            loss_spike: SpikeConfig::loss(),
            grad_spike: SpikeConfig::grad_norm(),
            straggler_factor: 3.0,
            breaker: BreakerPolicy::default(),
            watchdog_s: 600.0,
        }
    }
}

impl MonitorSection {
    /// The detectors: non-finite, loss spike, gradient-norm spike and (when
    /// `straggler_factor > 0`) straggler.
    pub fn detector_set(&self) -> Result<kiln_monitor::DetectorSet> {
        use kiln_monitor::{
            DetectorSet, Metric, NonFiniteDetector, SpikeDetector, StragglerDetector,
        };
        let named = |field: &str| {
            let field = format!("RunConfig.monitor.{field}");
            move |e: kiln_monitor::MonitorError| TrainError::config(field.clone(), e.to_string())
        };
        let window = self.loss_spike.window.max(self.grad_spike.window);
        // remember enough records to rebuild every window on resume
        let mut set = DetectorSet::new()
            .with_history(2 * window + 16)
            .with(NonFiniteDetector::default())
            .with(SpikeDetector::new(Metric::Loss, self.loss_spike).map_err(named("loss_spike"))?)
            .with(
                SpikeDetector::new(Metric::GradNorm, self.grad_spike)
                    .map_err(named("grad_spike"))?,
            );
        if self.straggler_factor > 0.0 {
            set = set.with(
                StragglerDetector::new(self.straggler_factor).map_err(named("straggler_factor"))?,
            );
        }
        Ok(set)
    }
}
