//! [`ModelShape`]: the sizes and layout choices of a decoder that its memory depends on, its
//! parameter count, and what one tensor-parallel rank of it holds.

/// The shape of a decoder-only transformer, as far as memory is concerned: GPT's layout
/// ([`ModelShape::gpt`]: fused QKV, a 4h GELU MLP, biases, LayerNorms, learned positions, a
/// tied head) or the Llama family's ([`ModelShape::llama`]: fewer key/value heads than query
/// heads, a SwiGLU MLP of its own width, no biases, RMSNorms, rotary positions, an untied
/// head), or any mix kiln-model's `GptConfig` describes (its `shape()` gives this).
///
/// The fields beyond the five GPT sizes default to GPT's choices, and are left out of the JSON
/// when they hold them, so a GPT shape serialises as it always has and an old JSON reads as
/// GPT.
///
/// ```
/// use kiln_memory::ModelShape;
/// let gpt = ModelShape::gpt(2, 128, 4, 64, 512);
/// assert_eq!(gpt.params(), 470_528); // kiln-model's `GptConfig::tiny()`
/// let llama = ModelShape::llama(2, 128, 4, 2, 352, 64, 512);
/// assert_eq!(llama.params(), 500_352); // `GptConfig::llama_tiny()`
/// // at tp = 4 each rank holds one query head, and both key/value heads (replicated)
/// assert!(llama.kv_replicated(4) && !llama.kv_replicated(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelShape {
    /// Number of transformer blocks.
    pub n_layers: u64,
    /// Model width.
    pub d_model: u64,
    /// Attention (query) heads.
    pub n_heads: u64,
    /// Context length (sequence length of a micro-batch).
    pub ctx: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Key/value heads (grouped-query attention); none: `n_heads` ([`ModelShape::kv_heads`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<u64>,
    /// The MLP's hidden width; none: `4 * d_model` ([`ModelShape::d_ff`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_hidden_size: Option<u64>,
    /// A gated MLP (SwiGLU: a fused gate and up projection of `2 * d_ff` columns, then the
    /// down projection of `d_ff` rows) rather than GELU's `d_ff` columns and rows.
    #[serde(default, skip_serializing_if = "is_false")]
    pub gated_mlp: bool,
    /// Biases on every linear layer, and a shift on every LayerNorm.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub bias: bool,
    /// RMSNorms (one weight vector each, no shift) rather than LayerNorms.
    #[serde(default, skip_serializing_if = "is_false")]
    pub rms_norm: bool,
    /// A learned embedding of `ctx` positions; false: rotary positions, which have no
    /// parameters and rotate the queries and keys into tensors of their own.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub learned_positions: bool,
    /// The LM head is the token embedding; false: a `vocab x d_model` matrix of its own.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub tied_embeddings: bool,
}

fn yes() -> bool {
    true
}
fn is_true(v: &bool) -> bool {
    *v
}
fn is_false(v: &bool) -> bool {
    !*v
}

/// Parameters of one part of the model on one tensor-parallel rank: those split over the
/// ranks (counted whole) and those every rank holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TpParams {
    /// Split over the tensor-parallel ranks (the whole count; a rank holds `split / tp`).
    pub split: u64,
    /// Held whole by every rank.
    pub replicated: u64,
}

impl TpParams {
    /// What one of `tp` ranks holds.
    pub fn per_rank(self, tp: u64) -> u64 {
        self.split / tp.max(1) + self.replicated
    }
}

impl ModelShape {
    /// GPT's layout at the given sizes: as many key/value heads as query heads, a 4h GELU MLP,
    /// biases, LayerNorms, learned positions and a tied head.
    pub fn gpt(n_layers: u64, d_model: u64, n_heads: u64, ctx: u64, vocab: u64) -> Self {
        Self {
            n_layers,
            d_model,
            n_heads,
            ctx,
            vocab,
            n_kv_heads: None,
            ffn_hidden_size: None,
            gated_mlp: false,
            bias: true,
            rms_norm: false,
            learned_positions: true,
            tied_embeddings: true,
        }
    }

    /// The Llama layout at the given sizes: `n_kv_heads` key/value heads, a SwiGLU MLP of `ffn`
    /// hidden units, no biases, RMSNorms, rotary positions and an untied head.
    pub fn llama(
        n_layers: u64,
        d_model: u64,
        n_heads: u64,
        n_kv_heads: u64,
        ffn: u64,
        ctx: u64,
        vocab: u64,
    ) -> Self {
        Self {
            n_kv_heads: Some(n_kv_heads),
            ffn_hidden_size: Some(ffn),
            gated_mlp: true,
            bias: false,
            rms_norm: true,
            learned_positions: false,
            tied_embeddings: false,
            ..Self::gpt(n_layers, d_model, n_heads, ctx, vocab)
        }
    }

    /// Key/value heads: [`ModelShape::n_kv_heads`], or `n_heads`.
    pub fn kv_heads(&self) -> u64 {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Width of one attention head, `d_model / n_heads`.
    pub fn head_dim(&self) -> u64 {
        self.d_model / self.n_heads.max(1)
    }

    /// Width of the queries (and of the attention output), `n_heads * head_dim`.
    pub fn q_width(&self) -> u64 {
        self.n_heads * self.head_dim()
    }

    /// Width of the keys and of the values, `kv_heads * head_dim`.
    pub fn kv_width(&self) -> u64 {
        self.kv_heads() * self.head_dim()
    }

    /// The MLP's hidden width: [`ModelShape::ffn_hidden_size`], or `4 * d_model`.
    pub fn d_ff(&self) -> u64 {
        self.ffn_hidden_size.unwrap_or(4 * self.d_model)
    }

    /// Columns of the MLP's first product: `2 * d_ff` gated (gate and up), `d_ff` otherwise.
    pub fn mlp_up_width(&self) -> u64 {
        if self.gated_mlp {
            2 * self.d_ff()
        } else {
            self.d_ff()
        }
    }

    /// Whether tensor-parallel degree `tp` replicates the key/value projections (every rank
    /// holds all key/value heads and computes the one its query heads read) rather than
    /// splitting them: where `tp > 1` does not divide the key/value heads (kiln-model's
    /// `kv_replicated`; a valid degree is then a multiple of them, which
    /// [`crate::MemoryPlan::validate`] checks).
    pub fn kv_replicated(&self, tp: u64) -> bool {
        tp > 1 && self.kv_heads() % tp != 0
    }

    /// Key/value heads one rank computes under degree `tp`: `kv_heads / tp` where `tp` divides
    /// them, one where they are replicated.
    pub(crate) fn kv_divisor(&self, tp: u64) -> u64 {
        if self.kv_replicated(tp) {
            self.kv_heads()
        } else {
            tp.max(1)
        }
    }

    /// Parameters of one norm: a weight, and a shift for a LayerNorm with biases.
    pub fn norm_params(&self) -> u64 {
        let shift = !self.rms_norm && self.bias;
        self.d_model * if shift { 2 } else { 1 }
    }

    /// Parameters of one block under degree `tp`, Megatron's layout as kiln-model builds it:
    /// the query projection (with the key and value ones unless replicated) and the MLP's
    /// first product split by columns with their biases, the attention output and the MLP's
    /// down projection split by rows with replicated biases, the norms replicated.
    pub(crate) fn block_tp_params(&self, tp: u64) -> TpParams {
        let (h, q, kv, f) = (self.d_model, self.q_width(), self.kv_width(), self.d_ff());
        let b = u64::from(self.bias);
        let up = self.mlp_up_width();
        let kv_proj = 2 * (h * kv + b * kv);
        let (kv_split, kv_whole) = if self.kv_replicated(tp) {
            (0, kv_proj)
        } else {
            (kv_proj, 0)
        };
        TpParams {
            // q (and k, v), the output projection, the MLP's two matrices and first bias
            split: h * q + b * q + kv_split + q * h + h * up + b * up + f * h,
            // the output projection's and the down projection's biases, the two norms
            replicated: kv_whole + 2 * b * h + 2 * self.norm_params(),
        }
    }

    /// Parameters outside the blocks under degree `tp`: the token embedding and an untied LM
    /// head (vocab-parallel), the learned positions and the final norm (replicated).
    pub(crate) fn outer_tp_params(&self) -> TpParams {
        let h = self.d_model;
        let head = if self.tied_embeddings { 0 } else { self.vocab };
        let positions = if self.learned_positions { self.ctx } else { 0 };
        TpParams {
            split: (self.vocab + head) * h,
            replicated: positions * h + self.norm_params(),
        }
    }

    /// Parameters of the whole model, every one counted once (kiln-model's
    /// `GptConfig::param_count`): the token embedding, learned positions and an untied head,
    /// the blocks and the final norm. GPT: 12·L·h² + 13·L·h + (V + s)·h + 2h.
    pub fn params(&self) -> u64 {
        let (block, outer) = (self.block_tp_params(1), self.outer_tp_params());
        self.n_layers * (block.split + block.replicated) + outer.split + outer.replicated
    }

    /// Parameters one rank holds under tensor-parallel degree `tp` (Megatron's layout as
    /// kiln-model's `TensorParallelFactory` builds it: QKV or the query projection, fc1 or the
    /// fused gate and up, and their biases split by columns, the output projections split by
    /// rows with replicated biases, the key and value projections split where `tp` divides
    /// their heads and replicated where it is a multiple of them, a vocab-parallel embedding
    /// and untied head, replicated positions and norms).
    pub fn params_per_tp_rank(&self, tp: u64) -> u64 {
        let (block, outer) = (self.block_tp_params(tp), self.outer_tp_params());
        let split = self.n_layers * block.split + outer.split;
        let replicated = self.n_layers * block.replicated + outer.replicated;
        split / tp.max(1) + replicated
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3_8b() -> ModelShape {
        ModelShape::llama(32, 4096, 32, 8, 14_336, 8192, 128_256)
    }
    fn llama3_70b() -> ModelShape {
        ModelShape::llama(80, 8192, 64, 8, 28_672, 8192, 128_256)
    }
    fn llama3_405b() -> ModelShape {
        ModelShape::llama(126, 16_384, 128, 8, 53_248, 8192, 128_256)
    }

    #[test]
    fn llama_counts_are_the_published_ones() {
        // Hugging Face's num_parameters() of Meta-Llama-3-8B, -70B and Llama-3.1-405B
        assert_eq!(llama3_8b().params(), 8_030_261_248);
        assert_eq!(llama3_70b().params(), 70_553_706_496);
        assert_eq!(llama3_405b().params(), 405_853_388_800);
        // Llama 3 8B by hand: per block q and o 2h², k and v 2·h·(8·128), the SwiGLU 3·h·f,
        // two RMSNorm weights; the embedding and the untied head 2·V·h; the final norm h
        let (h, f, kv) = (4096u64, 14_336u64, 8 * 128u64);
        let block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h;
        assert_eq!(llama3_8b().params(), 32 * block + 2 * 128_256 * h + h);
    }

    #[test]
    fn a_tensor_parallel_rank_splits_or_replicates_the_key_value_heads() {
        let s = llama3_70b();
        let (l, h, kv, f, v) = (80u64, 8192u64, 1024u64, 28_672u64, 128_256u64);
        // split: q and o (h² each), k and v (h·kv each), gate, up and down (3·h·f), the
        // embedding and the head (2·V·h); replicated: two RMSNorms per block, the final one
        let split = l * (2 * h * h + 2 * h * kv + 3 * h * f) + 2 * v * h;
        for tp in [1u64, 2, 4, 8] {
            assert!(!s.kv_replicated(tp));
            assert_eq!(
                s.params_per_tp_rank(tp),
                split / tp + l * 2 * h + h,
                "tp {tp}"
            );
        }
        assert_eq!(s.params_per_tp_rank(8), 8_820_367_360);
        // tp = 16 is a multiple of the 8 key/value heads: every rank holds k and v whole
        assert!(s.kv_replicated(16));
        let kv_proj = l * 2 * h * kv;
        assert_eq!(
            s.params_per_tp_rank(16),
            (split - kv_proj) / 16 + kv_proj + l * 2 * h + h
        );
        assert_eq!(s.params_per_tp_rank(1), s.params());
        // GPT's layout never replicates: its key/value heads are its query heads
        let gpt = ModelShape::gpt(96, 12288, 96, 2048, 50257);
        assert!((1..=96)
            .filter(|t| 96 % t == 0)
            .all(|t| !gpt.kv_replicated(t)));
    }

    #[test]
    fn gpt_json_is_unchanged_and_old_json_reads_as_gpt() {
        let gpt = ModelShape::gpt(2, 64, 4, 32, 256);
        let json = serde_json::to_string(&gpt).unwrap();
        assert_eq!(
            json,
            r#"{"n_layers":2,"d_model":64,"n_heads":4,"ctx":32,"vocab":256}"#
        );
        assert_eq!(serde_json::from_str::<ModelShape>(&json).unwrap(), gpt);
        let llama = llama3_8b();
        let back: ModelShape =
            serde_json::from_str(&serde_json::to_string(&llama).unwrap()).unwrap();
        assert_eq!(back, llama);
    }
}
