//! Root-mean-square normalisation over the last dimension, with a gain ([`RmsNorm`], Llama's
//! `LlamaRMSNorm`), and its backward.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::RmsNorm;

/// `y = x / sqrt(mean(x^2) + eps) * weight` over the last dimension of `x`, with `weight` of
/// shape `[d]`, both of one float dtype (f32, f64, f16, bf16; half types compute in f32): the
/// normalisation of the Llama family, with a backward to `x` and `weight`. Recorded on
/// kiln-memory's tape as cheap to recompute (a selective checkpoint drops its output).
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor, Var};
/// let x = Var::new(&[[3f32, 4.]], &Device::Cpu)?;
/// let w = Var::new(&[1f32, 1.], &Device::Cpu)?;
/// let y = kiln_model::ops::rms_norm(&x, &w, 0.0)?;
/// let r = 12.5f32.sqrt();
/// assert!((y.to_vec2::<f32>()?[0][1] - 4.0 / r).abs() < 1e-6);
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&w).is_some() && grads.get(&x).is_some());
/// # Ok(()) }
/// ```
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_shaped(x, weight, eps, false)
}

/// [`rms_norm`] with its output as rows `[n, d]` (every leading dimension of `x` in `n`), as
/// [`layer_norm_rows`](super::layer_norm_rows) does for LayerNorm. The gradient of `x` keeps
/// `x`'s shape.
pub fn rms_norm_rows(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_shaped(x, weight, eps, true)
}

fn rms_norm_shaped(x: &Tensor, weight: &Tensor, eps: f64, rows: bool) -> Result<Tensor> {
    const OP: &str = "rms_norm";
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
    if weight.dims() != [d] {
        return Err(ModelError::Shape {
            op: OP,
            what: "weight",
            expected: format!("[{d}]"),
            got: format!("{:?}", weight.dims()),
        });
    }
    if !is_float(x.dtype()) {
        return Err(ModelError::Dtype {
            op: OP,
            what: "x",
            expected: FLOAT_DTYPES,
            got: x.dtype(),
        });
    }
    if weight.dtype() != x.dtype() {
        return Err(ModelError::Dtype {
            op: OP,
            what: "weight",
            expected: "the dtype of x",
            got: weight.dtype(),
        });
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(ModelError::InvalidValue {
            field: "eps",
            value: eps,
            expected: "finite and >= 0",
        });
    }
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    // cheap to run again against the activation it keeps: a selective checkpoint drops it
    Ok(kiln_memory::tape::recomputable(|| {
        kiln_memory::tape::apply_op2(&x, &weight, RmsNorm { eps, rows })
    })?)
}
