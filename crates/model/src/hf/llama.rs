//! Hugging Face's `LlamaForCausalLM` layout: kiln's Llama-layout [`Gpt`](crate::Gpt)
//! parameters to and from the folder `transformers`, vLLM and llama.cpp's converter read.
//!
//! | kiln | Llama |
//! |---|---|
//! | `wte` | `model.embed_tokens.weight` |
//! | `h.{i}.ln_1.weight`, `h.{i}.ln_2.weight` | `model.layers.{i}.input_layernorm.weight`, `post_attention_layernorm.weight` |
//! | `h.{i}.attn.q_proj`, `k_proj`, `v_proj` (or the rows of a fused `c_attn`) | `model.layers.{i}.self_attn.q_proj.weight`, ... |
//! | `h.{i}.attn.c_proj` | `self_attn.o_proj.weight` |
//! | `h.{i}.mlp.c_fc` `[2f, d]`: rows `..f` and `f..` | `mlp.gate_proj.weight`, `mlp.up_proj.weight` |
//! | `h.{i}.mlp.c_proj` | `mlp.down_proj.weight` |
//! | `ln_f.weight` | `model.norm.weight` |
//! | `lm_head` | `lm_head.weight` (absent when tied) |
//!
//! Both store linear weights `[out, in]`, so nothing is transposed. kiln's rotary embedding
//! pairs element `j` with `j + head_dim / 2` (Hugging Face's `rotate_half`), the pairing the
//! `q_proj` and `k_proj` rows of a Hugging Face folder are laid out for, so they are copied
//! as they are (Meta's original checkpoints pair `2j` with `2j + 1`; their rows are permuted
//! by `transformers`' conversion script, not here).
//!
//! Weights above [`DEFAULT_MAX_SHARD_BYTES`] are written as numbered shards with
//! `model.safetensors.index.json`, as `save_pretrained` does; either form is read.

use super::{file_err, read_safetensors, tensor_err, to_f32, write_atomic, write_safetensors};
use super::{HF_CONFIG_FILE, HF_TOKENIZER_FILE, HF_WEIGHTS_FILE};
use crate::config::GptConfig;
use crate::error::{ModelError, Result};
use crate::ops::Llama3Scaling;
use kiln_state::TensorData;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The index of a sharded weights folder.
pub const HF_INDEX_FILE: &str = "model.safetensors.index.json";
/// The generation defaults of a Hugging Face model folder.
pub const HF_GENERATION_FILE: &str = "generation_config.json";
/// Shards are cut above this many bytes (`save_pretrained`'s default `max_shard_size`, 5 GB).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Llama's `config.json`, the fields `transformers.LlamaConfig` reads that shape the model.
/// Unknown fields are kept in [`LlamaConfig::extra`] and written back unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `["LlamaForCausalLM"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `"llama"`.
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// The SwiGLU MLP's hidden width.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (`None`: as many as query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The context the rotary tables cover.
    pub max_position_embeddings: usize,
    /// RMSNorm's epsilon.
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// The rotary base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Rotary scaling: `null`, or Llama 3's (`rope_type: "llama3"`); others are refused.
    #[serde(default)]
    pub rope_scaling: serde_json::Value,
    /// The MLP's activation: kiln computes `silu`.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Biases on the attention projections (kiln's Llama layout: none).
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections (none).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Whether the LM head is the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// A head width other than `hidden_size / num_attention_heads` (kiln: that one only).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Standard deviation of the initialisation.
    #[serde(default = "super::default_init_range")]
    pub initializer_range: f64,
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

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_act() -> String {
    "silu".into()
}

/// `cfg` has the Llama layout (RMSNorm, rotary positions, SwiGLU, no biases), or an error
/// naming its architecture.
pub fn llama_layout(cfg: &GptConfig) -> Result<()> {
    let ok = cfg.is_llama_layout();
    if ok {
        return Ok(());
    }
    Err(ModelError::Config {
        field: "architecture",
        reason: format!(
            "Hugging Face's LlamaForCausalLM layout cannot hold the {}",
            cfg.describe()
        ),
    })
}

fn hf_err(field: &'static str, got: impl std::fmt::Display, expected: &'static str) -> ModelError {
    ModelError::HfConfig {
        field,
        got: got.to_string(),
        expected,
    }
}

impl LlamaConfig {
    /// Llama's configuration of a kiln model in the Llama layout; `eot` is the tokenizer's
    /// end-of-text token (written as `bos_token_id` and `eos_token_id`).
    pub fn from_gpt(cfg: &GptConfig, eot: Option<u32>) -> Result<Self> {
        llama_layout(cfg)?;
        let rope_scaling = match cfg.rope_scaling {
            None => serde_json::Value::Null,
            Some(s) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        };
        Ok(Self {
            architectures: vec!["LlamaForCausalLM".into()],
            model_type: "llama".into(),
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.d_model,
            intermediate_size: cfg.d_ff(),
            num_hidden_layers: cfg.n_layers,
            num_attention_heads: cfg.n_heads,
            num_key_value_heads: Some(cfg.kv_heads()),
            max_position_embeddings: cfg.n_ctx,
            rms_norm_eps: cfg.layer_norm_eps,
            rope_theta: cfg.rope_theta,
            rope_scaling,
            hidden_act: "silu".into(),
            attention_bias: false,
            mlp_bias: false,
            tie_word_embeddings: cfg.tied_embeddings,
            head_dim: Some(cfg.head_dim()),
            initializer_range: cfg.embedding_std,
            bos_token_id: eot,
            eos_token_id: eot,
            torch_dtype: Some("float32".into()),
            extra: BTreeMap::new(),
        })
    }

    /// kiln's configuration of this model; a setting kiln does not compute is an error naming
    /// the field (an activation other than SiLU, biases, a head width other than `hidden_size
    /// / num_attention_heads`, a rotary scaling other than Llama 3's).
    pub fn to_gpt(&self) -> Result<GptConfig> {
        if self.model_type != "llama" {
            return Err(hf_err("model_type", &self.model_type, "\"llama\""));
        }
        if self.hidden_act != "silu" {
            return Err(hf_err("hidden_act", &self.hidden_act, "\"silu\""));
        }
        if self.attention_bias {
            return Err(hf_err("attention_bias", true, "false"));
        }
        if self.mlp_bias {
            return Err(hf_err("mlp_bias", true, "false"));
        }
        let heads = self.num_attention_heads.max(1);
        if let Some(hd) = self.head_dim {
            if hd * heads != self.hidden_size {
                return Err(hf_err(
                    "head_dim",
                    hd,
                    "hidden_size / num_attention_heads (kiln's heads span the width)",
                ));
            }
        }
        let (theta, scaling) = self.rope()?;
        let mut cfg = GptConfig::llama(
            self.vocab_size,
            self.max_position_embeddings,
            self.hidden_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            self.intermediate_size,
            theta,
        );
        cfg.layer_norm_eps = self.rms_norm_eps;
        cfg.rope_scaling = scaling;
        cfg.tied_embeddings = self.tie_word_embeddings;
        cfg.embedding_std = self.initializer_range;
        cfg.validate()?;
        Ok(cfg)
    }
}

impl LlamaConfig {
    /// The rotary base and scaling. `transformers` 5 writes them together as
    /// `rope_parameters` (`{"rope_type": "default" | "llama3", "rope_theta", ...}`) with no
    /// top-level `rope_theta` or `rope_scaling`; earlier versions (and what kiln writes, which
    /// every version reads) keep `rope_theta` and `rope_scaling` apart. `rope_parameters`
    /// wins where both are present.
    fn rope(&self) -> Result<(f64, Option<Llama3Scaling>)> {
        let Some(params) = self.extra.get("rope_parameters").filter(|v| !v.is_null()) else {
            return Ok((self.rope_theta, Llama3Scaling::from_hf(&self.rope_scaling)?));
        };
        let theta = match params.get("rope_theta") {
            None => self.rope_theta,
            Some(v) => v
                .as_f64()
                .ok_or_else(|| hf_err("rope_parameters.rope_theta", v, "a number"))?,
        };
        Ok((theta, Llama3Scaling::from_hf(params)?))
    }
}

/// Where a Hugging Face tensor comes from in kiln: a whole parameter, or rows `start..start +
/// len` of one (a fused projection's part).
struct Source {
    kiln: String,
    rows: Option<(usize, usize)>,
}

/// Every tensor of the Hugging Face folder of `cfg`, in `save_pretrained`'s order, with its
/// shape and where it comes from in kiln.
fn tensor_map(cfg: &GptConfig) -> Vec<(String, Vec<usize>, Source)> {
    let (d, f) = (cfg.d_model, cfg.d_ff());
    let (q, kv) = (
        cfg.n_heads * cfg.head_dim(),
        cfg.kv_heads() * cfg.head_dim(),
    );
    let whole = |k: String| Source {
        kiln: k,
        rows: None,
    };
    let part = |k: String, start, len| Source {
        kiln: k,
        rows: Some((start, len)),
    };
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, d],
        whole("wte".into()),
    )];
    for i in 0..cfg.n_layers {
        let hf = |s: &str| format!("model.layers.{i}.{s}.weight");
        let k = |s: &str| format!("h.{i}.{s}.weight");
        out.push((hf("input_layernorm"), vec![d], whole(k("ln_1"))));
        if cfg.grouped_query() {
            out.push((hf("self_attn.q_proj"), vec![q, d], whole(k("attn.q_proj"))));
            out.push((hf("self_attn.k_proj"), vec![kv, d], whole(k("attn.k_proj"))));
            out.push((hf("self_attn.v_proj"), vec![kv, d], whole(k("attn.v_proj"))));
        } else {
            for (j, name) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                let src = part(k("attn.c_attn"), j * q, q);
                out.push((hf(&format!("self_attn.{name}")), vec![q, d], src));
            }
        }
        out.push((hf("self_attn.o_proj"), vec![d, q], whole(k("attn.c_proj"))));
        out.push((hf("post_attention_layernorm"), vec![d], whole(k("ln_2"))));
        out.push((hf("mlp.gate_proj"), vec![f, d], part(k("mlp.c_fc"), 0, f)));
        out.push((hf("mlp.up_proj"), vec![f, d], part(k("mlp.c_fc"), f, f)));
        out.push((hf("mlp.down_proj"), vec![d, f], whole(k("mlp.c_proj"))));
    }
    out.push((
        "model.norm.weight".into(),
        vec![d],
        whole("ln_f.weight".into()),
    ));
    if !cfg.tied_embeddings {
        out.push((
            "lm_head.weight".into(),
            vec![cfg.vocab_size, d],
            whole("lm_head".into()),
        ));
    }
    out
}

/// Turns kiln's whole parameters of `cfg` (as [`super::gpt_param_shapes`] names them; fused
/// ones also in a checkpoint's `[parts, rows, in]` form) into Llama's tensors, f32, in
/// `save_pretrained`'s order. A missing, unknown or misshapen parameter is an error naming it.
pub fn to_llama(
    cfg: &GptConfig,
    params: &[(String, TensorData)],
) -> Result<Vec<(String, TensorData)>> {
    llama_layout(cfg)?;
    let shapes: HashMap<String, Vec<usize>> = super::gpt_param_shapes(cfg).into_iter().collect();
    let mut given: HashMap<&str, Vec<f32>> = HashMap::new();
    for (n, t) in params {
        let shape = shapes
            .get(n)
            .ok_or_else(|| tensor_err(n, format!("not a parameter of this {}", cfg.describe())))?;
        if t.numel() != shape.iter().product::<usize>() {
            return Err(tensor_err(
                n,
                format!("shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        if given.insert(n, to_f32(n, t)?).is_some() {
            return Err(tensor_err(n, "given twice"));
        }
    }
    let mut out = Vec::new();
    for (hf, shape, src) in tensor_map(cfg) {
        let data = given
            .get(src.kiln.as_str())
            .ok_or_else(|| tensor_err(&src.kiln, "missing"))?;
        let values = match src.rows {
            None => data.clone(),
            Some((start, len)) => {
                let cols = shape[1];
                data[start * cols..(start + len) * cols].to_vec()
            }
        };
        let td =
            TensorData::from_slice(&shape, &values).map_err(|e| tensor_err(&hf, e.to_string()))?;
        out.push((hf, td));
    }
    Ok(out)
}

/// Turns Llama's tensors into kiln's whole parameters of `cfg` (f32, in
/// [`super::gpt_param_shapes`] order). A missing, unknown or misshapen tensor is an error
/// naming it; rotary inverse-frequency buffers (`rotary_emb.inv_freq`) are ignored, and a tied
/// model's `lm_head.weight` is accepted when it equals the token embedding.
pub fn from_llama(
    cfg: &GptConfig,
    tensors: &[(String, TensorData)],
) -> Result<Vec<(String, TensorData)>> {
    llama_layout(cfg)?;
    let map = tensor_map(cfg);
    let expected: HashMap<&str, &Vec<usize>> =
        map.iter().map(|(n, s, _)| (n.as_str(), s)).collect();
    let mut given: HashMap<&str, Vec<f32>> = HashMap::new();
    let mut tied_head = None;
    for (n, t) in tensors {
        if n.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        if n == "lm_head.weight" && cfg.tied_embeddings {
            tied_head = Some((n, t));
            continue;
        }
        let shape = expected
            .get(n.as_str())
            .ok_or_else(|| tensor_err(n, format!("not a tensor of this {}", cfg.describe())))?;
        if t.shape() != shape.as_slice() {
            return Err(tensor_err(
                n,
                format!("shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        if given.insert(n, to_f32(n, t)?).is_some() {
            return Err(tensor_err(n, "given twice"));
        }
    }
    // kiln's parameters, assembled from their parts in the map's order
    let mut assembled: HashMap<&str, Vec<f32>> = HashMap::new();
    for (hf, _, src) in &map {
        let data = given
            .remove(hf.as_str())
            .ok_or_else(|| tensor_err(hf, "missing"))?;
        assembled.entry(src.kiln.as_str()).or_default().extend(data);
    }
    if let Some((n, t)) = tied_head {
        let wte = assembled.get("wte").map(Vec::as_slice).unwrap_or_default();
        if to_f32(n, t)? != wte {
            return Err(tensor_err(
                n,
                "differs from the token embedding, but tie_word_embeddings is true",
            ));
        }
    }
    let mut out = Vec::new();
    for (name, shape) in super::gpt_param_shapes(cfg) {
        let values = assembled
            .remove(name.as_str())
            .ok_or_else(|| tensor_err(&name, "missing"))?;
        let td = TensorData::from_slice(&shape, &values)
            .map_err(|e| tensor_err(&name, e.to_string()))?;
        out.push((name, td));
    }
    Ok(out)
}

/// Writes kiln's whole parameters of a Llama-layout `cfg` as a `LlamaForCausalLM` folder:
/// `config.json`, `generation_config.json`, the weights (f32; one `model.safetensors`, or
/// shards of at most `max_shard_bytes` each, in order, with `model.safetensors.index.json`)
/// and `tokenizer.json` copied from `tokenizer` when given. Returns the files written.
pub fn save_llama_dir(
    dir: &Path,
    cfg: &GptConfig,
    params: &[(String, TensorData)],
    tokenizer: Option<&Path>,
    eot: Option<u32>,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let hf_cfg = LlamaConfig::from_gpt(cfg, eot)?;
    let tensors = to_llama(cfg, params)?;
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e.to_string()))?;
    // shards in order, each closed before it would pass the limit
    let mut shards: Vec<Vec<(String, TensorData)>> = vec![Vec::new()];
    let mut size = 0u64;
    let mut total = 0u64;
    for (n, t) in tensors {
        let bytes = t.bytes().len() as u64;
        total += bytes;
        if size > 0 && size + bytes > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(last) = shards.last_mut() {
            last.push((n, t));
        }
    }
    let mut files = Vec::new();
    if shards.len() == 1 {
        let path = dir.join(HF_WEIGHTS_FILE);
        write_safetensors(&path, &shards[0])?;
        files.push(path);
    } else {
        let n = shards.len();
        let mut weight_map = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            for (name, _) in shard {
                weight_map.insert(name.clone(), file.clone());
            }
            let path = dir.join(&file);
            write_safetensors(&path, shard)?;
            files.push(path);
        }
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = dir.join(HF_INDEX_FILE);
        write_json(&path, &index)?;
        files.push(path);
    }
    let path = dir.join(HF_CONFIG_FILE);
    write_json(&path, &hf_cfg)?;
    files.push(path);
    let generation = serde_json::json!({
        "_from_model_config": true,
        "bos_token_id": eot,
        "eos_token_id": eot,
    });
    let path = dir.join(HF_GENERATION_FILE);
    write_json(&path, &generation)?;
    files.push(path);
    if let Some(src) = tokenizer {
        let dst = dir.join(HF_TOKENIZER_FILE);
        let bytes = std::fs::read(src).map_err(|e| file_err(src, e.to_string()))?;
        write_atomic(&dst, &bytes)?;
        files.push(dst);
    }
    Ok(files)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let json = serde_json::to_string_pretty(value).map_err(|e| file_err(path, e.to_string()))?;
    write_atomic(path, json.as_bytes())
}

/// Reads the weights of a Hugging Face folder: `model.safetensors`, or the shards
/// `model.safetensors.index.json` lists (each tensor from the shard the index names; a shard
/// that lacks one is an error naming both).
pub fn read_weights(dir: &Path) -> Result<Vec<(String, TensorData)>> {
    let index = dir.join(HF_INDEX_FILE);
    if !index.is_file() {
        return read_safetensors(&dir.join(HF_WEIGHTS_FILE));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| file_err(&index, e.to_string()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| file_err(&index, e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| file_err(&index, "no weight_map object"))?;
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| file_err(&index, format!("tensor {name}: the file is not a string")))?;
        by_file
            .entry(file.to_string())
            .or_default()
            .push(name.clone());
    }
    let mut out = Vec::new();
    for (file, names) in by_file {
        let path = dir.join(&file);
        let tensors: HashMap<String, TensorData> = read_safetensors(&path)?.into_iter().collect();
        for name in names {
            let t = tensors.get(&name).ok_or_else(|| {
                file_err(
                    &path,
                    format!("tensor {name}, which the index puts here, is absent"),
                )
            })?;
            out.push((name, t.clone()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Reads Llama's `config.json` in `dir`.
pub fn read_llama_config(dir: &Path) -> Result<LlamaConfig> {
    let path = dir.join(HF_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| file_err(&path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| file_err(&path, format!("not Llama's config: {e}")))
}
