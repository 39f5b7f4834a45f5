//! Fused causal attention, `softmax(scale * q k^T, causal) v`, without the `t x t` score matrix,
//! and its backward: the inputs checked, then kiln-kernels' ops ([`CausalAttention`],
//! [`PackedAttention`]) recorded on kiln-memory's tape.

use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::{CausalAttention, PackedAttention, MAX_CUDA_HEAD_DIM};

const OP: &str = "causal_attention";

/// Causal attention of `q`, `k`, `v` of shape `[batch, heads, seq, head_dim]`: row `i` of the
/// output is `sum_j p_ij v_j` over the keys `j <= i`, with `p_i = softmax(scale * q_i . k_j)`.
/// The same as `causal_softmax_scaled(q.matmul(k.t()), scale).matmul(v)` up to rounding, but
/// fused: no `seq x seq` matrix exists in the forward or the backward, which recomputes the
/// probabilities from one logsumexp per row. f32, f64, f16 and bf16 (half types compute in
/// f32); on CUDA f32, f16 and bf16 with `head_dim <= 256`. Gradients reach `q`, `k` and `v`.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let q = Tensor::new(&[[[[1f32, 0.], [0., 1.]]]], &Device::Cpu)?; // [1, 1, 2, 2]
/// let v = Tensor::new(&[[[[1f32, 2.], [3., 4.]]]], &Device::Cpu)?;
/// let y = kiln_model::ops::causal_attention(&q, &q, &v, 1.0)?;
/// // row 0 sees only key 0; row 1 weighs keys 0 and 1 by softmax([0, 1])
/// let p = 1.0 / (1.0 + (-1f32).exp());
/// let r = y.flatten_all()?.to_vec1::<f32>()?;
/// assert_eq!(&r[..2], &[1., 2.]);
/// assert!((r[2] - (1. + 2. * p)).abs() < 1e-6 && (r[3] - (2. + 2. * p)).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = q.dims();
    if dims.len() != 4 || dims.contains(&0) {
        return Err(ModelError::Shape {
            op: OP,
            what: "q",
            expected: "[batch, heads, seq, head_dim] with no zero size".into(),
            got: format!("{dims:?}"),
        });
    }
    for (what, t) in [("k", k), ("v", v)] {
        if t.dims() != dims {
            return Err(ModelError::Shape {
                op: OP,
                what,
                expected: format!("{dims:?}, the shape of q"),
                got: format!("{:?}", t.dims()),
            });
        }
    }
    let cuda = q.device().is_cuda();
    let dtype_ok = if cuda {
        matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
    } else {
        is_float(q.dtype())
    };
    if !dtype_ok {
        return Err(ModelError::Dtype {
            op: OP,
            what: "q",
            expected: if cuda {
                "f32, f16 or bf16"
            } else {
                FLOAT_DTYPES
            },
            got: q.dtype(),
        });
    }
    for (what, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            return Err(ModelError::Dtype {
                op: OP,
                what,
                expected: "the dtype of q",
                got: t.dtype(),
            });
        }
    }
    if cuda && dims[3] > MAX_CUDA_HEAD_DIM {
        return Err(ModelError::Shape {
            op: OP,
            what: "q",
            expected: format!("head_dim <= {MAX_CUDA_HEAD_DIM} on CUDA"),
            got: format!("{dims:?}"),
        });
    }
    if !scale.is_finite() {
        return Err(ModelError::InvalidArgument {
            op: OP,
            what: "scale",
            value: scale,
            expected: "a finite number",
        });
    }
    let op = CausalAttention::new(scale);
    Ok(kiln_memory::tape::apply_op3(
        &q.contiguous()?,
        &k.contiguous()?,
        &v.contiguous()?,
        op,
    )?)
}

const PACKED_OP: &str = "causal_attention_packed";

/// [`causal_attention`] straight from a fused QKV projection's output: `qkv` `[batch, seq, 3 *
/// heads * head_dim]` holds each token's queries, keys and values for every head, in that
/// order (`[b, t, 3, heads, head_dim]`, how the model's `c_attn` writes them); the result is
/// `[batch, seq, heads * head_dim]`, the heads side by side, ready for the output projection.
///
/// The same numbers as splitting, permuting and calling [`causal_attention`], bitwise, but on
/// the CPU it is one graph node: the kernels read the rows where they are, so no permuted copy
/// exists, and the backward writes the gradient of `qkv` once instead of passing it back
/// through a dozen reshapes, copies and narrows (each of which fills and adds a buffer of its
/// own). On other devices it runs that composite.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let qkv = Tensor::randn(0f32, 1.0, (2, 5, 3 * 4 * 8), &Device::Cpu)?; // 4 heads of 8
/// let y = kiln_model::ops::causal_attention_packed(&qkv, 4, 0.125)?;
/// assert_eq!(y.dims(), &[2, 5, 32]);
/// # Ok(()) }
/// ```
pub fn causal_attention_packed(qkv: &Tensor, heads: usize, scale: f64) -> Result<Tensor> {
    let (b, t, width) = match *qkv.dims() {
        [b, t, w] if b > 0 && t > 0 && heads > 0 && w > 0 && w % (3 * heads) == 0 => (b, t, w),
        ref d => {
            return Err(ModelError::Shape {
                op: PACKED_OP,
                what: "qkv",
                expected: format!("[batch, seq, 3 * {heads} heads * head_dim] with no zero size"),
                got: format!("{d:?}"),
            })
        }
    };
    let dh = width / (3 * heads);
    if !qkv.device().is_cpu() {
        let qkv = qkv
            .reshape((b, t, 3, heads, dh))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let y = causal_attention(&q, &k, &v, scale)?;
        return Ok(y
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, t, heads * dh))?);
    }
    if !is_float(qkv.dtype()) {
        return Err(ModelError::Dtype {
            op: PACKED_OP,
            what: "qkv",
            expected: FLOAT_DTYPES,
            got: qkv.dtype(),
        });
    }
    if !scale.is_finite() {
        return Err(ModelError::InvalidArgument {
            op: PACKED_OP,
            what: "scale",
            value: scale,
            expected: "a finite number",
        });
    }
    let op = PackedAttention::new(heads, scale);
    Ok(kiln_memory::tape::apply_op1(&qkv.contiguous()?, op)?)
}
