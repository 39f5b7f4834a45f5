//! [`RunConfig`]: everything a training run is configured with, loadable from TOML, validated
//! with errors that name the field, and overridable from command-line flags.

mod overrides;
mod sections;
mod validate;

pub use sections::{
    CheckpointSection, DataSection, DriftSection, DynamicBatchSection, EvalSection, MetricsSection,
    ModelSection, MonitorSection, OptimSection, ParallelSection, PrecisionSection, SkipWindows,
    TrainSection,
};

use crate::error::{Result, TrainError};
use kiln_memory::RecomputePolicy;
use kiln_model::{DeviceSpec, GptConfig};
use kiln_optim::ScheduleConfig;
use kiln_precision::ComputeDType;
use kiln_state::ZeroStage;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The names [`RunConfig::preset`] knows.
pub const RUN_PRESETS: &[&str] = &[
    "tiny",
    "train_gpt",
    "train_gpt_zero3",
    "train_gpt_tp",
    "train_llama",
];

/// Everything a training run is configured with.
///
/// Every section has defaults, so a TOML file only names what it changes; unknown keys are
/// errors. [`RunConfig::validate`] checks the whole configuration and names the field at fault;
/// [`RunConfig::apply_overrides`] and [`RunConfig::from_args`] set fields from command-line
/// flags (`--steps 30 --dp 2`, or any dotted path: `--optim.schedule.lr 1e-3`).
///
/// ```
/// use kiln_train::RunConfig;
/// let mut cfg = RunConfig::from_toml_str("seed = 7\n[parallel]\ndp = 2\n[train]\nsteps = 20\n")?;
/// cfg.apply_overrides(&[("tp", "2"), ("optim.schedule.lr", "1e-3")])?;
/// assert_eq!((cfg.seed, cfg.parallel.dp, cfg.parallel.tp, cfg.train.steps), (7, 2, 2, 20));
/// assert_eq!(cfg.optim.schedule.lr, 1e-3);
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
    /// Where the model and the step run: `cpu` (default), `cuda` or `cuda:N` (a build with
    /// the `cuda` feature). Under a launcher with one process per GPU, each rank adds its
    /// local rank to N. Not part of the trajectory hash: a checkpoint written on one device
    /// resumes on the other.
    pub device: DeviceSpec,
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
            device: DeviceSpec::Cpu,
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

impl RunConfig {
    /// A named starting point (see [`RUN_PRESETS`]):
    /// - `tiny`: the `tiny` model, one rank, f32, 50 steps; for tests and quick checks.
    /// - `train_gpt`: the GPT-3 architecture scaled down (`small_cpu`), dp=2 x tp=2 with
    ///   sequence parallelism, ZeRO-1, f16 with dynamic loss scaling, selective activation
    ///   checkpointing of one block in four, warmup and cosine decay, clipping, checkpoints,
    ///   spike detection with rollback, JSONL, TensorBoard and PNG; the corpus through the
    ///   perplexity filter, its three corpora mixed equally for 100 steps and then 3:1:1, the
    ///   drift monitor watching.
    /// - `train_gpt_zero3`: `train_gpt` on dp=4 with ZeRO-3, the micro-batch chosen by the
    ///   memory estimate under a budget of 1 GiB per rank, one block in four recomputed whole
    ///   (ZeRO-3 gathers its parameters again for the recomputation).
    /// - `train_gpt_tp`: `train_gpt` on tp=4.
    /// - `train_llama`: `train_gpt` with the Llama layout (`llama_cpu`: RMSNorm, rotary
    ///   positions, SwiGLU, 8 query heads sharing 2 key/value heads, no biases, an untied head).
    pub fn preset(name: &str) -> Result<Self> {
        let key = name.trim().to_ascii_lowercase().replace('-', "_");
        let base = RunConfig::default();
        let gpt = |dp: usize, tp: usize, zero: ZeroStage, run: &str| RunConfig {
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
                // the LayerNorms, residuals and biases on each tensor-parallel rank's share of
                // the token rows, not repeated on every one
                sequence_parallel: tp > 1,
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
                // one block in four selectively (`selective_4`): its LayerNorm, GELU and
                // all-gather outputs are dropped and computed again in the backward, which
                // costs a fraction of recomputing the block (its forward is about 6% of the
                // step here); `every_block` where activation memory is short
                recompute: RecomputePolicy::Selective(4),
                ..TrainSection::default()
            },
            optim: OptimSection {
                schedule: ScheduleConfig {
                    lr: 2e-3,
                    min_lr: 2e-4,
                    warmup_steps: 20,
                    ..ScheduleConfig::default()
                },
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
            data: DataSection {
                // the main job filters its corpus and shifts its mixture halfway through, which
                // the drift monitor (on by default) sees
                quality: Some(kiln_data::QualityConfig::default()),
                mixture: kiln_data::MixtureSchedule {
                    points: vec![
                        kiln_data::MixturePoint {
                            step: 1,
                            weights: vec![1.0, 1.0, 1.0],
                        },
                        kiln_data::MixturePoint {
                            step: 101,
                            weights: vec![3.0, 1.0, 1.0],
                        },
                    ],
                },
                ..DataSection::default()
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
            "train_gpt" => gpt(2, 2, ZeroStage::Zero1, "train_gpt"),
            "train_gpt_zero3" => {
                let mut c = gpt(4, 1, ZeroStage::Zero3, "train_gpt_zero3");
                // the micro-batch chosen by kiln-memory's estimate under 1 GiB per rank
                c.train.dynamic_batch = Some(DynamicBatchSection { budget_mib: 1024.0 });
                c.train.recompute = RecomputePolicy::EveryKth(4);
                c
            }
            "train_gpt_tp" => gpt(1, 4, ZeroStage::Replicated, "train_gpt_tp"),
            "train_llama" => {
                let mut c = gpt(2, 2, ZeroStage::Zero1, "train_llama");
                c.model.preset = "llama_cpu".into();
                c
            }
            _ => {
                return Err(TrainError::config(
                    "RunConfig preset",
                    format!("unknown preset {name:?}; known: {}", RUN_PRESETS.join(", ")),
                ))
            }
        })
    }

    /// Parses a TOML document. A document that leaves out `train.seq_len` trains at the
    /// model's context length (`n_ctx` of `model.preset`, or `model.n_ctx`).
    ///
    /// ```
    /// use kiln_train::RunConfig;
    /// let cfg = RunConfig::from_toml_str("[model]\npreset = \"small_cpu\"\n")?;
    /// assert_eq!(cfg.train.seq_len, 128);
    /// let cfg = RunConfig::from_toml_str("[model]\npreset = \"small_cpu\"\n[train]\nseq_len = 32\n")?;
    /// assert_eq!(cfg.train.seq_len, 32);
    /// # Ok::<(), kiln_train::TrainError>(())
    /// ```
    pub fn from_toml_str(text: &str) -> Result<Self> {
        Self::parse_toml(text, Path::new("<string>"))
    }

    /// Reads and parses a TOML file (see [`RunConfig::from_toml_str`]).
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::File {
            op: "read",
            path: path.to_path_buf(),
            source: e,
        })?;
        Self::parse_toml(&text, path)
    }

    fn parse_toml(text: &str, path: &Path) -> Result<Self> {
        let parse_error = |e| TrainError::Parse {
            path: path.to_path_buf(),
            source: Box::new(e),
        };
        let mut cfg: RunConfig = toml::from_str(text).map_err(parse_error)?;
        let doc: toml::Table = toml::from_str(text).map_err(parse_error)?;
        let seq_len_given = doc.get("train").and_then(|t| t.get("seq_len")).is_some();
        // an unknown preset is left for `validate` to name
        if let (false, Ok(model)) = (seq_len_given, cfg.gpt_config()) {
            cfg.train.seq_len = model.n_ctx;
        }
        Ok(cfg)
    }

    /// The configuration as TOML.
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| TrainError::Parse {
            path: PathBuf::from("<string>"),
            source: Box::new(e),
        })
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
        // a filtered corpus has its own folder: runs with and without the filter share a cache
        let quality = match &self.data.quality {
            Some(q) => format!("-ppl{}x{}m{}", q.order, q.drop_fraction, q.min_doc_tokens),
            None => String::new(),
        };
        // a given tokenizer too, by its content
        let tokenizer = match &self.data.tokenizer {
            Some(path) => {
                let bytes = std::fs::read(path).map_err(|source| TrainError::File {
                    op: "read the tokenizer (RunConfig.data.tokenizer)",
                    path: path.clone(),
                    source,
                })?;
                format!("-tok{:08x}", crc32fast::hash(&bytes))
            }
            None => String::new(),
        };
        Ok(root.join(format!(
            "{}-v{vocab}{quality}{tokenizer}",
            self.data.corpora.join("+")
        )))
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
            "val_fraction": self.data.val_fraction});
        // later additions enter the hash only when set, so earlier checkpoints keep theirs
        let mut v = v;
        if let Some(q) = &self.data.quality {
            v["quality"] = serde_json::json!(q);
        }
        if !self.data.mixture.is_empty() {
            v["mixture"] = serde_json::json!(self.data.mixture);
        }
        let digest = Sha256::digest(v.to_string().as_bytes());
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
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
        // the parser's error is the source, and its text is in the message
        let source = std::error::Error::source(&e).unwrap().to_string();
        assert!(e.to_string().ends_with(&source), "{e}");
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
        // a warmup longer than the run is capped, and said, not an error
        let mut c = RunConfig::default();
        c.optim.schedule.warmup_steps = 500;
        c.validate().unwrap();
        assert_eq!(
            c.short_run_notes(),
            [
                "optim.schedule.warmup_steps 500 is longer than the run's 100 steps: warming up \
              over all 100"
            ]
        );
        let e = RunConfig::from_toml_str("[train]\nrecompute = \"every_0\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("every_0") && e.contains("every_block"), "{e}");
        let e = RunConfig::default()
            .apply_overrides(&[("recompute", "every_0")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RunConfig.train.recompute"), "{e}");
        // sequence parallelism: rows that split over tp, and no LoRA adapters
        let mut c = RunConfig::default();
        c.parallel.tp = 2;
        c.parallel.sequence_parallel = true;
        c.train.seq_len = 63;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("RunConfig.parallel.sequence_parallel")
                && e.contains("train.seq_len (63) must be a multiple of parallel.tp (2)"),
            "{e}"
        );
        c.train.seq_len = 64;
        c.validate().unwrap();
        c.model.lora = Some(kiln_tune::LoraConfig::default());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("LoRA") && e.contains("sequence_parallel"), "{e}");
        let mut c = RunConfig::default();
        c.apply_overrides(&[("sequence_parallel", "true")]).unwrap();
        assert!(c.parallel.sequence_parallel);
        let mut c = RunConfig::default();
        c.monitor.breaker.cooldown_lr_factor = -1.0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("RunConfig.monitor.breaker"));
        let mut c = RunConfig::default();
        c.precision.compute = ComputeDType::F16;
        c.precision.scaler.backoff_factor = 2.0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("RunConfig.precision.scaler"));
        let e = RunConfig::default()
            .apply_overrides(&[("device", "tpu")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RunConfig.device") && e.contains("cuda:N"),
            "{e}"
        );
        if !cfg!(feature = "cuda") {
            let mut c = RunConfig::default();
            c.apply_overrides(&[("device", "cuda:1")]).unwrap();
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.contains("RunConfig.device")
                    && e.contains("cuda:1")
                    && e.contains("--features cuda"),
                "{e}"
            );
        }
        // the ZeRO stage is a closed set: a fifth stage is refused where it is read, naming
        // the field and the value
        let mut c = RunConfig::default();
        let e = c.apply_overrides(&[("zero", "4")]).unwrap_err().to_string();
        assert!(
            e.contains("RunConfig.parallel.zero") && e.contains("got 4"),
            "{e}"
        );
        let e = RunConfig::from_toml_str("[parallel]\nzero = 5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero") && e.contains("got 5"), "{e}");
        c.apply_overrides(&[("zero", "3")]).unwrap();
        assert_eq!(c.parallel.zero, ZeroStage::Zero3);
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
            ("recompute", "every_2"),
        ])
        .unwrap();
        assert_eq!(c.train.steps, 30);
        assert_eq!(c.parallel.dp, 2);
        assert_eq!(c.optim.max_grad_norm, 0.5);
        assert!(!c.metrics.png);
        assert_eq!(c.data.corpora, ["austen", "shakespeare"]);
        assert_eq!(c.checkpoint.resume_step, Some(20));
        assert_eq!(c.precision.compute, ComputeDType::F16);
        assert_eq!(c.train.recompute, RecomputePolicy::EveryKth(2));
        // the nested crates' configurations, field by field
        c.apply_overrides(&[
            ("precision.scaler.hysteresis", "2"),
            ("monitor.breaker.on_loss_spike", "skip_batch"),
            ("monitor.loss_spike.k", "4"),
            ("lr", "1e-3"),
            ("optim.weight_decay_groups.embedding", "true"),
        ])
        .unwrap();
        assert_eq!(c.precision.scaler.hysteresis, 2);
        assert_eq!(
            c.monitor.breaker.on_loss_spike,
            kiln_monitor::Response::SkipBatch
        );
        assert_eq!(c.monitor.loss_spike.k, 4.0);
        assert_eq!(c.optim.schedule.lr, 1e-3);
        assert!(c.optim.weight_decay_groups.embedding);
        // switching the optimizer drops the other one's options
        c.apply_overrides(&[("optimizer", "sgd"), ("optim.optimizer.momentum", "0.9")])
            .unwrap();
        assert_eq!(
            c.optim.optimizer,
            kiln_optim::OptimizerConfig::Sgd(kiln_optim::SgdConfig {
                momentum: 0.9,
                ..Default::default()
            })
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
    fn data_dir_by_its_path_its_alias_and_its_flag() {
        let mut c = RunConfig::default();
        c.apply_overrides(&[("data.data_dir", "/srv/kiln/data")])
            .unwrap();
        assert_eq!(c.data.data_dir, Path::new("/srv/kiln/data"));
        c.apply_overrides(&[("data_dir", "../kiln/data")]).unwrap();
        assert_eq!(c.data.data_dir, Path::new("../kiln/data"));
        let c = RunConfig::from_args("tiny", ["--data-dir", "corpus"].map(String::from)).unwrap();
        assert_eq!(c.data.data_dir, Path::new("corpus"));
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
    fn a_chosen_model_brings_its_context_length() {
        let args = |a: &[&str]| {
            RunConfig::from_args("train_gpt", a.iter().map(|s| s.to_string()))
                .and_then(|c| c.validate().map(|()| c))
        };
        // train_gpt trains small_cpu (n_ctx 128) at 128; tiny has 64 positions
        assert_eq!(args(&[]).unwrap().train.seq_len, 128);
        let c = args(&["--preset", "tiny"]).unwrap();
        assert_eq!((c.model.preset.as_str(), c.train.seq_len), ("tiny", 64));
        // gpt3_small: 2048 positions (its vocabulary of 50257 does not split over tp = 2)
        let c = args(&["--preset", "gpt3_small", "--tp", "1"]).unwrap();
        assert_eq!(c.train.seq_len, 2048);
        assert_eq!(args(&["--model.n_ctx", "96"]).unwrap().train.seq_len, 96);
        // an explicit length wins, before or after the model
        for a in [
            ["--ctx", "32", "--preset", "tiny"],
            ["--preset", "tiny", "--ctx", "32"],
        ] {
            assert_eq!(args(&a).unwrap().train.seq_len, 32, "{a:?}");
        }
        // and one that does not fit stays an error naming it
        let e = args(&["--preset", "tiny", "--ctx", "128"])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("RunConfig.train.seq_len: must be in 1..=64 (the model's n_ctx), got 128"),
            "{e}"
        );
        // an unknown preset is named by validate, not by the override
        let e = args(&["--preset", "tiny2"]).unwrap_err().to_string();
        assert!(
            e.contains("RunConfig.model.preset") && e.contains("tiny2"),
            "{e}"
        );
        // later flags that do not touch the model leave the length alone
        let c = args(&["--preset", "tiny", "--steps", "7"]).unwrap();
        assert_eq!((c.train.seq_len, c.train.steps), (64, 7));
        // TOML: without train.seq_len, the model's context; with it, as given
        let toml = |t: &str| RunConfig::from_toml_str(t).unwrap().train.seq_len;
        assert_eq!(toml("[model]\npreset = \"small_cpu\"\n"), 128);
        assert_eq!(toml("[model]\npreset = \"tiny\"\nn_ctx = 48\n"), 48);
        assert_eq!(
            toml("[model]\npreset = \"small_cpu\"\n[train]\nseq_len = 16\n"),
            16
        );
        assert_eq!(toml("seed = 3\n"), RunConfig::default().train.seq_len);
        // a file given by --config, then a model flag: the flag's model brings its length
        let dir = std::env::temp_dir().join(format!("kiln-train-ctx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("run.toml");
        std::fs::write(&file, "[model]\npreset = \"small_cpu\"\n").unwrap();
        let c = args(&["--config", file.to_str().unwrap()]).unwrap();
        assert_eq!(c.train.seq_len, 128);
        let c = args(&["--config", file.to_str().unwrap(), "--preset", "tiny"]).unwrap();
        assert_eq!(c.train.seq_len, 64);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_short_run_caps_its_warmup_and_says_so() {
        for preset in RUN_PRESETS {
            for steps in [1u64, 3, 5] {
                let c =
                    RunConfig::from_args(preset, ["--steps".into(), steps.to_string()]).unwrap();
                c.validate().unwrap();
                let warmup = c.optim.schedule.warmup_steps;
                let notes = c.short_run_notes();
                assert_eq!(notes.len(), usize::from(warmup > steps), "{preset} {steps}");
                if warmup > steps {
                    assert!(
                        notes[0].contains(&format!("warmup_steps {warmup}"))
                            && notes[0].contains(&format!("{steps} steps")),
                        "{notes:?}"
                    );
                }
                // a capped warmup rises linearly from 0 over the whole run:
                // lr(s) = peak * s / steps for every step of it
                if warmup > steps {
                    let schedule = c.optim.schedule(steps).unwrap();
                    let peak = c.optim.schedule.lr;
                    for s in 0..steps {
                        let want = (peak * s as f64 / steps as f64) as f32;
                        assert_eq!(schedule.lr(s), want, "{preset}: step {s} of {steps}");
                    }
                }
            }
        }
        // an explicit warmup longer than the run is capped the same way
        let c = RunConfig::from_args("tiny", ["--steps", "4", "--warmup", "9"].map(String::from))
            .unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.short_run_notes(),
            [
                "optim.schedule.warmup_steps 9 is longer than the run's 4 steps: warming up over \
              all 4"
            ]
        );
        // the configuration keeps the value given: the trajectory hash ignores the step count
        let long =
            RunConfig::from_args("tiny", ["--steps", "40", "--warmup", "9"].map(String::from))
                .unwrap();
        assert_eq!(c.optim, long.optim);
        assert_eq!(c.trajectory_hash(), long.trajectory_hash());
    }

    #[test]
    fn trajectory_hash_ignores_layout_and_outputs() {
        let a = RunConfig::default();
        let mut b = a.clone();
        b.parallel.zero = ZeroStage::Zero3;
        b.output_dir = "elsewhere".into();
        b.train.steps = 7;
        assert_eq!(a.trajectory_hash(), b.trajectory_hash());
        b.optim.schedule.lr *= 2.0;
        assert_ne!(a.trajectory_hash(), b.trajectory_hash());
    }

    #[test]
    fn data_sections_from_flags_and_their_errors() {
        let c = RunConfig::preset("train_gpt").unwrap();
        assert!(c.data.quality.is_some() && c.data.drift.enabled);
        assert_eq!(c.data.mixture.points.len(), 2);
        c.validate().unwrap();
        // other corpora without a schedule: equal weights; with one: checked against them
        let mut one = c.clone();
        one.apply_overrides(&[("corpora", "shakespeare")]).unwrap();
        assert!(one.data.mixture.is_empty());
        one.validate().unwrap();
        let mut two = c.clone();
        two.apply_overrides(&[
            ("corpora", "shakespeare,austen"),
            ("data.mixture", r#"[{"step": 1, "weights": [2, 1]}]"#),
        ])
        .unwrap();
        assert_eq!(two.data.mixture.weights_at(5), Some(&[2.0, 1.0][..]));
        two.validate().unwrap();
        let mut bad = c.clone();
        bad.apply_overrides(&[("data.mixture", r#"[{"step": 1, "weights": [2, 1]}]"#)])
            .unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(
            e.contains("RunConfig.data.mixture") && e.contains("2 weights for 3 sources"),
            "{e}"
        );
        // the filter off, loader options and the drift section
        let mut o = c.clone();
        o.apply_overrides(&[
            ("data.quality", "none"),
            ("data.stall_timeout_s", "2.5"),
            ("data.drift.window", "4"),
            (
                "data.skip",
                r#"[{"corpus": "austen", "start": 3, "end": 9}]"#,
            ),
        ])
        .unwrap();
        assert_eq!(o.data.quality, None);
        assert_eq!((o.data.stall_timeout_s, o.data.drift.window), (2.5, 4));
        assert_eq!(o.data.skip[0].end, 9);
        assert_ne!(o.data_cache_dir().unwrap(), c.data_cache_dir().unwrap());
        for (k, v, field) in [
            ("data.drift.window", "0", "data.drift.window"),
            ("data.stall_timeout_s", "0", "data.stall_timeout_s"),
            ("data.quality.drop_fraction", "1.5", "data.quality"),
            (
                "data.skip",
                r#"[{"corpus": "austen", "start": 9, "end": 9}]"#,
                "data.skip[0]",
            ),
        ] {
            let mut x = c.clone();
            x.apply_overrides(&[(k, v)]).unwrap();
            let e = x.validate().unwrap_err().to_string();
            assert!(e.contains(&format!("RunConfig.{field}")), "{k}={v}: {e}");
        }
    }
}
