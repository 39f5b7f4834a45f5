//! The root of a segment's backward when its output's gradient is given.

use crate::error::Result;
use candle_core::Tensor;

/// A scalar whose backward hands `grad` to `out`: the root of a segment's backward when the
/// gradient of its output is known (what PyTorch's `out.backward(grad)` does). Candle starts a
/// backward only from a tensor, and `(out * grad).sum()` costs a product, a reduction, a
/// broadcast and a second product of `out`'s size per segment; this op passes `grad` on as it
/// is.
pub(super) fn seeded(out: &Tensor, grad: Tensor) -> Result<Tensor> {
    Ok(out.apply_op1_arc(std::sync::Arc::new(Box::new(Seed { grad })))?)
}

/// See [`seeded`]. The forward is a zero scalar of `out`'s dtype on its device.
struct Seed {
    grad: Tensor,
}

impl candle_core::CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "kiln-segment-seed"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        _l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let shape = candle_core::Shape::from(());
        let zero = s.device().zeros_impl(&shape, s.dtype())?;
        Ok((zero, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let shape = candle_core::Shape::from(());
        let zero = s.device().zeros_impl(&shape, s.dtype())?;
        Ok((zero, shape))
    }

    fn bwd(
        &self,
        out: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        if self.grad.shape() != out.shape() {
            return Err(candle_core::Error::msg(format!(
                "segment backward: the output gradient is {:?}, the output {:?}",
                self.grad.dims(),
                out.dims()
            )));
        }
        // the root's gradient is one; anything else scales the seed
        let g = self.grad.to_dtype(out.dtype())?;
        let one = grad_res
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
        Ok(Some(if one == 1.0 { g } else { g.affine(one, 0.0)? }))
    }
}
