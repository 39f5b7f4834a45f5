//! The shared half of the examples that read a trained model (`sample`, `evaluate`): their
//! command line (the model folder, `--tokenizer PATH`, `--device cpu|cuda:N`, and each
//! example's own `--flag value` / `--flag=value`), and loading the model: a kiln checkpoint or
//! a Hugging Face GPT-2 folder read as [`Pretrained`], built as a [`Gpt`] on the device, with
//! its tokenizer.

use anyhow::{bail, Context};
use candle_core::Device;
use kiln_data::Tokenizer;
use kiln_model::{DeviceSpec, Gpt, GptOptions};
use kiln_train::Pretrained;
use std::path::PathBuf;
use std::time::Instant;

/// The part of the command line every model example takes.
#[derive(Debug)]
pub struct ModelArgs {
    /// The checkpoint folder, its `latest` file, a `step-NNNNNNNN` folder or a Hugging Face
    /// export folder.
    pub model: PathBuf,
    /// `--tokenizer PATH`, for a folder without a `tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// `--device cpu|cuda:N`.
    pub device: DeviceSpec,
}

/// One `--name` flag, with its value when it came as `--name=value`.
pub struct Flag {
    /// The name, without the `--`.
    pub name: String,
    /// The value after `=`, if any.
    pub inline: Option<String>,
}

/// Walks a command line: keeps the model folder (the one argument that is not a flag),
/// `--tokenizer` and `--device` itself, and hands every other flag to the example. Errors
/// carry the example's usage.
pub struct Flags<I> {
    args: I,
    usage: &'static str,
    model: Option<PathBuf>,
    tokenizer: Option<PathBuf>,
    device: DeviceSpec,
}

impl<I: Iterator<Item = String>> Flags<I> {
    /// The flags of `args` (without the program name); errors end with `usage`.
    pub fn new(args: impl IntoIterator<Item = String, IntoIter = I>, usage: &'static str) -> Self {
        Self {
            args: args.into_iter(),
            usage,
            model: None,
            tokenizer: None,
            device: DeviceSpec::Cpu,
        }
    }

    /// The next flag that is not one of the shared ones; `None` at the end.
    pub fn next_flag(&mut self) -> anyhow::Result<Option<Flag>> {
        while let Some(arg) = self.args.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                if self.model.replace(PathBuf::from(&arg)).is_some() {
                    bail!(
                        "unexpected argument {arg:?}: one model folder only\n{}",
                        self.usage
                    );
                }
                continue;
            };
            let flag = match flag.split_once('=') {
                Some((n, v)) => Flag {
                    name: n.to_string(),
                    inline: Some(v.to_string()),
                },
                None => Flag {
                    name: flag.to_string(),
                    inline: None,
                },
            };
            match flag.name.as_str() {
                "tokenizer" => self.tokenizer = Some(PathBuf::from(self.value(&flag)?)),
                "device" => {
                    let v = self.value(&flag)?;
                    self.device = v
                        .parse()
                        .with_context(|| format!("--device {v:?}: expected cpu, cuda or cuda:N"))?;
                }
                _ => return Ok(Some(flag)),
            }
        }
        Ok(None)
    }

    /// The value of `flag`: after its `=`, or the next argument.
    pub fn value(&mut self, flag: &Flag) -> anyhow::Result<String> {
        flag.inline
            .clone()
            .or_else(|| self.args.next())
            .with_context(|| format!("--{} needs a value\n{}", flag.name, self.usage))
    }

    /// The value of `flag` as a number.
    pub fn number<T: std::str::FromStr>(&mut self, flag: &Flag) -> anyhow::Result<T>
    where
        T::Err: std::fmt::Display,
    {
        let value = self.value(flag)?;
        value
            .parse()
            .map_err(|e| anyhow::anyhow!("--{} {value:?} is not a valid number: {e}", flag.name))
    }

    /// The shared flags, once every argument is read; errors without a model folder.
    pub fn finish(self) -> anyhow::Result<ModelArgs> {
        Ok(ModelArgs {
            model: self
                .model
                .with_context(|| format!("no model folder given\n{}", self.usage))?,
            tokenizer: self.tokenizer,
            device: self.device,
        })
    }
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
                 step-NNNNNNNN folder, or a Hugging Face GPT-2 folder)",
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
