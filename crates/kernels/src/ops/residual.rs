//! The residual addition `x + y` as one op, so a transformer block is kiln's ops alone and its
//! backward can run from a segment's tape.

use crate::custom_op::{contiguous, same_type, Elem};
use crate::error::mismatch;
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

/// `x + y` for two contiguous CPU tensors of one shape and float dtype: bitwise candle's
/// addition, forward and backward (each input gets the output's gradient).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
/// let y = Tensor::new(&[0.5f32, -4.0], &Device::Cpu)?;
/// let z = x.apply_op2(&y, kiln_kernels::ops::ResidualAdd)?;
/// assert_eq!(z.to_vec1::<f32>()?, vec![1.5, -2.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ResidualAdd;

impl CustomOp2 for ResidualAdd {
    fn name(&self) -> &'static str {
        "kiln-residual-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        with_float_storage!(s1, op, |xs| {
            let x = contiguous(xs, l1, op)?;
            let y = contiguous(same_type(x, s2, op)?, l2, op)?;
            if x.len() != y.len() {
                return Err(mismatch(
                    op,
                    format!("{} and {} elements", x.len(), y.len()),
                ));
            }
            let out = super::gelu::map2(x, y, |a, b| Elem::store(a.load() + b.load()))?;
            Ok((Elem::into_storage(out), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}
