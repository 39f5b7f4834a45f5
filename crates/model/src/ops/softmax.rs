//! Causal-masked softmax over the last dimension ([`CausalSoftmax`]), with its backward.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::CausalSoftmax;

/// Causal softmax of attention scores `x` of shape `[.., tq, tk]` (`tq <= tk`): row `i` is a
/// softmax over the positions `j <= i + (tk - tq)`; the masked positions are exactly zero.
/// For square scores (`tq == tk`) this is the usual lower-triangular mask.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[0f32, 5.], [0., 0.]], &Device::Cpu)?;
/// let y = kiln_model::ops::causal_softmax(&x)?;
/// assert_eq!(y.to_vec2::<f32>()?, vec![vec![1., 0.], vec![0.5, 0.5]]);
/// # Ok(()) }
/// ```
pub fn causal_softmax(x: &Tensor) -> Result<Tensor> {
    causal_softmax_scaled(x, 1.0)
}

/// [`causal_softmax`] of `scale * x`: the attention layer folds `1/sqrt(head_dim)` in here
/// instead of scaling the scores with a separate op.
pub fn causal_softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    const OP: &str = "causal_softmax";
    let dims = x.dims();
    let ok = dims.len() >= 2 && dims[dims.len() - 2] <= dims[dims.len() - 1];
    if !ok || dims.contains(&0) {
        return Err(ModelError::Shape {
            op: OP,
            what: "x",
            expected: "[.., tq, tk] with 0 < tq <= tk".into(),
            got: format!("{dims:?}"),
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
    if !scale.is_finite() {
        return Err(ModelError::InvalidValue {
            field: "scale",
            value: scale,
            expected: "finite",
        });
    }
    Ok(kiln_memory::tape::apply_op1(
        &x.contiguous()?,
        CausalSoftmax { scale },
    )?)
}
