//! [`GptConfig`]: the shape of a GPT-3-style decoder, its presets, parameter count and FLOPs.

use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};

/// The architecture of a GPT-3-style decoder: pre-LayerNorm blocks, learned positions, causal
/// multi-head attention, a 4x GELU MLP, and an LM head tied to the token embedding.
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
    /// Epsilon of every LayerNorm.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Scale the initialisation of the residual output projections (`attn.c_proj`,
    /// `mlp.c_proj`) by `1/sqrt(2 * n_layers)`, as GPT-2 and GPT-3 do.
    #[serde(default = "default_true")]
    pub scaled_residual_init: bool,
    /// Standard deviation of the normal initialisation of the token and position embeddings.
    #[serde(default = "default_embedding_std")]
    pub embedding_std: f64,
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
        }
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
        Ok(())
    }

    /// Width of one attention head, `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Width of the MLP's hidden layer, `4 * d_model`.
    pub fn d_ff(&self) -> usize {
        4 * self.d_model
    }

    /// Parameters of one block: two LayerNorms (gain and bias), the fused QKV projection and
    /// the attention output projection, fc1 and fc2, all with biases: `12 d^2 + 13 d`.
    pub fn block_param_count(&self) -> u64 {
        let d = self.d_model as u64;
        let f = self.d_ff() as u64;
        let ln = 2 * d;
        let attn = (d * 3 * d + 3 * d) + (d * d + d);
        let mlp = (d * f + f) + (f * d + d);
        2 * ln + attn + mlp
    }

    /// Embedding parameters: the token embedding (shared with the LM head) and the learned
    /// positions, `(vocab + n_ctx) * d`.
    pub fn embedding_param_count(&self) -> u64 {
        (self.vocab_size as u64 + self.n_ctx as u64) * self.d_model as u64
    }

    /// Every trainable parameter, counted once: embeddings (the LM head is tied, so it adds
    /// nothing), `n_layers` blocks, and the final LayerNorm. GPT-3 175B: 174,604,259,328.
    pub fn param_count(&self) -> u64 {
        self.embedding_param_count() + self.non_embedding_param_count()
    }

    /// Parameters outside the token and position embeddings: the blocks and the final
    /// LayerNorm. This is the `N` of Kaplan et al. and of PaLM's FLOPs formula.
    pub fn non_embedding_param_count(&self) -> u64 {
        self.n_layers as u64 * self.block_param_count() + 2 * self.d_model as u64
    }

    /// The sizes kiln-memory's estimates and kiln-parallel's degree checks take
    /// ([`kiln_memory::ModelShape`]), context `n_ctx`.
    ///
    /// ```
    /// let s = kiln_model::GptConfig::gpt3_175b().shape();
    /// assert_eq!((s.n_layers, s.d_model, s.n_heads, s.ctx, s.vocab), (96, 12288, 96, 2048, 50257));
    /// ```
    pub fn shape(&self) -> kiln_memory::ModelShape {
        kiln_memory::ModelShape {
            n_layers: self.n_layers as u64,
            d_model: self.d_model as u64,
            n_heads: self.n_heads as u64,
            ctx: self.n_ctx as u64,
            vocab: self.vocab_size as u64,
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

    /// FLOPs per token of the tied LM head's matmul, forward and backward: `6 * vocab * d`.
    pub fn lm_head_flops_per_token(&self) -> f64 {
        6.0 * self.vocab_size as f64 * self.d_model as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt3_175b_param_count_matches_the_paper() {
        let c = GptConfig::gpt3_175b();
        c.validate().unwrap();
        // 96 * (12 * 12288^2 + 13 * 12288) + (50257 + 2048) * 12288 + 2 * 12288, by hand
        let blocks: u64 = 96 * (12 * 12288 * 12288 + 13 * 12288);
        assert_eq!(blocks, 173_961_510_912);
        assert_eq!(c.param_count(), 174_604_259_328);
        let n = c.param_count() as f64;
        assert!((174.5e9..=175.3e9).contains(&n), "{n}");
        assert_eq!(c.non_embedding_param_count(), 173_961_535_488);
    }

    #[test]
    fn gpt3_family_counts_land_near_their_names() {
        // (preset, nominal size from the GPT-3 paper, allowed relative deviation)
        for (c, nominal) in [
            (GptConfig::gpt3_small(), 125e6),
            (GptConfig::gpt3_medium(), 350e6),
            (GptConfig::gpt3_large(), 760e6),
            (GptConfig::gpt3_xl(), 1.3e9),
            (GptConfig::gpt3_2_7b(), 2.7e9),
            (GptConfig::gpt3_6_7b(), 6.7e9),
        ] {
            c.validate().unwrap();
            let n = c.param_count() as f64;
            assert!((n / nominal - 1.0).abs() < 0.03, "{c:?}: {n} vs {nominal}");
        }
        // exact, by hand: 12 * (12 * 768^2 + 13 * 768) + (50257 + 2048) * 768 + 2 * 768
        assert_eq!(GptConfig::gpt3_small().param_count(), 125_226_240);
    }

    #[test]
    fn flops_per_token_follow_palm() {
        let c = GptConfig::gpt3_175b();
        let expected = 6.0 * 173_961_535_488.0 + 12.0 * 96.0 * 96.0 * 128.0 * 2048.0;
        assert_eq!(c.flops_per_token(), expected);
        assert!((c.flops_per_token() / 1.0727e12 - 1.0).abs() < 1e-3);
        assert_eq!(c.lm_head_flops_per_token(), 6.0 * 50257.0 * 12288.0);
    }

    #[test]
    fn presets_by_name_and_validation() {
        for name in PRESET_NAMES {
            let c = GptConfig::by_name(name).unwrap();
            c.validate().unwrap();
        }
        assert_eq!(
            GptConfig::by_name("GPT3-175B").unwrap(),
            GptConfig::gpt3_175b()
        );
        assert_eq!(
            GptConfig::by_name("small-cpu").unwrap(),
            GptConfig::small_cpu()
        );
        assert_eq!(
            GptConfig::by_name("gpt3-2.7b").unwrap(),
            GptConfig::gpt3_2_7b()
        );
        let err = GptConfig::by_name("gpt5").unwrap_err();
        assert!(matches!(err, ModelError::UnknownPreset { .. }));
        assert!(err.to_string().contains("gpt3_175b"), "{err}");

        let mut c = GptConfig::tiny();
        c.n_heads = 3;
        let err = c.validate().unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::HeadsDoNotDivide {
                    n_heads: 3,
                    d_model: 128
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "invalid config: n_heads (3) must divide d_model (128)"
        );
        let mut c = GptConfig::tiny();
        c.n_layers = 0;
        assert!(matches!(
            c.validate(),
            Err(ModelError::ZeroDimension { field: "n_layers" })
        ));
        let mut c = GptConfig::tiny();
        c.layer_norm_eps = 0.0;
        assert!(matches!(
            c.validate(),
            Err(ModelError::InvalidValue {
                field: "layer_norm_eps",
                ..
            })
        ));
    }

    #[test]
    fn config_round_trips_through_json_with_defaults() {
        let c = GptConfig::small_cpu();
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<GptConfig>(&s).unwrap(), c);
        let minimal = r#"{"vocab_size":512,"n_ctx":64,"d_model":128,"n_layers":2,"n_heads":4}"#;
        assert_eq!(
            serde_json::from_str::<GptConfig>(minimal).unwrap(),
            GptConfig::tiny()
        );
    }
}
