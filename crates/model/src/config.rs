//! [`GptConfig`]: the architecture of a decoder (the GPT-3 family and the Llama family), its
//! presets, parameter count and FLOPs.

use crate::error::{ModelError, Result};
use crate::ops::Llama3Scaling;
use serde::{Deserialize, Serialize};

/// The normalisation of every block and of the final hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// LayerNorm with a gain and a shift (GPT).
    #[default]
    LayerNorm,
    /// RMSNorm with a gain only (Llama).
    RmsNorm,
}

/// How positions enter the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionKind {
    /// A learned embedding of `n_ctx` positions added to the token embedding (GPT).
    #[default]
    Learned,
    /// Rotary embeddings of the queries and keys ([`crate::ops::rotary`], Hugging Face's
    /// `rotate_half` pairing), with [`GptConfig::rope_theta`] and
    /// [`GptConfig::rope_scaling`] (Llama).
    Rotary,
}

/// The MLP of every block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// `fc2(gelu(fc1(x)))` (GPT; tanh-approximated GELU).
    #[default]
    Gelu,
    /// `down(silu(gate(x)) * up(x))` (Llama), gate and up one fused product.
    #[serde(rename = "swiglu")]
    SwiGlu,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// The architecture of a pre-norm decoder. The defaults are GPT-3's: LayerNorm, learned
/// positions, causal multi-head attention, a 4x GELU MLP, biases, and an LM head tied to the
/// token embedding. The Llama family sets [`NormKind::RmsNorm`], [`PositionKind::Rotary`],
/// [`MlpKind::SwiGlu`] with its own hidden size, fewer key/value heads than query heads
/// (grouped-query attention), no biases and an untied head ([`GptConfig::llama3_8b`]).
///
/// The fields beyond the GPT sizes are left out of the JSON when they hold GPT's values, so a
/// GPT config serialises (and hashes) as it always has.
///
/// All sizes are validated by [`GptConfig::validate`] (the model calls it at construction).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Vocabulary size (rows of the token embedding, columns of the logits).
    pub vocab_size: usize,
    /// Context length: the number of learned positions.
    pub n_ctx: usize,
    /// Model width.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Attention heads per block; must divide `d_model`.
    pub n_heads: usize,
    /// Epsilon of every norm (LayerNorm or RMSNorm).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Scale the initialisation of the residual output projections (`attn.c_proj`,
    /// `mlp.c_proj`) by `1/sqrt(2 * n_layers)`, as GPT-2 and GPT-3 do.
    #[serde(default = "default_true")]
    pub scaled_residual_init: bool,
    /// Standard deviation of the normal initialisation of the token and position embeddings.
    #[serde(default = "default_embedding_std")]
    pub embedding_std: f64,
    /// LayerNorm or RMSNorm.
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm: NormKind,
    /// Learned or rotary positions.
    #[serde(default, skip_serializing_if = "is_default")]
    pub positions: PositionKind,
    /// The base of the rotary frequencies (10000 in Llama 2, 500000 in Llama 3); read with
    /// [`PositionKind::Rotary`] only.
    #[serde(
        default = "default_rope_theta",
        skip_serializing_if = "is_default_theta"
    )]
    pub rope_theta: f64,
    /// Llama 3.1's scaling of the rotary frequencies for a longer context; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Llama3Scaling>,
    /// GELU or SwiGLU.
    #[serde(default, skip_serializing_if = "is_default")]
    pub mlp: MlpKind,
    /// The MLP's hidden width (Hugging Face's `intermediate_size`); none: `4 * d_model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_hidden_size: Option<usize>,
    /// Key/value heads (Hugging Face's `num_key_value_heads`): none or `n_heads` is
    /// multi-head attention, fewer is grouped-query attention, 1 multi-query; must divide
    /// `n_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Biases on every linear layer and a shift on every LayerNorm's output; false for Llama
    /// (whose RMSNorm has no shift in any case).
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub bias: bool,
    /// The LM head is the token embedding (true, GPT) or a matrix of its own (`lm_head`,
    /// Llama).
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub tied_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    10_000.0
}
fn is_default_theta(v: &f64) -> bool {
    *v == default_rope_theta()
}
fn is_true(v: &bool) -> bool {
    *v
}

fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}
fn default_embedding_std() -> f64 {
    0.02
}

/// The names [`GptConfig::by_name`] knows, in the order printed by its error.
pub const PRESET_NAMES: &[&str] = &[
    "tiny",
    "small_cpu",
    "gpt3_small",
    "gpt3_medium",
    "gpt3_large",
    "gpt3_xl",
    "gpt3_2_7b",
    "gpt3_6_7b",
    "gpt3_175b",
    "llama_tiny",
    "llama_cpu",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
];

impl GptConfig {
    /// A config with the given sizes and the defaults for the rest (eps 1e-5, scaled residual
    /// init, embedding std 0.02). Not validated: call [`GptConfig::validate`].
    pub fn new(
        vocab_size: usize,
        n_ctx: usize,
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
    ) -> Self {
        Self {
            vocab_size,
            n_ctx,
            d_model,
            n_layers,
            n_heads,
            layer_norm_eps: default_eps(),
            scaled_residual_init: true,
            embedding_std: default_embedding_std(),
            norm: NormKind::LayerNorm,
            positions: PositionKind::Learned,
            rope_theta: default_rope_theta(),
            rope_scaling: None,
            mlp: MlpKind::Gelu,
            ffn_hidden_size: None,
            n_kv_heads: None,
            bias: true,
            tied_embeddings: true,
        }
    }

    /// The Llama layout at the given sizes: RMSNorm (eps 1e-5), rotary positions (theta
    /// `rope_theta`), a SwiGLU MLP of `ffn` hidden units, `n_kv_heads` key/value heads, no
    /// biases, an untied LM head. Initialised as kiln's GPT (Xavier-uniform matrices, the
    /// residual projections scaled, `N(0, 0.02)` embeddings and head), not Hugging Face's
    /// `N(0, 0.02)` for every matrix. Not validated: call [`GptConfig::validate`].
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        vocab_size: usize,
        n_ctx: usize,
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
        n_kv_heads: usize,
        ffn: usize,
        rope_theta: f64,
    ) -> Self {
        Self {
            norm: NormKind::RmsNorm,
            positions: PositionKind::Rotary,
            rope_theta,
            mlp: MlpKind::SwiGlu,
            ffn_hidden_size: Some(ffn),
            n_kv_heads: Some(n_kv_heads),
            bias: false,
            tied_embeddings: false,
            ..Self::new(vocab_size, n_ctx, d_model, n_layers, n_heads)
        }
    }

    /// A Llama test model of about 0.5M parameters: vocab 512, context 64, d_model 128, 2
    /// layers, 4 query heads sharing 2 key/value heads, SwiGLU hidden 352 (Llama's
    /// `8d/3` rounded up to a multiple of 32).
    pub fn llama_tiny() -> Self {
        Self::llama(512, 64, 128, 2, 4, 2, 352, 10_000.0)
    }

    /// The Llama training model of the examples (about 7.0M parameters, 2.8M outside the
    /// embeddings): vocab 8192, context 128, d_model 256, 4 layers, 8 query heads of 32
    /// sharing 2 key/value heads, SwiGLU hidden 704, theta 10000; the Llama counterpart of
    /// [`GptConfig::small_cpu`].
    pub fn llama_cpu() -> Self {
        Self::llama(8192, 128, 256, 4, 8, 2, 704, 10_000.0)
    }

    /// Llama 3 8B as published (Meta's `params.json`, Hugging Face's `config.json`): vocab
    /// 128256, context 8192, d_model 4096, 32 layers, 32 query heads and 8 key/value heads of
    /// 128, SwiGLU hidden 14336, theta 500000. 8,030,261,248 parameters.
    pub fn llama3_8b() -> Self {
        Self::llama(128_256, 8192, 4096, 32, 32, 8, 14_336, 500_000.0)
    }

    /// Llama 3 70B: d_model 8192, 80 layers, 64 query heads and 8 key/value heads of 128,
    /// SwiGLU hidden 28672; vocab, context and theta as [`GptConfig::llama3_8b`].
    /// 70,553,706,496 parameters.
    pub fn llama3_70b() -> Self {
        Self::llama(128_256, 8192, 8192, 80, 64, 8, 28_672, 500_000.0)
    }

    /// Llama 3.1 405B: d_model 16384, 126 layers, 128 query heads and 8 key/value heads of
    /// 128, SwiGLU hidden 53248; vocab and theta as [`GptConfig::llama3_8b`], at the 8192
    /// positions of pre-training (the published 131072 come with Llama 3.1's rotary scaling,
    /// which [`GptConfig::rope_scaling`] sets). 405,853,388,800 parameters.
    pub fn llama3_405b() -> Self {
        Self::llama(128_256, 8192, 16_384, 126, 128, 8, 53_248, 500_000.0)
    }

    fn gpt3(n_layers: usize, d_model: usize, n_heads: usize) -> Self {
        Self::new(50257, 2048, d_model, n_layers, n_heads)
    }

    /// GPT-3 175B: 96 layers, d_model 12288, 96 heads, context 2048, vocab 50257.
    pub fn gpt3_175b() -> Self {
        Self::gpt3(96, 12288, 96)
    }

    /// GPT-3 Small (125M): 12 layers, d_model 768, 12 heads.
    pub fn gpt3_small() -> Self {
        Self::gpt3(12, 768, 12)
    }

    /// GPT-3 Medium (350M): 24 layers, d_model 1024, 16 heads.
    pub fn gpt3_medium() -> Self {
        Self::gpt3(24, 1024, 16)
    }

    /// GPT-3 Large (760M): 24 layers, d_model 1536, 16 heads.
    pub fn gpt3_large() -> Self {
        Self::gpt3(24, 1536, 16)
    }

    /// GPT-3 XL (1.3B): 24 layers, d_model 2048, 16 heads of 128.
    ///
    /// The paper's table lists 24 heads with d_head 128, which does not multiply to 2048; this
    /// preset keeps d_model and d_head and uses 16 heads, as Megatron and GPT-NeoX configs do.
    pub fn gpt3_xl() -> Self {
        Self::gpt3(24, 2048, 16)
    }

    /// GPT-3 2.7B: 32 layers, d_model 2560, 32 heads.
    pub fn gpt3_2_7b() -> Self {
        Self::gpt3(32, 2560, 32)
    }

    /// GPT-3 6.7B: 32 layers, d_model 4096, 32 heads.
    pub fn gpt3_6_7b() -> Self {
        Self::gpt3(32, 4096, 32)
    }

    /// A CPU test model of about 0.47M parameters: vocab 512, context 64, d_model 128, 2 layers,
    /// 4 heads. Overfits a 64-token batch in a few seconds.
    pub fn tiny() -> Self {
        Self::new(512, 64, 128, 2, 4)
    }

    /// The CPU training model of the examples (about 5.3M parameters): vocab 8192, context 128,
    /// d_model 256, 4 layers, 4 heads; the nanoGPT-style model of DESIGN.md's reference numbers.
    pub fn small_cpu() -> Self {
        Self::new(8192, 128, 256, 4, 4)
    }

    /// A preset by name, case-insensitive, with `-`, `.` and `_` interchangeable
    /// (`"gpt3-175b"`, `"small_cpu"`, `"gpt3-2.7b"`). See [`PRESET_NAMES`].
    pub fn by_name(name: &str) -> Result<Self> {
        let key: String = name
            .trim()
            .chars()
            .map(|c| match c {
                '-' | '.' => '_',
                c => c.to_ascii_lowercase(),
            })
            .collect();
        Ok(match key.as_str() {
            "tiny" => Self::tiny(),
            "small_cpu" => Self::small_cpu(),
            "gpt3_small" | "gpt3_125m" => Self::gpt3_small(),
            "gpt3_medium" | "gpt3_350m" => Self::gpt3_medium(),
            "gpt3_large" | "gpt3_760m" => Self::gpt3_large(),
            "gpt3_xl" | "gpt3_1_3b" => Self::gpt3_xl(),
            "gpt3_2_7b" => Self::gpt3_2_7b(),
            "gpt3_6_7b" => Self::gpt3_6_7b(),
            "gpt3_175b" | "gpt3" => Self::gpt3_175b(),
            "llama_tiny" => Self::llama_tiny(),
            "llama_cpu" => Self::llama_cpu(),
            "llama3_8b" => Self::llama3_8b(),
            "llama3_70b" => Self::llama3_70b(),
            "llama3_405b" | "llama3_1_405b" => Self::llama3_405b(),
            _ => {
                return Err(ModelError::UnknownPreset {
                    name: name.to_string(),
                    known: PRESET_NAMES.join(", "),
                })
            }
        })
    }

    /// Checks every size is non-zero, `n_heads` divides `d_model`, and the epsilon and
    /// embedding std are finite and positive (std may be zero).
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("n_ctx", self.n_ctx),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
        ] {
            if v == 0 {
                return Err(ModelError::ZeroDimension { field });
            }
        }
        if self.d_model % self.n_heads != 0 {
            return Err(ModelError::HeadsDoNotDivide {
                n_heads: self.n_heads,
                d_model: self.d_model,
            });
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(ModelError::InvalidValue {
                field: "vocab_size",
                value: self.vocab_size as f64,
                expected: "token ids must fit in u32",
            });
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(ModelError::InvalidValue {
                field: "layer_norm_eps",
                value: self.layer_norm_eps,
                expected: "finite and > 0",
            });
        }
        if !(self.embedding_std.is_finite() && self.embedding_std >= 0.0) {
            return Err(ModelError::InvalidValue {
                field: "embedding_std",
                value: self.embedding_std,
                expected: "finite and >= 0",
            });
        }
        if self.ffn_hidden_size == Some(0) {
            return Err(ModelError::ZeroDimension {
                field: "ffn_hidden_size",
            });
        }
        match self.n_kv_heads {
            Some(0) => {
                return Err(ModelError::ZeroDimension {
                    field: "n_kv_heads",
                })
            }
            Some(kv) if self.n_heads % kv != 0 => {
                return Err(ModelError::Config {
                    field: "n_kv_heads",
                    reason: format!(
                        "n_kv_heads ({kv}) must divide n_heads ({}): each key/value head serves \
                         a whole group of query heads",
                        self.n_heads
                    ),
                })
            }
            _ => {}
        }
        if self.positions == PositionKind::Rotary {
            let hd = self.head_dim();
            if hd % 2 != 0 {
                return Err(ModelError::Config {
                    field: "positions",
                    reason: format!(
                        "rotary positions rotate pairs of elements, so the head dimension \
                         (d_model {} / n_heads {} = {hd}) must be even",
                        self.d_model, self.n_heads
                    ),
                });
            }
            crate::ops::rotary::check_rope(self.rope_theta, self.rope_scaling)?;
        } else if self.rope_scaling.is_some() {
            return Err(ModelError::Config {
                field: "rope_scaling",
                reason: "set with learned positions; it scales rotary frequencies only".into(),
            });
        }
        Ok(())
    }

    /// The architecture in a few words: `GPT-3 architecture` for GPT's choices, otherwise the
    /// choices (`Llama architecture (RMSNorm, rotary, SwiGLU, 8 query heads sharing 2
    /// key/value heads, untied head)` for the Llama ones).
    ///
    /// ```
    /// use kiln_model::GptConfig;
    /// assert_eq!(GptConfig::small_cpu().describe(), "GPT-3 architecture");
    /// assert!(GptConfig::llama_cpu().describe().starts_with("Llama architecture (RMSNorm"));
    /// ```
    pub fn describe(&self) -> String {
        if self.is_gpt_layout() {
            return "GPT-3 architecture".into();
        }
        let llama = self.is_llama_layout();
        let mut parts = vec![
            match self.norm {
                NormKind::LayerNorm => "LayerNorm",
                NormKind::RmsNorm => "RMSNorm",
            }
            .to_string(),
            match self.positions {
                PositionKind::Learned => "learned positions",
                PositionKind::Rotary => "rotary",
            }
            .to_string(),
            match self.mlp {
                MlpKind::Gelu => "GELU",
                MlpKind::SwiGlu => "SwiGLU",
            }
            .to_string(),
        ];
        if self.grouped_query() {
            parts.push(format!(
                "{} query heads sharing {} key/value heads",
                self.n_heads,
                self.kv_heads()
            ));
        }
        if !self.bias {
            parts.push("no biases".into());
        }
        if !self.tied_embeddings {
            parts.push("untied head".into());
        }
        let family = if llama { "Llama" } else { "decoder" };
        format!("{family} architecture ({})", parts.join(", "))
    }

    /// GPT's choices throughout: LayerNorm, learned positions, GELU, as many key/value heads
    /// as query heads, biases, a tied head (what Hugging Face's GPT-2 layout holds).
    pub fn is_gpt_layout(&self) -> bool {
        self.norm == NormKind::LayerNorm
            && self.positions == PositionKind::Learned
            && self.mlp == MlpKind::Gelu
            && self.bias
            && self.tied_embeddings
            && !self.grouped_query()
    }

    /// The Llama family's choices: RMSNorm, rotary positions, SwiGLU, no biases (any number
    /// of key/value heads, tied or untied head; what `LlamaForCausalLM` holds).
    pub fn is_llama_layout(&self) -> bool {
        self.norm == NormKind::RmsNorm
            && self.positions == PositionKind::Rotary
            && self.mlp == MlpKind::SwiGlu
            && !self.bias
    }

    /// Key/value heads: [`GptConfig::n_kv_heads`], or `n_heads` when unset.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Whether the attention has fewer key/value heads than query heads (grouped-query or
    /// multi-query attention).
    pub fn grouped_query(&self) -> bool {
        self.kv_heads() != self.n_heads
    }

    /// Width of one attention head, `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Width of the MLP's hidden layer: [`GptConfig::ffn_hidden_size`], or `4 * d_model`.
    pub fn d_ff(&self) -> usize {
        self.ffn_hidden_size.unwrap_or(4 * self.d_model)
    }

    /// Parameters of one norm: a gain, and a shift for a LayerNorm with biases.
    fn norm_param_count(&self) -> u64 {
        let shift = self.norm == NormKind::LayerNorm && self.bias;
        self.d_model as u64 * if shift { 2 } else { 1 }
    }

    /// Parameters of one block: two norms, the query, key and value projections and the
    /// attention output projection, the MLP (fc1 and fc2, or the fused gate and up and the
    /// down projection), with biases if [`GptConfig::bias`]. GPT: `12 d^2 + 13 d`.
    pub fn block_param_count(&self) -> u64 {
        let d = self.d_model as u64;
        let f = self.d_ff() as u64;
        let hd = self.head_dim() as u64;
        let (q, kv) = (self.n_heads as u64 * hd, self.kv_heads() as u64 * hd);
        let b = u64::from(self.bias);
        let attn = d * (q + 2 * kv) + b * (q + 2 * kv) + q * d + b * d;
        let up = match self.mlp {
            MlpKind::Gelu => f,
            MlpKind::SwiGlu => 2 * f,
        };
        let mlp = d * up + b * up + f * d + b * d;
        2 * self.norm_param_count() + attn + mlp
    }

    /// Embedding parameters: the token embedding, the learned positions (none with rotary
    /// ones) and an untied LM head: GPT `(vocab + n_ctx) * d`, Llama `2 * vocab * d`.
    pub fn embedding_param_count(&self) -> u64 {
        let positions = match self.positions {
            PositionKind::Learned => self.n_ctx as u64,
            PositionKind::Rotary => 0,
        };
        let head = if self.tied_embeddings {
            0
        } else {
            self.vocab_size as u64
        };
        (self.vocab_size as u64 + positions + head) * self.d_model as u64
    }

    /// Every trainable parameter, counted once: embeddings (a tied LM head adds nothing),
    /// `n_layers` blocks, and the final norm. GPT-3 175B: 174,604,259,328; Llama 3 8B:
    /// 8,030,261,248.
    pub fn param_count(&self) -> u64 {
        self.embedding_param_count() + self.non_embedding_param_count()
    }

    /// Parameters outside the token and position embeddings and the LM head: the blocks and
    /// the final norm. This is the `N` of Kaplan et al. and of PaLM's FLOPs formula.
    pub fn non_embedding_param_count(&self) -> u64 {
        self.n_layers as u64 * self.block_param_count() + self.norm_param_count()
    }

    /// The sizes and layout kiln-memory's estimates and kiln-parallel's degree checks take
    /// ([`kiln_memory::ModelShape`]), context `n_ctx`; its `params()` is
    /// [`GptConfig::param_count`].
    ///
    /// ```
    /// let s = kiln_model::GptConfig::gpt3_175b().shape();
    /// assert_eq!((s.n_layers, s.d_model, s.n_heads, s.ctx, s.vocab), (96, 12288, 96, 2048, 50257));
    /// let l = kiln_model::GptConfig::llama3_70b().shape();
    /// assert_eq!((l.kv_heads(), l.d_ff(), l.params()), (8, 28_672, 70_553_706_496));
    /// ```
    pub fn shape(&self) -> kiln_memory::ModelShape {
        kiln_memory::ModelShape {
            n_kv_heads: self.n_kv_heads.map(|kv| kv as u64),
            ffn_hidden_size: self.ffn_hidden_size.map(|f| f as u64),
            gated_mlp: self.mlp == MlpKind::SwiGlu,
            bias: self.bias,
            rms_norm: self.norm == NormKind::RmsNorm,
            learned_positions: self.positions == PositionKind::Learned,
            tied_embeddings: self.tied_embeddings,
            ..kiln_memory::ModelShape::gpt(
                self.n_layers as u64,
                self.d_model as u64,
                self.n_heads as u64,
                self.n_ctx as u64,
                self.vocab_size as u64,
            )
        }
    }

    /// Training FLOPs per token (forward and backward) at full context, by PaLM's formula
    /// (Chowdhery et al. 2022, appendix B): `6 N + 12 L H Q T`, with `N` the non-embedding
    /// parameters ([`GptConfig::non_embedding_param_count`]), `L` layers, `H` heads, `Q` head
    /// width and `T = n_ctx`.
    ///
    /// Convention: the embedding lookups cost no FLOPs and, following PaLM and Kaplan, the
    /// matmul of the tied LM head (`6 * vocab * d_model` per token) is not counted either; add
    /// [`GptConfig::lm_head_flops_per_token`] for the hardware FLOPs actually executed.
    pub fn flops_per_token(&self) -> f64 {
        let n = self.non_embedding_param_count() as f64;
        let attn = 12.0
            * self.n_layers as f64
            * self.n_heads as f64
            * self.head_dim() as f64
            * self.n_ctx as f64;
        6.0 * n + attn
    }

    /// FLOPs per token of the LM head's matmul (tied or not), forward and backward:
    /// `6 * vocab * d`.
    pub fn lm_head_flops_per_token(&self) -> f64 {
        6.0 * self.vocab_size as f64 * self.d_model as f64
    }
}

#[cfg(test)]
mod tests;
