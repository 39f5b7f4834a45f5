//! Fused causal attention, `softmax(scale * q k^T, causal) v`, without the `t x t` score matrix,
//! and its backward: the inputs checked, then kiln-kernels' ops ([`CausalAttention`],
//! [`PackedAttention`], [`GroupedAttention`]) recorded on kiln-memory's tape.

use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::{CausalAttention, GroupedAttention, PackedAttention, MAX_CUDA_HEAD_DIM};

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

const GROUPED_OP: &str = "grouped_attention";

/// Grouped-query causal attention (Llama's GQA) from three projections' outputs: `q` `[batch,
/// seq, heads * head_dim]`, `k` and `v` `[batch, seq, kv_heads * head_dim]`; the result is
/// `[batch, seq, heads * head_dim]`, the heads side by side, ready for the output projection.
/// Query head `h` attends with key/value head `h / (heads / kv_heads)` (Hugging Face's
/// `repeat_kv` grouping), the scores scaled by `scale`; `kv_heads == heads` is multi-head
/// attention, `kv_heads == 1` multi-query attention. Gradients reach `q`, `k` and `v`.
///
/// The same numbers as permuting to `[batch, heads, seq, head_dim]`, [`repeat_kv`] on `k` and
/// `v` and [`causal_attention`], bitwise (forward and gradients, every float dtype), but on the
/// CPU one graph node: the kernels read each head's rows where they are, no key/value head is
/// repeated, and the backward writes each input's gradient once, a key/value head's the sum of
/// its query heads' in head order. On other devices it runs that composite.
///
/// [`repeat_kv`]: crate::ops::repeat_kv
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let q = Tensor::randn(0f32, 1.0, (2, 5, 8 * 16), &Device::Cpu)?; // 8 query heads of 16
/// let k = Tensor::randn(0f32, 1.0, (2, 5, 2 * 16), &Device::Cpu)?; // 2 key/value heads
/// let v = Tensor::randn(0f32, 1.0, (2, 5, 2 * 16), &Device::Cpu)?;
/// let y = kiln_model::ops::grouped_attention(&q, &k, &v, 8, 2, 0.25)?;
/// assert_eq!(y.dims(), &[2, 5, 128]);
/// // the first position sees only itself: query heads 0 to 3 give value head 0's row
/// let first = y.get(0)?.get(0)?.narrow(0, 0, 16)?.to_vec1::<f32>()?;
/// assert_eq!(first, v.get(0)?.get(0)?.narrow(0, 0, 16)?.to_vec1::<f32>()?);
/// # Ok(()) }
/// ```
pub fn grouped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
    scale: f64,
) -> Result<Tensor> {
    let op = GROUPED_OP;
    for (what, n) in [("heads", heads), ("kv_heads", kv_heads)] {
        if n == 0 {
            return Err(ModelError::InvalidArgument {
                op,
                what,
                value: 0.0,
                expected: "> 0",
            });
        }
    }
    if heads % kv_heads != 0 {
        return Err(ModelError::KvHeadsDoNotDivide {
            op,
            heads,
            kv_heads,
        });
    }
    let (b, t, dh) = match *q.dims() {
        [b, t, w] if b > 0 && t > 0 && w > 0 && w % heads == 0 => (b, t, w / heads),
        ref d => {
            return Err(ModelError::Shape {
                op,
                what: "q",
                expected: format!("[batch, seq, {heads} heads * head_dim] with no zero size"),
                got: format!("{d:?}"),
            })
        }
    };
    for (what, x) in [("k", k), ("v", v)] {
        if x.dims() != [b, t, kv_heads * dh] {
            return Err(ModelError::Shape {
                op,
                what,
                expected: format!(
                    "[{b}, {t}, {}]: q's batch and seq, {kv_heads} kv_heads of q's head_dim {dh}",
                    kv_heads * dh
                ),
                got: format!("{:?}", x.dims()),
            });
        }
    }
    for (what, x) in [("k", k), ("v", v)] {
        if x.dtype() != q.dtype() {
            return Err(ModelError::Dtype {
                op,
                what,
                expected: "the dtype of q",
                got: x.dtype(),
            });
        }
    }
    if !scale.is_finite() {
        return Err(ModelError::InvalidArgument {
            op,
            what: "scale",
            value: scale,
            expected: "a finite number",
        });
    }
    if !q.device().is_cpu() {
        // the dtypes and head_dim CUDA takes are causal_attention's to check
        return grouped_composite(q, k, v, (heads, kv_heads), scale);
    }
    if !is_float(q.dtype()) {
        return Err(ModelError::Dtype {
            op,
            what: "q",
            expected: FLOAT_DTYPES,
            got: q.dtype(),
        });
    }
    let op = GroupedAttention::new(heads, kv_heads, scale);
    Ok(kiln_memory::tape::apply_op3(
        &q.contiguous()?,
        &k.contiguous()?,
        &v.contiguous()?,
        op,
    )?)
}

/// [`grouped_attention`] as the composite it replaces on the CPU (and runs elsewhere): the heads
/// permuted to the front, [`repeat_kv`](crate::ops::repeat_kv), [`causal_attention`], and the
/// heads back side by side. The shapes checked by the caller.
fn grouped_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (heads, kv_heads): (usize, usize),
    scale: f64,
) -> Result<Tensor> {
    let (b, t, w) = q.dims3()?;
    let dh = w / heads;
    let heads_first = |x: &Tensor, n: usize| -> Result<Tensor> {
        Ok(x.reshape((b, t, n, dh))?.transpose(1, 2)?.contiguous()?)
    };
    let groups = heads / kv_heads;
    let kr = crate::ops::repeat_kv(&heads_first(k, kv_heads)?, groups)?;
    let vr = crate::ops::repeat_kv(&heads_first(v, kv_heads)?, groups)?;
    let y = causal_attention(&heads_first(q, heads)?, &kr, &vr, scale)?;
    Ok(y.transpose(1, 2)?.contiguous()?.reshape((b, t, w))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// The composite that other devices run is the CPU op's numbers, bitwise, forward and the
    /// three gradients (here both on the CPU).
    #[test]
    fn the_composite_of_other_devices_is_the_fused_op_bitwise() {
        let dev = Device::Cpu;
        let (b, t, heads, kv, dh) = (2, 35, 6, 2, 8);
        let [q, k, v] =
            [heads, kv, kv].map(|n| Var::randn(0f32, 1.0, (b, t, n * dh), &dev).unwrap());
        let r = Tensor::randn(0f32, 1.0, (b, t, heads * dh), &dev).unwrap();
        let run = |y: Tensor| -> Vec<Vec<u32>> {
            let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let gs = [&q, &k, &v].map(|x| g.get(x).unwrap().clone());
            std::iter::once(y)
                .chain(gs)
                .map(|x| {
                    let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    x.iter().map(|v| v.to_bits()).collect()
                })
                .collect()
        };
        let fused = run(grouped_attention(&q, &k, &v, heads, kv, 0.3).unwrap());
        let composite = run(grouped_composite(&q, &k, &v, (heads, kv), 0.3).unwrap());
        assert_eq!(q.dtype(), DType::F32);
        for (what, (a, c)) in ["y", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&composite))
        {
            assert!(a == c, "{what} differs");
        }
    }
}
