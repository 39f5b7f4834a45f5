//! Layer normalisation over the last dimension, with gain and bias ([`LayerNorm`]), and its
//! backward.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::LayerNorm;

/// `y = (x - mean) / sqrt(var + eps) * weight + bias` over the last dimension of `x`, with
/// `weight` and `bias` of shape `[d]`, all of one float dtype (f32, f64, f16, bf16; half types
/// compute in f32).
///
/// Unlike `candle_nn::ops::layer_norm`, this op has a backward: gradients reach `x`, `weight`
/// and `bias` (the gain and bias gradients are column sums computed in parallel).
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor, Var};
/// let x = Var::new(&[[1f32, 2., 3.], [2., 2., 5.]], &Device::Cpu)?;
/// let w = Var::new(&[1f32, 1., 1.], &Device::Cpu)?;
/// let b = Var::new(&[0f32, 0., 0.], &Device::Cpu)?;
/// let y = kiln_model::ops::layer_norm(&x, &w, &b, 0.0)?;
/// let r0 = y.get(0)?.to_vec1::<f32>()?;
/// assert!((r0[0] + 1.2247449).abs() < 1e-5 && r0[1].abs() < 1e-6);
/// let grads = y.get(0)?.get(2)?.backward()?;
/// assert_eq!(grads.get(&b).ok_or_else(|| anyhow::anyhow!("no gradient for b"))?.to_vec1::<f32>()?, vec![0., 0., 1.]);
/// # Ok(()) }
/// ```
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    layer_norm_shaped(x, weight, bias, eps, false)
}

/// [`layer_norm`] with its output as rows `[n, d]` (every leading dimension of `x` in `n`):
/// what a product over rows takes, without a reshape, which would be a graph node of its own
/// (a zero-filled gradient buffer and an addition in candle's backward, and an op no segment
/// tape records). The gradient of `x` keeps `x`'s shape.
pub fn layer_norm_rows(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    layer_norm_shaped(x, weight, bias, eps, true)
}

fn layer_norm_shaped(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    rows: bool,
) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let d = match x.dims().last() {
        Some(&d) if d > 0 => d,
        _ => {
            return Err(ModelError::Shape {
                op: OP,
                what: "x",
                expected: "[.., d] with d > 0".into(),
                got: format!("{:?}", x.dims()),
            })
        }
    };
    for (what, t) in [("weight", weight), ("bias", bias)] {
        if t.dims() != [d] {
            return Err(ModelError::Shape {
                op: OP,
                what,
                expected: format!("[{d}]"),
                got: format!("{:?}", t.dims()),
            });
        }
        if t.dtype() != x.dtype() {
            return Err(ModelError::Dtype {
                op: OP,
                what,
                expected: "the dtype of x",
                got: t.dtype(),
            });
        }
    }
    if !is_float(x.dtype()) {
        return Err(ModelError::Dtype {
            op: OP,
            what: "x",
            expected: FLOAT_DTYPES,
            got: x.dtype(),
        });
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(ModelError::InvalidValue {
            field: "eps",
            value: eps,
            expected: "finite and >= 0",
        });
    }
    let (x, weight, bias) = (x.contiguous()?, weight.contiguous()?, bias.contiguous()?);
    // cheap to run again against the activation it keeps: a selective checkpoint drops it
    Ok(kiln_memory::tape::recomputable(|| {
        kiln_memory::tape::apply_op3(&x, &weight, &bias, LayerNorm { eps, rows })
    })?)
}
