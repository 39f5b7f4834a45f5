//! Trainable fused ops: each checks its inputs (a [`ModelError`](crate::ModelError) naming what
//! is wrong), then applies kiln-kernels' custom op (`kiln_kernels::ops`: a fused CPU forward in
//! f32, f64, f16 or bf16 storage, half types computing in f32, a backward built from a second
//! fused kernel, and their CUDA kernels) through kiln-memory's tape, so a segment's backward
//! can run from it. [`causal_attention`] fuses the whole attention product (scores, causal
//! softmax, values) without materialising the `seq x seq` scores; [`grouped_attention`] runs
//! it with fewer key/value heads than query heads, from the projections' outputs as they are.
//!
//! candle's own `softmax_last_dim` and `layer_norm` build no backward node on contiguous
//! input, so training through them silently leaves the weights unchanged; the model uses these
//! instead. [`reference`](mod@crate::reference) holds composite equivalents for comparison.

mod attention;
mod cross_entropy;
mod gelu;
mod layer_norm;
mod repeat_kv;
mod residual;
mod rms_norm;
pub(crate) mod rotary;
mod softmax;
mod swiglu;

pub use attention::{causal_attention, causal_attention_packed, grouped_attention};
pub use cross_entropy::cross_entropy;
pub use gelu::{bias_gelu, gelu};
pub use layer_norm::{layer_norm, layer_norm_rows};
pub use repeat_kv::repeat_kv;
pub use residual::residual_add;
pub use rms_norm::{rms_norm, rms_norm_rows};
pub use rotary::{rotary, rotary_inv_freq, rotary_table, Llama3Scaling, RotaryLayout};
pub use softmax::{causal_softmax, causal_softmax_scaled};
pub use swiglu::swiglu;
