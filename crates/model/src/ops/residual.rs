//! The residual addition `x + y` as a kiln op ([`ResidualAdd`]), so a transformer block is
//! kiln's ops alone and its backward can run from the segment's tape (see `kiln_memory::tape`).

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::ops::ResidualAdd;

/// `x + y` for two tensors of one shape and float dtype: on the CPU one kiln op (bitwise
/// candle's addition, forward and backward: each input gets the output's gradient), elsewhere
/// candle's addition.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
/// let y = Tensor::new(&[0.5f32, -4.0], &Device::Cpu)?;
/// assert_eq!(kiln_model::ops::residual_add(&x, &y)?.to_vec1::<f32>()?, vec![1.5, -2.0]);
/// # Ok(()) }
/// ```
pub fn residual_add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.shape() != y.shape() || x.dtype() != y.dtype() {
        return Err(ModelError::Shape {
            op: "residual_add",
            what: "the two summands",
            expected: format!("{:?} {:?}", x.dims(), x.dtype()),
            got: format!("{:?} {:?}", y.dims(), y.dtype()),
        });
    }
    if !x.device().is_cpu() {
        return Ok((x + y)?);
    }
    Ok(kiln_memory::tape::apply_op2(
        &x.contiguous()?,
        &y.contiguous()?,
        ResidualAdd,
    )?)
}
