//! What `kiln sample` and `kiln evaluate` share: the model folder, `--tokenizer` and
//! `--device` ([`ModelArgs`]), and loading the model: a kiln checkpoint or a Hugging Face GPT-2
//! folder read as [`Pretrained`], built as a [`Gpt`] on the device, with its tokenizer
//! ([`Loaded`]).

use anyhow::{bail, Context};
use candle_core::Device;
use kiln_data::Tokenizer;
use kiln_model::{DeviceSpec, Gpt, GptOptions};
use kiln_train::Pretrained;
use std::path::PathBuf;
use std::time::Instant;

/// The model a subcommand reads.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// A kiln checkpoint folder, its `latest` file, a step-NNNNNNNN folder, or a Hugging Face
    /// GPT-2 folder (config.json + model.safetensors)
    #[arg(value_name = "MODEL")]
    pub model: PathBuf,
    /// A tokenizer.json, for a folder without one
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// The device to run on: cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: DeviceSpec,
}

/// A model loaded for use, with its tokenizer.
pub struct Loaded {
    /// What was read: the architecture, the weights and where they came from.
    pub pretrained: Pretrained,
    /// The model, with the weights loaded.
    pub model: Gpt,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// Its file.
    pub tokenizer_path: PathBuf,
}

impl ModelArgs {
    /// Errors unless the model folder exists, naming what it could be.
    pub fn ensure_exists(&self) -> anyhow::Result<()> {
        if !self.model.exists() {
            bail!(
                "{}: no such file or folder (give a kiln checkpoint folder, its `latest` file, a \
                 step-NNNNNNNN folder, or a Hugging Face GPT-2 or Llama folder)",
                self.model.display()
            );
        }
        Ok(())
    }

    /// Loads the model onto the device and its tokenizer (`--tokenizer`, else the folder's),
    /// printing what it loaded; the model and the device it is on.
    pub fn load(&self) -> anyhow::Result<(Loaded, Device)> {
        let t0 = Instant::now();
        let pretrained = Pretrained::load(&self.model)
            .with_context(|| format!("cannot load a model from {}", self.model.display()))?;
        let cfg = &pretrained.config;
        let device = self.device.device()?;
        let opts = GptOptions {
            device: device.clone(),
            ..GptOptions::seeded(0)
        };
        let model = Gpt::new(cfg, &opts)?;
        pretrained.load_into(&model)?;
        println!(
            "loaded {} in {:.2} s",
            pretrained.source,
            t0.elapsed().as_secs_f64()
        );
        println!(
            "  GPT: {} layers, d_model {}, {} heads, context {}, vocab {}: {} parameters ({:.2}M), on {}",
            cfg.n_layers,
            cfg.d_model,
            cfg.n_heads,
            cfg.n_ctx,
            cfg.vocab_size,
            cfg.param_count(),
            cfg.param_count() as f64 / 1e6,
            self.device
        );

        let tokenizer_path = match (&self.tokenizer, &pretrained.tokenizer) {
            (Some(p), _) => p.clone(),
            (None, Some(p)) => p.clone(),
            (None, None) => bail!(
                "{} has no {}: give one with --tokenizer PATH",
                self.model.display(),
                kiln_train::TOKENIZER_FILE
            ),
        };
        if !tokenizer_path.is_file() {
            bail!("--tokenizer {}: no such file", tokenizer_path.display());
        }
        let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
        println!(
            "  tokenizer: {} ({} ids)",
            tokenizer_path.display(),
            tokenizer.vocab_size()
        );
        let loaded = Loaded {
            pretrained,
            model,
            tokenizer,
            tokenizer_path,
        };
        Ok((loaded, device))
    }
}

impl Loaded {
    /// Errors at the first of `ids` (the tokens of `what`) outside the model's vocabulary: the
    /// tokenizer does not fit the model.
    pub fn check_vocab(&self, ids: &[u32], what: &str) -> anyhow::Result<()> {
        let vocab = self.pretrained.config.vocab_size;
        if let Some((i, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            bail!(
                "token {t} (position {i}) of {what} is outside the model's vocabulary of {vocab}: \
                 {} does not fit this model (its {} ids)",
                self.tokenizer_path.display(),
                self.tokenizer.vocab_size()
            );
        }
        Ok(())
    }
}
