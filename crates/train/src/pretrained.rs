//! Trained models in and out: a kiln checkpoint (any dp, tp and ZeRO stage) or a Hugging Face
//! GPT-2 or Llama folder read as whole parameters, to export, sample from, evaluate, or start a run
//! from ([`crate::ModelSection::init_from`]).

use crate::error::{Result, TrainError};
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, Layout, LocalFs, ReshardRequest, Storage, Want, LATEST_FILE,
};
use kiln_model::hf::{self, HF_CONFIG_FILE, HF_WEIGHTS_FILE};
use kiln_model::{Gpt, GptConfig};
use kiln_state::TensorData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The checkpoint metadata key holding the model's [`GptConfig`].
pub const GPT_META_KEY: &str = "gpt";
/// The file, in a checkpoint folder's root, holding the run's tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Where a [`Pretrained`] model came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PretrainedSource {
    /// A kiln checkpoint: its folder of checkpoints, the step, and the layout it was saved
    /// with (`dp2-tp2-zero1`, ...).
    Checkpoint {
        /// The folder holding `step-*` folders.
        root: PathBuf,
        /// The step loaded.
        step: u64,
        /// The layout it was saved with.
        layout: String,
    },
    /// A Hugging Face folder (`GPT2LMHeadModel` or `LlamaForCausalLM`).
    HuggingFace {
        /// The folder.
        dir: PathBuf,
    },
}

impl std::fmt::Display for PretrainedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PretrainedSource::Checkpoint { root, step, layout } => write!(
                f,
                "the checkpoint of step {step} in {} (saved as {layout})",
                root.display()
            ),
            PretrainedSource::HuggingFace { dir } => {
                write!(f, "the Hugging Face folder {}", dir.display())
            }
        }
    }
}

/// A trained model as whole parameters: what [`Gpt::load_full_parameters`] takes and
/// [`kiln_model::hf::save_hf_dir`] writes.
#[derive(Debug, Clone)]
pub struct Pretrained {
    /// The architecture.
    pub config: GptConfig,
    /// Every parameter, whole (tp = 1 shapes), f32, in [`Gpt::named_parameters`] order.
    pub params: Vec<(String, TensorData)>,
    /// The tokenizer (`tokenizer.json`), when the source has one.
    pub tokenizer: Option<PathBuf>,
    /// Where it came from.
    pub source: PretrainedSource,
}

impl Pretrained {
    /// Reads `path`: a Hugging Face GPT-2 or Llama folder (it holds `config.json` and
    /// `model.safetensors`), or a kiln checkpoint ([`Pretrained::from_checkpoint`]).
    pub fn load(path: &Path) -> Result<Self> {
        if path.join(HF_CONFIG_FILE).is_file() || path.join(HF_WEIGHTS_FILE).is_file() {
            Self::from_hf(path)
        } else {
            Self::from_checkpoint(path)
        }
    }

    /// Reads a Hugging Face GPT-2 or Llama folder ([`kiln_model::hf::load_hf_dir`]).
    pub fn from_hf(dir: &Path) -> Result<Self> {
        let m = hf::load_hf_dir(dir)?;
        Ok(Self {
            config: m.config,
            params: m.params,
            tokenizer: m.tokenizer,
            source: PretrainedSource::HuggingFace {
                dir: dir.to_path_buf(),
            },
        })
    }

    /// Reads a kiln checkpoint, saved with any layout, into whole parameters. `path` is the
    /// folder of checkpoints (its newest committed step), its `latest` file, or one
    /// `step-NNNNNNNN` folder. Every byte read is checked against the manifest's sha256.
    pub fn from_checkpoint(path: &Path) -> Result<Self> {
        let (root, step) = locate_checkpoint(path)?;
        let storage: Arc<dyn Storage> = Arc::new(LocalFs::new(&root)?);
        let probe = Checkpointer::new(
            storage.clone(),
            CheckpointConfig::new(Layout::single(), "any"),
        )?;
        let step = match step {
            Some(s) => s,
            None => newest_step(&probe, &root)?,
        };
        let manifest = probe.manifest(step)?;
        let config: GptConfig = match manifest.user.get(GPT_META_KEY) {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| TrainError::Checkpoint {
                step,
                reason: format!("its model configuration ({GPT_META_KEY:?}) does not parse: {e}"),
            })?,
            None => {
                return Err(TrainError::Checkpoint {
                    step,
                    reason: format!(
                        "{} records no model configuration (key {GPT_META_KEY:?} of its \
                         manifest): it was not written by kiln-train's Trainer with a GPT",
                        root.display()
                    ),
                })
            }
        };
        let prefix = "engine/param/";
        let names: Vec<String> = manifest
            .tensor_names()
            .into_iter()
            .filter(|n| n.starts_with(prefix))
            .collect();
        if names.is_empty() {
            return Err(TrainError::Checkpoint {
                step,
                reason: format!(
                    "{} holds no model parameters (no tensor {prefix}*)",
                    root.display()
                ),
            });
        }
        let mut req = ReshardRequest::new(Layout::single());
        for n in &names {
            req = req.tensor(n, Want::Full);
        }
        let ckpt = Checkpointer::new(
            storage.clone(),
            CheckpointConfig::new(Layout::single(), manifest.model_hash.clone()),
        )?;
        let comm = kiln_comm::ThreadComm::group(1, Default::default())?
            .pop()
            .ok_or_else(|| TrainError::Builder("no rank in a group of one".into()))?;
        let mut loaded = ckpt.load_resharded(&comm, step, &req)?;
        let engine = loaded.state.take_part("engine")?;
        let mut by_name = std::collections::HashMap::new();
        for n in engine.names() {
            if let (Some(name), Some(t)) = (n.strip_prefix("param/"), engine.tensor(n)) {
                by_name.insert(name.to_string(), t.clone());
            }
        }
        // in the model's order, with the whole shapes of the tp = 1 model
        let mut params = Vec::with_capacity(by_name.len());
        for (name, shape) in hf::gpt_param_shapes(&config) {
            let t = by_name
                .remove(&name)
                .ok_or_else(|| TrainError::Checkpoint {
                    step,
                    reason: format!("parameter {name} is missing from {}", root.display()),
                })?;
            let values: Vec<f32> = t.to_vec()?;
            params.push((name, TensorData::from_slice(&shape, &values)?));
        }
        if let Some(extra) = by_name.keys().next() {
            return Err(TrainError::Checkpoint {
                step,
                reason: format!(
                    "parameter {extra} of {} is not one of the model's {config:?}",
                    root.display()
                ),
            });
        }
        let tok = root.join(TOKENIZER_FILE);
        Ok(Self {
            config,
            params,
            tokenizer: tok.is_file().then_some(tok),
            source: PretrainedSource::Checkpoint {
                root,
                step,
                layout: manifest.layout.to_string(),
            },
        })
    }

    /// Puts the parameters into `model` (its tensor-parallel shard of each), after checking
    /// that its architecture is this one.
    pub fn load_into(&self, model: &Gpt) -> Result<()> {
        check_same_architecture(&self.config, model.config(), &self.source)?;
        model.load_full_parameters(&self.params)?;
        Ok(())
    }
}

/// The fields of two configurations that change what the model computes.
fn architecture_diff(a: &GptConfig, b: &GptConfig) -> Vec<String> {
    let mut d = Vec::new();
    let mut cmp = |field: &str, x: String, y: String| {
        if x != y {
            d.push(format!("{field} {x} (the run: {y})"));
        }
    };
    cmp(
        "vocab_size",
        a.vocab_size.to_string(),
        b.vocab_size.to_string(),
    );
    cmp("n_ctx", a.n_ctx.to_string(), b.n_ctx.to_string());
    cmp("d_model", a.d_model.to_string(), b.d_model.to_string());
    cmp("n_layers", a.n_layers.to_string(), b.n_layers.to_string());
    cmp("n_heads", a.n_heads.to_string(), b.n_heads.to_string());
    cmp(
        "layer_norm_eps",
        a.layer_norm_eps.to_string(),
        b.layer_norm_eps.to_string(),
    );
    cmp(
        "n_kv_heads",
        a.kv_heads().to_string(),
        b.kv_heads().to_string(),
    );
    cmp(
        "ffn_hidden_size",
        a.d_ff().to_string(),
        b.d_ff().to_string(),
    );
    cmp("norm", format!("{:?}", a.norm), format!("{:?}", b.norm));
    cmp(
        "positions",
        format!("{:?}", a.positions),
        format!("{:?}", b.positions),
    );
    if a.positions == kiln_model::PositionKind::Rotary {
        cmp(
            "rope_theta",
            a.rope_theta.to_string(),
            b.rope_theta.to_string(),
        );
        cmp(
            "rope_scaling",
            format!("{:?}", a.rope_scaling),
            format!("{:?}", b.rope_scaling),
        );
    }
    cmp("mlp", format!("{:?}", a.mlp), format!("{:?}", b.mlp));
    cmp("bias", a.bias.to_string(), b.bias.to_string());
    cmp(
        "tied_embeddings",
        a.tied_embeddings.to_string(),
        b.tied_embeddings.to_string(),
    );
    d
}

fn check_same_architecture(
    saved: &GptConfig,
    run: &GptConfig,
    source: &PretrainedSource,
) -> Result<()> {
    let diff = architecture_diff(saved, run);
    if diff.is_empty() {
        return Ok(());
    }
    Err(TrainError::config(
        "RunConfig.model",
        format!(
            "{source} has {}: set model.preset (a GPT or a Llama preset) and its overrides \
             (--model.d_model, --model.n_kv_heads, --model.rope_scaling, ...) to match it; \
             `kiln import-hf` sets them from a Hugging Face folder",
            diff.join(", ")
        ),
    ))
}

/// The checkpoint root and, when `path` names one, the step.
fn locate_checkpoint(path: &Path) -> Result<(PathBuf, Option<u64>)> {
    let missing = || TrainError::Checkpoint {
        step: 0,
        reason: format!(
            "{} is neither a folder of checkpoints, its {LATEST_FILE} file, a step-NNNNNNNN \
             folder, nor a Hugging Face folder ({HF_CONFIG_FILE} + {HF_WEIGHTS_FILE})",
            path.display()
        ),
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let parent = || path.parent().map(Path::to_path_buf).ok_or_else(missing);
    if path.is_file() && name == LATEST_FILE {
        return Ok((parent()?, None));
    }
    if path.is_dir() {
        if let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.strip_suffix(".replaced").or(Some(s)))
            .and_then(|s| s.parse::<u64>().ok())
        {
            return Ok((parent()?, Some(step)));
        }
        return Ok((path.to_path_buf(), None));
    }
    if name == LATEST_FILE && path.parent().is_some_and(Path::is_dir) {
        // `checkpoints/latest` before the pointer was written: the newest committed step
        return Ok((parent()?, None));
    }
    Err(missing())
}

fn newest_step(ckpt: &Checkpointer, root: &Path) -> Result<u64> {
    ckpt.committed_steps()?
        .into_iter()
        .max()
        .ok_or_else(|| TrainError::Checkpoint {
            step: 0,
            reason: format!("{} holds no committed checkpoint", root.display()),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_that_are_not_checkpoints_are_named() {
        let p = std::env::temp_dir().join(format!("kiln-no-such-{}", std::process::id()));
        let err = Pretrained::load(&p)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(&p.display().to_string()), "{err}");
    }
}
