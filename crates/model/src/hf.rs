//! Hugging Face's GPT-2 layout: kiln's [`Gpt`](crate::Gpt) parameters to and from the
//! `model.safetensors` + `config.json` folder that `transformers.GPT2LMHeadModel` reads and
//! writes.
//!
//! The two models compute the same function: pre-LayerNorm blocks, learned positions, a fused
//! QKV projection laid out `[q | k | v]`, a 4x MLP with the tanh-approximated GELU (GPT-2's
//! `gelu_new`), a final LayerNorm and an LM head tied to the token embedding. Only the storage
//! differs:
//!
//! | kiln | GPT-2 |
//! |---|---|
//! | `wte` `[vocab, d]`, `wpe` `[n_ctx, d]` | `transformer.wte.weight`, `transformer.wpe.weight` |
//! | `h.{i}.ln_1.weight` ... `ln_f.bias` | `transformer.h.{i}.ln_1.weight` ... `transformer.ln_f.bias` |
//! | linear weights `[out, in]` (`nn.Linear`) | `Conv1D` weights `[in, out]`: transposed |
//! | biases | the same |
//!
//! A kiln checkpoint stores the fused QKV weight as `[3, d, in]` (the same bytes as
//! `[3d, in]`); [`to_hf`] accepts either. [`from_hf`] also reads folders whose names lack the
//! `transformer.` prefix (the original `gpt2` upload), ignores GPT-2's causal-mask buffers
//! (`attn.bias`, `attn.masked_bias`), and accepts an `lm_head.weight` only when it equals the
//! token embedding (kiln ties them).
//!
//! The Llama layout goes to and from `LlamaForCausalLM` folders in [`llama`];
//! [`load_hf_dir`], [`save_hf_dir`] and [`read_model_config`] choose by the folder's
//! `model_type` and the model's architecture.

pub mod llama;

use crate::config::GptConfig;
use crate::error::{ModelError, Result};
use kiln_state::{DType, TensorData};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The weights file of a Hugging Face model folder.
pub const HF_WEIGHTS_FILE: &str = "model.safetensors";
/// The configuration file of a Hugging Face model folder.
pub const HF_CONFIG_FILE: &str = "config.json";
/// The tokenizer file of a Hugging Face model folder (the `tokenizers` library's format).
pub const HF_TOKENIZER_FILE: &str = "tokenizer.json";

/// GPT-2's `config.json`, the fields `transformers.GPT2Config` reads that shape the model.
///
/// Unknown fields are kept in [`Gpt2Config::extra`] and written back unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// `["GPT2LMHeadModel"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `"gpt2"`.
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Learned positions.
    pub n_positions: usize,
    /// Model width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// The MLP's inner width (`None`: 4 x `n_embd`).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// The MLP's activation: kiln computes `gelu_new` (= `gelu_pytorch_tanh`).
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// Standard deviation of the initialisation.
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    /// Whether the LM head is the token embedding (kiln: always).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Whether attention scores are divided by `sqrt(head_dim)` (kiln: always).
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    /// GPT-2's optional per-layer score scaling (kiln: never).
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Dropout on the residual branches (kiln trains without dropout and writes 0).
    #[serde(default)]
    pub resid_pdrop: f64,
    /// Dropout on the embeddings.
    #[serde(default)]
    pub embd_pdrop: f64,
    /// Dropout on the attention probabilities.
    #[serde(default)]
    pub attn_pdrop: f64,
    /// Beginning-of-text token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-text token.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// The dtype of the stored weights.
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Every other field, kept as read.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

fn default_activation() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_init_range() -> f64 {
    0.02
}
fn default_true() -> bool {
    true
}

/// The activations that equal kiln's GELU (the tanh approximation).
const TANH_GELU: &[&str] = &["gelu_new", "gelu_pytorch_tanh"];

impl Gpt2Config {
    /// GPT-2's configuration of a kiln model; `eot` is the end-of-text token when the
    /// tokenizer has one (written as `bos_token_id` and `eos_token_id`, as GPT-2's are).
    pub fn from_gpt(cfg: &GptConfig, eot: Option<u32>) -> Self {
        Self {
            architectures: vec!["GPT2LMHeadModel".into()],
            model_type: "gpt2".into(),
            vocab_size: cfg.vocab_size,
            n_positions: cfg.n_ctx,
            n_embd: cfg.d_model,
            n_layer: cfg.n_layers,
            n_head: cfg.n_heads,
            n_inner: None,
            activation_function: "gelu_new".into(),
            layer_norm_epsilon: cfg.layer_norm_eps,
            initializer_range: cfg.embedding_std,
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            bos_token_id: eot,
            eos_token_id: eot,
            torch_dtype: Some("float32".into()),
            extra: BTreeMap::from([("n_ctx".to_string(), serde_json::json!(cfg.n_ctx))]),
        }
    }

    /// kiln's configuration of this GPT-2, or an error naming the field kiln's decoder cannot
    /// compute (another activation, an MLP other than 4x, untied embeddings, per-layer score
    /// scaling, unscaled scores, upcast reordering).
    pub fn to_gpt(&self) -> Result<GptConfig> {
        let unsupported = |field: &'static str, got: String, expected: &'static str| {
            Err(ModelError::HfConfig {
                field,
                got,
                expected,
            })
        };
        if self.model_type != "gpt2" {
            return unsupported("model_type", self.model_type.clone(), "\"gpt2\"");
        }
        if !TANH_GELU.contains(&self.activation_function.as_str()) {
            return unsupported(
                "activation_function",
                self.activation_function.clone(),
                "\"gelu_new\" or \"gelu_pytorch_tanh\" (kiln's GELU is the tanh approximation)",
            );
        }
        if let Some(inner) = self.n_inner {
            if inner != 4 * self.n_embd {
                return unsupported("n_inner", inner.to_string(), "null or 4 * n_embd");
            }
        }
        if !self.tie_word_embeddings {
            return unsupported("tie_word_embeddings", "false".into(), "true");
        }
        if !self.scale_attn_weights {
            return unsupported("scale_attn_weights", "false".into(), "true");
        }
        if self.scale_attn_by_inverse_layer_idx {
            return unsupported("scale_attn_by_inverse_layer_idx", "true".into(), "false");
        }
        if self.extra.get("reorder_and_upcast_attn") == Some(&serde_json::Value::Bool(true)) {
            return unsupported("reorder_and_upcast_attn", "true".into(), "false");
        }
        let mut cfg = GptConfig::new(
            self.vocab_size,
            self.n_positions,
            self.n_embd,
            self.n_layer,
            self.n_head,
        );
        cfg.layer_norm_eps = self.layer_norm_epsilon;
        cfg.embedding_std = self.initializer_range;
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The linear layers of a block, by kiln's name suffix: their weights are transposed.
const LINEARS: &[&str] = &["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

/// Every parameter of `cfg`'s model by kiln name, with its whole (tp = 1) shape as
/// [`crate::Gpt::named_parameters`] holds it, in that order.
pub fn gpt_param_shapes(cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
    use crate::config::{MlpKind, NormKind, PositionKind};
    let (d, f) = (cfg.d_model, cfg.d_ff());
    let (q, kv) = (
        cfg.n_heads * cfg.head_dim(),
        cfg.kv_heads() * cfg.head_dim(),
    );
    let up = match cfg.mlp {
        MlpKind::Gelu => f,
        MlpKind::SwiGlu => 2 * f,
    };
    let norm_shift = cfg.norm == NormKind::LayerNorm && cfg.bias;
    let mut out = vec![("wte".to_string(), vec![cfg.vocab_size, d])];
    if cfg.positions == PositionKind::Learned {
        out.push(("wpe".to_string(), vec![cfg.n_ctx, d]));
    }
    for i in 0..cfg.n_layers {
        let norm = |out: &mut Vec<_>, name: &str| {
            out.push((format!("h.{i}.{name}.weight"), vec![d]));
            if norm_shift {
                out.push((format!("h.{i}.{name}.bias"), vec![d]));
            }
        };
        let linear = |out: &mut Vec<_>, name: &str, out_f: usize, in_f: usize| {
            out.push((format!("h.{i}.{name}.weight"), vec![out_f, in_f]));
            if cfg.bias {
                out.push((format!("h.{i}.{name}.bias"), vec![out_f]));
            }
        };
        norm(&mut out, "ln_1");
        if cfg.grouped_query() {
            linear(&mut out, "attn.q_proj", q, d);
            linear(&mut out, "attn.k_proj", kv, d);
            linear(&mut out, "attn.v_proj", kv, d);
        } else {
            linear(&mut out, "attn.c_attn", 3 * q, d);
        }
        linear(&mut out, "attn.c_proj", d, q);
        norm(&mut out, "ln_2");
        linear(&mut out, "mlp.c_fc", up, d);
        linear(&mut out, "mlp.c_proj", d, f);
    }
    out.push(("ln_f.weight".to_string(), vec![d]));
    if norm_shift {
        out.push(("ln_f.bias".to_string(), vec![d]));
    }
    if !cfg.tied_embeddings {
        out.push(("lm_head".to_string(), vec![cfg.vocab_size, d]));
    }
    out
}

/// GPT-2's name of kiln's parameter `name`.
pub fn hf_name(name: &str) -> String {
    match name {
        "wte" | "wpe" => format!("transformer.{name}.weight"),
        other => format!("transformer.{other}"),
    }
}

fn is_linear_weight(name: &str) -> bool {
    name.strip_suffix(".weight")
        .is_some_and(|stem| LINEARS.iter().any(|l| stem.ends_with(l)))
}

/// `[rows, cols]` row-major to `[cols, rows]`.
fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

pub(crate) fn tensor_err(name: &str, reason: impl Into<String>) -> ModelError {
    ModelError::HfTensor {
        tensor: name.to_string(),
        reason: reason.into(),
    }
}

/// The f32 values of `t`, whatever its float dtype.
pub(crate) fn to_f32(name: &str, t: &TensorData) -> Result<Vec<f32>> {
    let bad = |e: kiln_state::StateError| tensor_err(name, e.to_string());
    Ok(match t.dtype() {
        DType::F32 => t.to_vec::<f32>().map_err(bad)?,
        DType::F16 => t
            .to_vec::<half::f16>()
            .map_err(bad)?
            .into_iter()
            .map(f32::from)
            .collect(),
        DType::BF16 => t
            .to_vec::<half::bf16>()
            .map_err(bad)?
            .into_iter()
            .map(f32::from)
            .collect(),
        other => {
            return Err(tensor_err(
                name,
                format!(
                    "dtype {}, expected a float (F32, F16 or BF16)",
                    other.name()
                ),
            ))
        }
    })
}

/// `cfg` has GPT-2's layout (LayerNorm, learned positions, GELU, multi-head attention, biases,
/// a tied head), or an error naming its architecture.
fn gpt2_layout(cfg: &GptConfig) -> Result<()> {
    if cfg.is_gpt_layout() {
        return Ok(());
    }
    let arch = cfg.describe();
    Err(ModelError::Config {
        field: "architecture",
        reason: format!(
            "Hugging Face's GPT-2 layout, read and written here, cannot hold the {arch}"
        ),
    })
}

/// Turns kiln's whole parameters of `cfg` (as [`gpt_param_shapes`] names them; the fused QKV
/// also as a checkpoint's `[3, d, in]`) into GPT-2's tensors, f32, in kiln's order.
///
/// Every parameter must be present exactly once with its shape's element count; unknown names
/// are an error, and so is an architecture GPT-2's layout cannot hold (the Llama layout).
pub fn to_hf(
    cfg: &GptConfig,
    params: &[(String, TensorData)],
) -> Result<Vec<(String, TensorData)>> {
    gpt2_layout(cfg)?;
    let mut by_name: HashMap<&str, &TensorData> = HashMap::new();
    for (n, t) in params {
        if by_name.insert(n.as_str(), t).is_some() {
            return Err(tensor_err(n, "given twice"));
        }
    }
    let shapes = gpt_param_shapes(cfg);
    let known: std::collections::HashSet<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    if let Some((n, _)) = params.iter().find(|(n, _)| !known.contains(n.as_str())) {
        return Err(tensor_err(
            n,
            format!(
                "not a parameter of the {}-layer model (d_model {})",
                cfg.n_layers, cfg.d_model
            ),
        ));
    }
    let mut out = Vec::with_capacity(shapes.len());
    for (name, shape) in &shapes {
        let t = by_name
            .get(name.as_str())
            .ok_or_else(|| tensor_err(name, "missing"))?;
        let numel: usize = shape.iter().product();
        if t.numel() != numel {
            return Err(tensor_err(
                name,
                format!("shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        let data = to_f32(name, t)?;
        let (hf_shape, hf_data) = if is_linear_weight(name) {
            let (rows, cols) = (shape[0], shape[1]);
            (vec![cols, rows], transpose(&data, rows, cols))
        } else {
            (shape.clone(), data)
        };
        let td = TensorData::from_slice(&hf_shape, &hf_data)
            .map_err(|e| tensor_err(name, e.to_string()))?;
        out.push((hf_name(name), td));
    }
    Ok(out)
}

/// GPT-2's causal-mask buffers, which are not parameters.
fn is_mask_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

/// Turns GPT-2's tensors into kiln's whole parameters of `cfg` (f32, `[out, in]` linear
/// weights, in [`gpt_param_shapes`] order). Names may carry the `transformer.` prefix or not;
/// the mask buffers are ignored; `lm_head.weight` must equal the token embedding. A missing,
/// unknown or misshapen tensor is an error naming it.
pub fn from_hf(
    cfg: &GptConfig,
    tensors: &[(String, TensorData)],
) -> Result<Vec<(String, TensorData)>> {
    gpt2_layout(cfg)?;
    let mut by_name: HashMap<String, &TensorData> = HashMap::new();
    let mut lm_head = None;
    for (n, t) in tensors {
        let stem = n.strip_prefix("transformer.").unwrap_or(n);
        if is_mask_buffer(stem) {
            continue;
        }
        if stem == "lm_head.weight" {
            lm_head = Some((n, t));
            continue;
        }
        let kiln = match stem {
            "wte.weight" => "wte".to_string(),
            "wpe.weight" => "wpe".to_string(),
            other => other.to_string(),
        };
        if by_name.insert(kiln, t).is_some() {
            return Err(tensor_err(
                n,
                "given twice (with and without the transformer. prefix)",
            ));
        }
    }
    let shapes = gpt_param_shapes(cfg);
    let known: std::collections::HashSet<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    let mut unknown: Vec<String> = by_name
        .keys()
        .filter(|n| !known.contains(n.as_str()))
        .map(|n| hf_name(n))
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        return Err(tensor_err(
            &unknown.join(", "),
            format!(
                "not a tensor of GPT-2 with {} layers (config.json's n_layer)",
                cfg.n_layers
            ),
        ));
    }
    let mut out = Vec::with_capacity(shapes.len());
    for (name, shape) in &shapes {
        let t = by_name
            .get(name.as_str())
            .ok_or_else(|| tensor_err(&hf_name(name), "missing"))?;
        let linear = is_linear_weight(name);
        let want: Vec<usize> = if linear {
            vec![shape[1], shape[0]]
        } else {
            shape.clone()
        };
        if t.shape() != want.as_slice() {
            return Err(tensor_err(
                &hf_name(name),
                format!("shape {:?}, expected {want:?} from config.json", t.shape()),
            ));
        }
        let data = to_f32(&hf_name(name), t)?;
        let data = if linear {
            transpose(&data, want[0], want[1])
        } else {
            data
        };
        let td =
            TensorData::from_slice(shape, &data).map_err(|e| tensor_err(name, e.to_string()))?;
        out.push((name.clone(), td));
    }
    if let Some((n, head)) = lm_head {
        let wte = by_name
            .get("wte")
            .ok_or_else(|| tensor_err("transformer.wte.weight", "missing"))?;
        if head.shape() != wte.shape() || to_f32(n, head)? != to_f32(n, wte)? {
            return Err(tensor_err(
                n,
                "differs from the token embedding, but kiln's LM head is tied to it",
            ));
        }
    }
    Ok(out)
}

pub(crate) fn file_err(file: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::HfFile {
        file: file.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads the `safetensors` file at `path` as named tensors (F32, F16, BF16, F64, I64, U32 and
/// U8 tensors; others are an error naming the tensor).
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, TensorData)>> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| file_err(path, format!("not a safetensors file: {e}")))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        use safetensors::Dtype as S;
        let dtype = match view.dtype() {
            S::F32 => DType::F32,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::F64 => DType::F64,
            S::I64 => DType::I64,
            S::U32 => DType::U32,
            S::U8 | S::BOOL => DType::U8,
            other => {
                return Err(file_err(
                    path,
                    format!("tensor {name} has dtype {other:?}, which kiln does not read"),
                ))
            }
        };
        let t = TensorData::new(dtype, view.shape().to_vec(), view.data().to_vec())
            .map_err(|e| file_err(path, format!("tensor {name}: {e}")))?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Writes named tensors as a `safetensors` file with metadata `{"format": "pt"}` (what
/// `transformers` expects), through a temporary file renamed into place.
pub fn write_safetensors(path: &Path, tensors: &[(String, TensorData)]) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        use safetensors::Dtype as S;
        let dtype = match t.dtype() {
            DType::F32 => S::F32,
            DType::F16 => S::F16,
            DType::BF16 => S::BF16,
            DType::F64 => S::F64,
            DType::I64 => S::I64,
            DType::U32 => S::U32,
            DType::U8 => S::U8,
        };
        let view = safetensors::tensor::TensorView::new(dtype, t.shape().to_vec(), t.bytes())
            .map_err(|e| file_err(path, format!("tensor {name}: {e}")))?;
        views.push((name.clone(), view));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(meta))
        .map_err(|e| file_err(path, format!("cannot encode: {e}")))?;
    write_atomic(path, &bytes)
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| file_err(&tmp, e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| file_err(path, e.to_string()))
}

/// A Hugging Face GPT-2 or Llama folder read into kiln's terms.
#[derive(Debug, Clone)]
pub struct HfModel {
    /// kiln's configuration, from `config.json`.
    pub config: GptConfig,
    /// `config.json` as read.
    pub hf_config: serde_json::Value,
    /// kiln's whole parameters ([`gpt_param_shapes`] names and order), f32.
    pub params: Vec<(String, TensorData)>,
    /// The folder's `tokenizer.json`, when it has one.
    pub tokenizer: Option<PathBuf>,
}

/// Reads GPT-2's `config.json` in `dir`.
pub fn read_hf_config(dir: &Path) -> Result<Gpt2Config> {
    let path = dir.join(HF_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| file_err(&path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| file_err(&path, format!("not GPT-2's config: {e}")))
}

/// kiln's configuration of the model a Hugging Face folder's `config.json` describes: GPT-2's,
/// or Llama's where its `model_type` is `"llama"`; a setting kiln does not compute is an error
/// naming the field.
pub fn read_model_config(dir: &Path) -> Result<GptConfig> {
    let path = dir.join(HF_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| file_err(&path, e.to_string()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| file_err(&path, format!("not JSON: {e}")))?;
    let cfg = if value.get("model_type").and_then(|t| t.as_str()) == Some("llama") {
        llama::read_llama_config(dir)?.to_gpt()
    } else {
        read_hf_config(dir)?.to_gpt()
    };
    cfg.map_err(|e| file_err(&path, e.to_string()))
}

/// Reads a Hugging Face folder: GPT-2's (`config.json`, `model.safetensors`) or, where
/// `config.json`'s `model_type` is `"llama"`, `LlamaForCausalLM`'s (the weights whole or
/// sharded with an index, [`llama::read_weights`]); optionally `tokenizer.json`. The
/// configuration is checked against what kiln computes and every tensor mapped to kiln's
/// layout. Errors name the file and, for tensors, the tensor.
pub fn load_hf_dir(dir: &Path) -> Result<HfModel> {
    if !dir.is_dir() {
        return Err(file_err(dir, "no such folder"));
    }
    let config_path = dir.join(HF_CONFIG_FILE);
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| file_err(&config_path, e.to_string()))?;
    let hf_config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| file_err(&config_path, format!("not JSON: {e}")))?;
    let tok = dir.join(HF_TOKENIZER_FILE);
    let tokenizer = tok.is_file().then_some(tok);
    if hf_config.get("model_type").and_then(|t| t.as_str()) == Some("llama") {
        let config = llama::read_llama_config(dir)?
            .to_gpt()
            .map_err(|e| file_err(&config_path, e.to_string()))?;
        let tensors = llama::read_weights(dir)?;
        let params =
            llama::from_llama(&config, &tensors).map_err(|e| file_err(dir, e.to_string()))?;
        return Ok(HfModel {
            config,
            hf_config,
            params,
            tokenizer,
        });
    }
    let config = read_hf_config(dir)?
        .to_gpt()
        .map_err(|e| file_err(&config_path, e.to_string()))?;
    let weights = dir.join(HF_WEIGHTS_FILE);
    let tensors = read_safetensors(&weights)?;
    let params = from_hf(&config, &tensors).map_err(|e| file_err(&weights, e.to_string()))?;
    Ok(HfModel {
        config,
        hf_config,
        params,
        tokenizer,
    })
}

/// Writes kiln's whole parameters of `cfg` (see [`to_hf`]) as a Hugging Face GPT-2 folder:
/// `model.safetensors` (f32, `transformer.`-prefixed names, no `lm_head.weight`: it is tied),
/// `config.json`, and `tokenizer.json` copied from `tokenizer` when given. `eot` is the
/// tokenizer's end-of-text token. Creates `dir`; returns the files written. A model in the
/// Llama layout is written as a `LlamaForCausalLM` folder instead
/// ([`llama::save_llama_dir`], shards above 5 GB).
pub fn save_hf_dir(
    dir: &Path,
    cfg: &GptConfig,
    params: &[(String, TensorData)],
    tokenizer: Option<&Path>,
    eot: Option<u32>,
) -> Result<Vec<PathBuf>> {
    if llama::llama_layout(cfg).is_ok() {
        let max = llama::DEFAULT_MAX_SHARD_BYTES;
        return llama::save_llama_dir(dir, cfg, params, tokenizer, eot, max);
    }
    let tensors = to_hf(cfg, params)?;
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e.to_string()))?;
    let weights = dir.join(HF_WEIGHTS_FILE);
    write_safetensors(&weights, &tensors)?;
    let config = dir.join(HF_CONFIG_FILE);
    let json = serde_json::to_string_pretty(&Gpt2Config::from_gpt(cfg, eot))
        .map_err(|e| file_err(&config, e.to_string()))?;
    write_atomic(&config, json.as_bytes())?;
    let mut files = vec![weights, config];
    if let Some(src) = tokenizer {
        let dst = dir.join(HF_TOKENIZER_FILE);
        let bytes = std::fs::read(src).map_err(|e| file_err(src, e.to_string()))?;
        write_atomic(&dst, &bytes)?;
        files.push(dst);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(cfg: &GptConfig) -> Vec<(String, TensorData)> {
        let mut k = 0.0f32;
        gpt_param_shapes(cfg)
            .into_iter()
            .map(|(n, s)| {
                let numel: usize = s.iter().product();
                let v: Vec<f32> = (0..numel)
                    .map(|_| {
                        k += 1.0;
                        k * 1e-3
                    })
                    .collect();
                let t = TensorData::from_slice(&s, &v)
                    .unwrap_or_else(|_| TensorData::from_vec1(&[0f32]));
                (n, t)
            })
            .collect()
    }

    #[test]
    fn round_trip_is_exact_and_transposes_linears() -> Result<()> {
        let cfg = GptConfig::new(16, 8, 8, 2, 2);
        let p = params(&cfg);
        let hf = to_hf(&cfg, &p)?;
        let names: Vec<&str> = hf.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"transformer.h.1.attn.c_attn.weight"));
        let (_, qkv) = &hf[names
            .iter()
            .position(|n| *n == "transformer.h.0.attn.c_attn.weight")
            .ok_or_else(|| tensor_err("qkv", "absent"))?];
        assert_eq!(qkv.shape(), [8, 24]);
        let back = from_hf(&cfg, &hf)?;
        assert_eq!(back, p);
        Ok(())
    }

    /// The error's text, or "" when `r` is not an error.
    fn err_of<T>(r: Result<T>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn the_llama_layout_is_not_written_as_gpt2() {
        let cfg = GptConfig::llama_tiny();
        let e = err_of(to_hf(&cfg, &params(&cfg)));
        assert!(
            e.contains("GPT-2") && e.contains("Llama architecture"),
            "{e}"
        );
        let gpt = GptConfig::new(16, 8, 8, 2, 2);
        let e = err_of(from_hf(
            &cfg,
            &to_hf(&gpt, &params(&gpt)).unwrap_or_default(),
        ));
        assert!(
            e.contains("GPT-2") && e.contains("Llama architecture"),
            "{e}"
        );
    }

    #[test]
    fn bad_tensors_are_named() -> Result<()> {
        let cfg = GptConfig::new(16, 8, 8, 2, 2);
        let mut hf = to_hf(&cfg, &params(&cfg))?;
        hf.retain(|(n, _)| n != "transformer.h.1.mlp.c_fc.bias");
        let err = err_of(from_hf(&cfg, &hf));
        assert!(
            err.contains("transformer.h.1.mlp.c_fc.bias") && err.contains("missing"),
            "{err}"
        );
        let mut extra = to_hf(&cfg, &params(&cfg))?;
        extra.push((
            "transformer.h.7.ln_1.weight".into(),
            TensorData::from_vec1(&[1f32]),
        ));
        let err = err_of(from_hf(&cfg, &extra));
        assert!(err.contains("transformer.h.7.ln_1.weight"), "{err}");
        let other = GptConfig::new(16, 8, 16, 2, 2);
        let err = err_of(from_hf(&other, &to_hf(&cfg, &params(&cfg))?));
        assert!(
            err.contains("transformer.wte.weight") && err.contains("[16, 16]"),
            "{err}"
        );
        // GPT-2's own upload: no prefix, mask buffers, a tied lm_head
        let mut bare: Vec<(String, TensorData)> = to_hf(&cfg, &params(&cfg))?
            .into_iter()
            .map(|(n, t)| (n.trim_start_matches("transformer.").to_string(), t))
            .collect();
        let wte = bare[0].1.clone();
        bare.push(("h.0.attn.bias".into(), TensorData::from_vec1(&[1f32])));
        bare.push(("lm_head.weight".into(), wte));
        assert_eq!(from_hf(&cfg, &bare)?, params(&cfg));
        let last = bare.len() - 1;
        bare[last].1 = bare[1].1.clone();
        let err = err_of(from_hf(&cfg, &bare));
        assert!(err.contains("lm_head.weight"), "{err}");
        Ok(())
    }

    #[test]
    fn config_round_trip_and_refusals() -> Result<()> {
        let cfg = GptConfig::small_cpu();
        let hf = Gpt2Config::from_gpt(&cfg, Some(3));
        let json = serde_json::to_string(&hf).map_err(|e| tensor_err("json", e.to_string()))?;
        let back: Gpt2Config =
            serde_json::from_str(&json).map_err(|e| tensor_err("json", e.to_string()))?;
        assert_eq!(back.to_gpt()?, {
            let mut c = cfg.clone();
            c.scaled_residual_init = true;
            c
        });
        let mut erf = back.clone();
        erf.activation_function = "gelu".into();
        let err = err_of(erf.to_gpt());
        assert!(
            err.contains("activation_function") && err.contains("gelu"),
            "{err}"
        );
        Ok(())
    }
}
