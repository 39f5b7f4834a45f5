//! Bytes per rank for model states, activations and communication buffers.
//!
//! Model states follow the ZeRO paper (Rajbhandari et al., 2020): with mixed-precision Adam every
//! parameter costs 2 bytes of 16-bit weights, 2 bytes of 16-bit gradients and K = 12 bytes of
//! optimizer state (fp32 master weights, momentum, variance). Over a data-parallel group of N:
//! plain data parallel holds (2 + 2 + K)Ψ, ZeRO-1 (optimizer states) 2Ψ + 2Ψ + KΨ/N, ZeRO-2
//! (+ gradients) 2Ψ + (2 + K)Ψ/N, ZeRO-3 (+ parameters) (2 + 2 + K)Ψ/N. With fp32 compute the
//! weights and gradients take 4 bytes and kiln still keeps K = 12 (its optimizer steps a flat
//! fp32 master copy, separate from the model's variables, plus the two moments), except under
//! ZeRO-3, where the fp32 master shard is the weight shard: (4 + 12)Ψ/N.
//!
//! Activations are counted for kiln's GPT block (pre-LayerNorm, fused QKV, causal softmax that
//! saves its output, tanh-GELU MLP, no dropout): per layer it keeps the LayerNorm inputs and
//! outputs (4·s·b·h elements, replicated under tensor parallelism), QKV, the attention output and
//! the two MLP activations (12·s·b·h / t) and the attention scores and probabilities
//! (2·a·s²·b / t), where s is the sequence length, b the micro-batch, h the model width, a the
//! number of heads and t the tensor-parallel degree. In 16-bit that is 32·s·b·h + 4·a·s²·b
//! bytes per layer at t = 1: Korthikanti et al.'s (2022, "Reducing Activation Recomputation in
//! Large Transformer Models", section 4.1) 34·s·b·h + 5·a·s²·b for Megatron's block less its
//! dropout masks (one byte per element: 2·s·b·h after attention and the MLP, a·s²·b on the
//! attention probabilities), which kiln's block does not have. With activation recomputation a recomputed block keeps only its input (s·b·h),
//! and one recomputed block's activations exist at a time, during its recomputation; the
//! blocks a [`RecomputePolicy`] leaves alone keep all of theirs. Under sequence parallelism
//! ([`MemoryPlan::sequence_parallel`], with t > 1) the replicated part is split as well:
//! 4·s·b·h / t per layer, a recomputed block's input s·b·h / t, and the embedding output
//! s·b·h / t (Korthikanti et al.'s 34·s·b·h / t). A block checkpointed selectively
//! ([`RecomputePolicy::Selective`]) keeps its LayerNorm inputs (2·s·b·h / rep), QKV, the
//! attention output and the MLP's first product (8·s·b·h / t): the LayerNorm outputs, the GELU
//! output and the attention scores are computed again (kiln's fused attention keeps no scores).
//!
//! kiln's Llama block ([`ModelShape::llama`]: pre-RMSNorm, query, key and value projections
//! with k key/value heads of width d = h / a, rotary positions, a SwiGLU MLP of hidden width f,
//! no biases) keeps per layer the RMSNorm inputs and outputs (4·s·b·h / rep, as above), q and
//! the attention output (2·s·b·h / t), k and v (2·s·b·k·d / t_kv), the rotary op's inputs,
//! held beside the rotated q and k the attention reads (s·b·h / t + s·b·k·d / t_kv), the fused
//! gate and up product (2·s·b·f / t), the SwiGLU output (s·b·f / t), and the scores and
//! probabilities counted as for GPT (2·a·s²·b / t, with a the query heads). Here t_kv is t where
//! t divides k, and k where t is a multiple of k: the key/value projections are then
//! replicated and each rank computes the one head its query heads read. In 16-bit at t = 1 that
//! is 2·s·b·(7h + 3·k·d + 3f) + 4·a·s²·b bytes per layer. A recomputed block keeps its input
//! (s·b·h / rep), and a selective one its RMSNorm inputs (2·s·b·h / rep), q, k, v, the rotary
//! inputs, the attention output and the gate and up product: the RMSNorm outputs, the SwiGLU
//! output and the scores are computed again. For both layouts the scores term of a block that
//! keeps everything is Korthikanti et al.'s, an upper bound for kiln's fused attention, which
//! keeps none.
//!
//! Under pipeline parallelism ([`MemoryPlan::estimate_stage`] with a [`PipelinePlan`]) a rank
//! holds its stage's parameters and the activations of the micro-batches its schedule keeps in
//! flight: GPipe all `m`, 1F1B `min(p - rank, m)`, ZB-H1 `min(p, m)`, interleaved Megatron-LM's
//! warm-up plus one (`p v + p - 1` chunks on rank 0); the first stage thus keeps L layers'
//! worth of activations under 1F1B, Korthikanti et al.'s section 4.2.3 ([`PipelinePlan`] has the count).

mod pipeline;
mod shape;

pub use pipeline::{PipelinePlan, PipelineSchedule, StageEstimate};
pub use shape::ModelShape;

use crate::error::{MemoryError, Result};
use crate::segment::RecomputePolicy;
use kiln_state::ZeroStage;

/// Numeric precision of the training run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemPrecision {
    /// fp32 weights, gradients and activations; the optimizer keeps an fp32 master copy,
    /// momentum and variance (K = 12).
    F32,
    /// 16-bit (fp16 or bf16) weights, gradients and activations, fp32 master weights, momentum and
    /// variance (K = 12).
    Mixed16,
}

impl MemPrecision {
    /// Bytes of a weight, gradient or activation element.
    pub fn compute_bytes(self) -> u64 {
        match self {
            MemPrecision::F32 => 4,
            MemPrecision::Mixed16 => 2,
        }
    }
    /// Optimizer-state bytes per parameter (K in the ZeRO paper).
    pub fn optimizer_bytes(self) -> u64 {
        match self {
            MemPrecision::F32 | MemPrecision::Mixed16 => 12,
        }
    }
}

/// Everything that decides the memory of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryPlan {
    /// The model.
    pub shape: ModelShape,
    /// Precision.
    pub precision: MemPrecision,
    /// Sharding stage over the data-parallel group.
    pub stage: ZeroStage,
    /// Data-parallel degree.
    pub dp: u64,
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Micro-batch size (sequences).
    pub micro_batch: u64,
    /// Which blocks recompute their activations.
    pub recompute: RecomputePolicy,
    /// Gradient bucket size in bytes (communication buffers; DDP's default is 25 MB).
    pub bucket_bytes: u64,
    /// Megatron's sequence parallelism over the tensor-parallel group: the LayerNorm inputs
    /// and outputs and the blocks' inputs are split over the `tp` ranks too.
    #[serde(default)]
    pub sequence_parallel: bool,
}

/// Bytes per rank, by category.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryEstimate {
    /// Parameters this rank holds (model-state count Ψ/tp).
    pub params_per_rank: u64,
    /// Weights in compute precision.
    pub weights: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer states (master weights, moments).
    pub optimizer: u64,
    /// Activations of one micro-batch, at the peak of forward and backward.
    pub activations: u64,
    /// Communication buffers.
    pub comm_buffers: u64,
}

impl MemoryEstimate {
    /// Weights + gradients + optimizer states.
    pub fn model_states(&self) -> u64 {
        self.weights + self.grads + self.optimizer
    }
    /// Everything.
    pub fn total(&self) -> u64 {
        self.model_states() + self.activations + self.comm_buffers
    }
}

impl MemoryPlan {
    /// Checks the degrees against the model.
    pub fn validate(&self) -> Result<()> {
        let s = &self.shape;
        for (field, v) in [
            ("n_layers", s.n_layers),
            ("d_model", s.d_model),
            ("n_heads", s.n_heads),
            ("ctx", s.ctx),
            ("vocab", s.vocab),
            ("dp", self.dp),
            ("tp", self.tp),
            ("micro_batch", self.micro_batch),
        ] {
            if v == 0 {
                return Err(MemoryError::Config {
                    field,
                    message: "must be at least 1, got 0".into(),
                });
            }
        }
        for (field, v) in [
            ("n_kv_heads", s.n_kv_heads),
            ("ffn_hidden_size", s.ffn_hidden_size),
        ] {
            if v == Some(0) {
                return Err(MemoryError::Config {
                    field,
                    message: "must be at least 1, got 0".into(),
                });
            }
        }
        let (kv, t) = (s.kv_heads(), self.tp);
        if s.n_heads % kv != 0 {
            return Err(MemoryError::Config {
                field: "n_kv_heads",
                message: format!("n_kv_heads ({kv}) must divide n_heads ({})", s.n_heads),
            });
        }
        if s.n_heads % t != 0 || s.d_model % t != 0 {
            return Err(MemoryError::Config {
                field: "tp",
                message: format!(
                    "tensor_parallel_degree ({t}) must divide n_heads ({}) and d_model ({})",
                    s.n_heads, s.d_model
                ),
            });
        }
        if kv % t != 0 && t % kv != 0 {
            return Err(MemoryError::Config {
                field: "tp",
                message: format!(
                    "tensor_parallel_degree ({t}) must divide n_kv_heads ({kv}) or be a \
                     multiple of it (each key/value head replicated over tp / n_kv_heads ranks)"
                ),
            });
        }
        if s.d_ff() % t != 0 {
            return Err(MemoryError::Config {
                field: "tp",
                message: format!(
                    "tensor_parallel_degree ({t}) must divide the MLP width ({})",
                    s.d_ff()
                ),
            });
        }
        Ok(())
    }

    /// Model-state bytes (weights, gradients, optimizer states) per rank for `psi` parameters
    /// on this rank's tensor-parallel shard, over a data-parallel group of `dp`.
    pub fn model_state_split(
        psi: u64,
        precision: MemPrecision,
        stage: ZeroStage,
        dp: u64,
    ) -> (u64, u64, u64) {
        let n = dp.max(1);
        let c = precision.compute_bytes();
        let k = precision.optimizer_bytes();
        let shard = |bytes: u64| bytes.div_ceil(n);
        match stage {
            ZeroStage::Replicated => (c * psi, c * psi, k * psi),
            ZeroStage::Zero1 => (c * psi, c * psi, shard(k * psi)),
            ZeroStage::Zero2 => (c * psi, shard(c * psi), shard(k * psi)),
            ZeroStage::Zero3 => {
                let weights = match precision {
                    MemPrecision::Mixed16 => shard(c * psi),
                    // the fp32 master shard is the weight shard
                    MemPrecision::F32 => 0,
                };
                (weights, shard(c * psi), shard(k * psi))
            }
        }
    }

    /// The sum of [`MemoryPlan::model_state_split`].
    pub fn model_state_bytes_for(
        psi: u64,
        precision: MemPrecision,
        stage: ZeroStage,
        dp: u64,
    ) -> u64 {
        let (w, g, o) = Self::model_state_split(psi, precision, stage, dp);
        w + g + o
    }

    /// The estimate. Model states follow the ZeRO formulas exactly (see the module docs).
    pub fn estimate(&self) -> Result<MemoryEstimate> {
        self.validate()?;
        let psi = self.shape.params_per_tp_rank(self.tp);
        let (weights, grads, optimizer) =
            Self::model_state_split(psi, self.precision, self.stage, self.dp);
        let comm_buffers = self.comm_buffer_bytes();
        Ok(MemoryEstimate {
            params_per_rank: psi,
            weights,
            grads,
            optimizer,
            activations: self.activation_bytes(),
            comm_buffers,
        })
    }

    /// The estimate for parameter-efficient fine-tuning: `frozen_per_rank` of this rank's
    /// parameters are frozen and `trainable_per_rank` train (the rest of the model's
    /// parameters, plus any a wrapper adds, such as LoRA's adapters: freezing the whole model
    /// and adding adapters is `frozen = params_per_rank`). Trainable parameters cost what
    /// [`MemoryPlan::estimate`] says a parameter costs; frozen ones only their weights in
    /// compute precision, replicated over the data-parallel group (no gradient, no master copy,
    /// no optimizer state). An error when more parameters are frozen than the rank holds.
    pub fn estimate_frozen(
        &self,
        frozen_per_rank: u64,
        trainable_per_rank: u64,
    ) -> Result<MemoryEstimate> {
        let full = self.estimate()?;
        let psi = full.params_per_rank;
        if frozen_per_rank > psi {
            return Err(MemoryError::Config {
                field: "frozen parameters",
                message: format!("{frozen_per_rank} frozen, but a rank holds only {psi}"),
            });
        }
        let c = self.precision.compute_bytes();
        let (w, grads, optimizer) =
            Self::model_state_split(trainable_per_rank, self.precision, self.stage, self.dp);
        Ok(MemoryEstimate {
            params_per_rank: frozen_per_rank + trainable_per_rank,
            weights: w + c * frozen_per_rank,
            grads,
            optimizer,
            ..full
        })
    }

    /// Gradient buckets, and under ZeRO-3 the gathered parameters of one block.
    fn comm_buffer_bytes(&self) -> u64 {
        let c = self.precision.compute_bytes();
        match self.stage {
            // one bucket being reduced while the next fills
            ZeroStage::Replicated | ZeroStage::Zero1 => 2 * self.bucket_bytes,
            // reduce-scatter input bucket plus the gathered parameters of one block
            ZeroStage::Zero2 => 2 * self.bucket_bytes,
            ZeroStage::Zero3 => 2 * self.bucket_bytes + c * self.block_params_per_rank() * 2,
        }
    }

    fn block_params_per_rank(&self) -> u64 {
        self.shape.block_tp_params(self.tp).per_rank(self.tp)
    }

    /// What one micro-batch keeps, by part (see the module docs).
    fn activation_terms(&self) -> ActivationTerms {
        let s = &self.shape;
        let (sq, b, h, a, t) = (s.ctx, self.micro_batch, s.d_model, s.n_heads, self.tp);
        let c = self.precision.compute_bytes();
        // what every tensor-parallel rank holds whole, unless the rows are split
        let rep = if self.sequence_parallel { t } else { 1 };
        // the key/value heads a rank computes: its share, or one replicated head
        let kv_t = s.kv_divisor(t);
        let (q, kv, f, up) = (s.q_width(), s.kv_width(), s.d_ff(), s.mlp_up_width());
        // rotary positions: the rotation's input stays with it (grouped: q and k; fused: the
        // whole [q | k | v] it rotates in place of)
        let (rot_q, rot_kv) = match (s.learned_positions, s.kv_heads() == s.n_heads) {
            (true, _) => (0, 0),
            (false, true) => (q, 2 * kv),
            (false, false) => (q, kv),
        };
        // q, k and v (and the rotary inputs), the attention output and the MLP's first product
        let kept = sq * b * (2 * q + up + rot_q) / t + sq * b * (2 * kv + rot_kv) / kv_t;
        ActivationTerms {
            // the norms' inputs and outputs, the kept part, the second MLP activation (GELU's
            // or SwiGLU's output) and the attention scores and probabilities
            per_layer: c * (sq * b * h * 4 / rep + kept + sq * b * f / t + 2 * a * sq * sq * b / t),
            layer_input: c * sq * b * h / rep,
            // the norms' inputs and the kept part
            selective_kept: c * (sq * b * h * 2 / rep + kept),
            embedding_output: c * sq * b * h / rep,
            // logits (vocab-parallel), and with their gradient
            logits: c * sq * b * s.vocab / t,
            logits_pair: 2 * c * sq * b * s.vocab / t,
        }
    }

    /// Activation bytes of one micro-batch (see the module docs for the count).
    pub fn activation_bytes(&self) -> u64 {
        let s = &self.shape;
        let a = self.activation_terms();
        // embedding output, logits and their gradient (vocab-parallel)
        let ends = a.embedding_output + a.logits_pair;
        let recomputed = self.recompute.recomputed_blocks(s.n_layers);
        let selective = self.recompute.selective_blocks(s.n_layers);
        if selective > 0 {
            // a selective block keeps its norms' inputs, q, k and v (and the rotary inputs),
            // the attention output and the MLP's first product; the norms' outputs and the
            // GELU or SwiGLU output are computed again, and kiln's fused attention keeps no
            // scores
            return selective * a.selective_kept + (s.n_layers - selective) * a.per_layer + ends;
        }
        if recomputed == 0 {
            return s.n_layers * a.per_layer + ends;
        }
        // the recomputed blocks' inputs, the other blocks' activations, and one recomputed
        // block's activations while it runs again
        recomputed * a.layer_input + (s.n_layers - recomputed) * a.per_layer + a.per_layer + ends
    }
}

/// The parts of one micro-batch's activations, in bytes.
struct ActivationTerms {
    /// A block that keeps everything.
    per_layer: u64,
    /// A recomputed block (its input).
    layer_input: u64,
    /// A selectively recomputed block.
    selective_kept: u64,
    /// The embedding output (first stage).
    embedding_output: u64,
    /// The logits (last stage).
    logits: u64,
    /// The logits and their gradient.
    logits_pair: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt3() -> ModelShape {
        ModelShape::gpt(96, 12288, 96, 2048, 50257)
    }

    fn plan(stage: ZeroStage, dp: u64) -> MemoryPlan {
        MemoryPlan {
            shape: gpt3(),
            precision: MemPrecision::Mixed16,
            stage,
            dp,
            tp: 1,
            micro_batch: 1,
            recompute: RecomputePolicy::EveryBlock,
            bucket_bytes: 25 << 20,
            sequence_parallel: false,
        }
    }

    #[test]
    fn gpt3_has_175b_parameters() {
        let p = gpt3().params();
        assert!((174_500_000_000..175_300_000_000).contains(&p), "{p}");
    }

    #[test]
    fn model_states_follow_the_zero_paper() {
        let psi = gpt3().params();
        for n in [1u64, 4, 64, 1024] {
            let e = |s| plan(s, n).estimate().unwrap().model_states();
            // divisions round up per category, so allow a few bytes
            let close = |got: u64, want: f64| (got as f64 - want).abs() <= 4.0;
            let p = psi as f64;
            let nf = n as f64;
            assert_eq!(e(ZeroStage::Replicated), 16 * psi);
            assert!(close(e(ZeroStage::Zero1), 4.0 * p + 12.0 * p / nf));
            assert!(close(e(ZeroStage::Zero2), 2.0 * p + 14.0 * p / nf));
            assert!(close(e(ZeroStage::Zero3), 16.0 * p / nf));
        }
        // the paper's headline: 7.5B parameters, N = 64, ZeRO-3 -> 1.88 GB
        let mut p75 = plan(ZeroStage::Zero3, 64);
        p75.shape = ModelShape::gpt(32, 4096, 32, 2048, 50257);
        let ms = p75.estimate().unwrap().model_states() as f64;
        let psi = p75.shape.params() as f64;
        assert!((ms - 16.0 * psi / 64.0).abs() < 8.0);
    }

    #[test]
    fn tensor_parallel_splits_most_parameters() {
        let s = gpt3();
        assert_eq!(s.params_per_tp_rank(1), s.params());
        let per8 = s.params_per_tp_rank(8);
        assert!(per8 > s.params() / 8 && per8 < s.params() / 8 + s.params() / 100);
    }

    #[test]
    fn frozen_parameters_cost_only_their_weights() {
        let psi = gpt3().params();
        let lora = 37_748_736; // rank 16 on q, k, v, o of GPT-3's 96 blocks
        let p = plan(ZeroStage::Replicated, 8);
        let e = p.estimate_frozen(psi, lora).unwrap();
        // 2 bytes of every frozen weight, 2 + 2 + 12 bytes of each adapter parameter
        assert_eq!(e.model_states(), 2 * psi + 16 * lora);
        assert_eq!(p.estimate_frozen(0, psi).unwrap(), p.estimate().unwrap());
        let err = p.estimate_frozen(psi + 1, 0).unwrap_err().to_string();
        assert!(err.contains("frozen parameters"), "{err}");
    }

    #[test]
    fn recomputation_cuts_activations() {
        let mut p = plan(ZeroStage::Zero1, 8);
        let with = p.activation_bytes();
        p.recompute = RecomputePolicy::EveryKth(4);
        let quarter = p.activation_bytes();
        p.recompute = RecomputePolicy::None;
        let without = p.activation_bytes();
        assert!(with * 10 < without, "{with} vs {without}");
        // one block in four recomputed (24 of 96): the other 72 keep all their activations,
        // the 24 their inputs, plus one block's activations during a recomputation
        // (with every block: 96 inputs + one block + ends; without: 96 blocks + ends)
        let s = p.shape;
        let layer_input = 2 * s.ctx * p.micro_batch * s.d_model;
        let per_layer = (without - with + 96 * layer_input) / 95;
        let ends = without - 96 * per_layer;
        assert_eq!(quarter, 24 * layer_input + 73 * per_layer + ends);
        assert!(with < quarter && quarter < without);
        // selective in every block: 2 of the 4 replicated s·b·h and 8 of the 12 split ones
        // (t = 1 here), no scores
        p.recompute = RecomputePolicy::Selective(1);
        let selective = p.activation_bytes();
        assert_eq!(selective, 96 * 10 * layer_input + ends);
        assert!(with < selective && selective < without);
        p.recompute = RecomputePolicy::Selective(4);
        let one_in_four = p.activation_bytes();
        assert_eq!(one_in_four, 24 * 10 * layer_input + 72 * per_layer + ends);
    }

    #[test]
    fn sequence_parallelism_splits_every_activation_over_tp() {
        // with the rows split too, every activation of a rank is the tp = 1 count over t
        for policy in [RecomputePolicy::None, RecomputePolicy::EveryBlock] {
            let mut p = plan(ZeroStage::Zero1, 8);
            p.recompute = policy;
            let whole = p.activation_bytes();
            p.tp = 8;
            let plain = p.activation_bytes();
            p.sequence_parallel = true;
            let split = p.activation_bytes();
            assert_eq!(split, whole / 8, "{policy:?}");
            assert!(
                split < plain && plain < whole,
                "{policy:?}: {split} {plain} {whole}"
            );
        }
    }

    fn llama(tp: u64, recompute: RecomputePolicy, sequence_parallel: bool) -> MemoryPlan {
        MemoryPlan {
            // Llama 3 70B
            shape: ModelShape::llama(80, 8192, 64, 8, 28_672, 8192, 128_256),
            tp,
            recompute,
            sequence_parallel,
            ..plan(ZeroStage::Zero1, 8)
        }
    }

    #[test]
    fn llama_activations_follow_its_block() {
        let (s, b, h, a, kd, f, v) = (
            8192u64, 1u64, 8192u64, 64u64, 1024u64, 28_672u64, 128_256u64,
        );
        // 16-bit, t = 1: the embedding output, the logits and their gradient
        let ends = 2 * s * b * h + 2 * 2 * s * b * v;
        // the RMSNorm inputs and outputs (4h), q, the attention output and the rotary input
        // of q (3h), k, v and the rotary input of k (3·kd), gate|up and the SwiGLU output (3f),
        // the scores and probabilities
        let layer = 2 * s * b * (7 * h + 3 * kd + 3 * f) + 4 * a * s * s * b;
        assert_eq!(
            llama(1, RecomputePolicy::None, false).activation_bytes(),
            80 * layer + ends
        );
        // every block recomputed: 80 inputs, one block while it runs again
        assert_eq!(
            llama(1, RecomputePolicy::EveryBlock, false).activation_bytes(),
            80 * 2 * s * b * h + layer + ends
        );
        // selective: the RMSNorm outputs, the SwiGLU output and the scores are dropped; the
        // RMSNorm inputs (2h), q, its rotary input and the attention output (3h), k, v and
        // k's rotary input (3·kd) and gate|up (2f) stay
        let kept = 2 * s * b * (2 * h + 3 * h + 3 * kd + 2 * f);
        assert_eq!(
            llama(1, RecomputePolicy::Selective(1), false).activation_bytes(),
            80 * kept + ends
        );
        // t = 8 divides the 8 key/value heads: everything but the norms is split, and with
        // sequence parallelism the norms too
        for policy in [RecomputePolicy::None, RecomputePolicy::Selective(1)] {
            let whole = llama(1, policy, false).activation_bytes();
            let split = llama(8, policy, true).activation_bytes();
            assert_eq!(split, whole / 8, "{policy:?}");
        }
        // t = 16 replicates them: a rank computes one key/value head (k, v and k's rotary
        // input: 3·128 columns), not a sixteenth of 8
        let none16 = llama(16, RecomputePolicy::None, true).activation_bytes();
        let rep16 = 2 * s * b * (7 * h + 3 * f) / 16 + 2 * s * b * 3 * 128 + 4 * a * s * s * b / 16;
        assert_eq!(none16, 80 * rep16 + ends / 16);
    }

    #[test]
    fn llama_degrees_must_fit_the_key_value_heads() {
        let ok = |tp| llama(tp, RecomputePolicy::EveryBlock, false).estimate();
        for tp in [1, 2, 4, 8, 16, 32, 64] {
            assert!(ok(tp).is_ok(), "tp {tp}");
        }
        // 48 query heads of 128 sharing 16 key/value heads: 12 divides the query heads and
        // the width, but neither divides the key/value heads nor is a multiple of them
        let mut p = llama(12, RecomputePolicy::EveryBlock, false);
        (p.shape.d_model, p.shape.n_heads, p.shape.n_kv_heads) = (6144, 48, Some(16));
        let e = p.estimate().unwrap_err().to_string();
        assert!(e.contains("(12)") && e.contains("n_kv_heads (16)"), "{e}");
        p.shape.n_kv_heads = Some(5);
        let e = p.estimate().unwrap_err().to_string();
        assert!(e.contains("n_kv_heads (5) must divide n_heads (48)"), "{e}");
    }

    #[test]
    fn invalid_degrees_name_every_factor() {
        let mut p = plan(ZeroStage::Zero1, 8);
        p.tp = 5;
        let e = p.estimate().unwrap_err().to_string();
        assert!(
            e.contains("(5)") && e.contains("(96)") && e.contains("(12288)"),
            "{e}"
        );
        p.tp = 1;
        p.dp = 0;
        assert!(p.estimate().unwrap_err().to_string().contains("dp"));
    }
}
