//! SwiGLU ([`SwiGlu`]): `silu(gate) * up` on the fused gate and up projections' output, the
//! Llama family's MLP activation, and its backward.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::SwiGlu;

/// `x [.., 2n] -> silu(x[.., :n]) * x[.., n:]` `[.., n]` (`silu(g) = g sigmoid(g)`): the first
/// half of the last dimension is the gate projection's output, the second the up
/// projection's, as one fused product gives them. A float tensor (f32, f64, f16, bf16; half
/// types compute in f32), with a backward to `x`. Recorded on kiln-memory's tape as cheap to
/// recompute (a selective checkpoint drops its output, as it drops the GELU's).
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Var};
/// let x = Var::new(&[[1f32, -1.0, 2.0, 4.0]], &Device::Cpu)?;
/// let y = kiln_model::ops::swiglu(&x)?;
/// assert_eq!(y.dims(), &[1, 2]);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&x).map(|g| g.dims().to_vec()), Some(vec![1, 4]));
/// # Ok(()) }
/// ```
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu";
    match x.dims().last() {
        Some(&w) if w > 0 && w % 2 == 0 => {}
        _ => {
            return Err(ModelError::Shape {
                op: OP,
                what: "x (the fused gate and up projections)",
                expected: "[.., 2n] with n > 0".into(),
                got: format!("{:?}", x.dims()),
            })
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
    let x = x.contiguous()?;
    Ok(kiln_memory::tape::recomputable(|| {
        kiln_memory::tape::apply_op1(&x, SwiGlu)
    })?)
}
