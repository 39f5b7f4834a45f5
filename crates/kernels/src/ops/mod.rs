//! The fused ops: each a candle custom op with a fused CPU forward (f32, f64, f16 and bf16
//! storage; half types compute in f32), a backward built from a second fused kernel, and (with
//! the `cuda` feature) the same pair on CUDA (the `cuda` module).
//!
//! - [`LayerNorm`], [`CausalSoftmax`], [`Gelu`], [`BiasGelu`], [`CrossEntropy`] and
//!   [`ResidualAdd`]: candle's own `softmax_last_dim` and `layer_norm` build no backward node
//!   on contiguous input, so training through them silently leaves the weights unchanged.
//! - [`CausalAttention`] fuses the whole attention product (scores, causal softmax, values)
//!   without materialising the `seq x seq` scores; [`PackedAttention`] reads it straight from a
//!   fused QKV projection's output, and [`GroupedAttention`] from three projections' outputs
//!   with fewer key/value heads than query heads (grouped-query and multi-query attention).
//! - [`RmsNorm`], [`SwiGlu`], [`Rotary`] and [`RepeatKv`]: the Llama family's normalisation,
//!   gated MLP activation, rotary position embedding and grouped-query attention's shared key
//!   and value heads; their CUDA kernels (`cuda::llama`) compile for sm_90 but no GPU has run
//!   them yet.
//! - [`vocab`]: the row statistics of a cross-entropy over a vocabulary split across ranks, and
//!   the LM head fused with its loss.
//!
//! The ops take their inputs as given (contiguous, of one float dtype) and report a mismatch as
//! an error; kiln-model's `ops` functions check the inputs, name what is wrong, and record the
//! ops on kiln-memory's tape for the segmented backward.

mod attention;
mod cross_entropy;
mod gelu;
mod layer_norm;
mod repeat_kv;
mod residual;
mod rms_norm;
mod rotary;
mod softmax;
mod swiglu;
pub mod vocab;

pub use attention::{CausalAttention, GroupedAttention, PackedAttention, MAX_CUDA_HEAD_DIM};
pub use cross_entropy::CrossEntropy;
pub use gelu::{BiasGelu, Gelu};
pub use layer_norm::LayerNorm;
pub use repeat_kv::RepeatKv;
pub use residual::ResidualAdd;
pub use rms_norm::RmsNorm;
pub use rotary::{Rotary, RotaryLayout};
pub use softmax::CausalSoftmax;
pub use swiglu::SwiGlu;
