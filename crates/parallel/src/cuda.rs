//! The engine's glue to kiln-kernels' CUDA launchers (feature `cuda`): the optimizer's step
//! constants in the kernels' form, a gradient checked against its parameter before it is
//! accumulated, and the write-back into a variable.

use crate::error::{ParallelError, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut};
use candle_core::{CudaDevice, DType, Storage, Tensor, Var};
use kiln_kernels::cuda::{AdamWConsts, WriteFromDevice};
use kiln_optim::StepConsts;

pub(crate) use kiln_kernels::cuda::{delta, scale, square_bins};

/// kiln-optim's constants of one AdamW step as the CUDA kernel takes them.
fn adamw_consts(c: &StepConsts) -> AdamWConsts {
    AdamWConsts {
        decay: c.decay,
        lerp_w: c.lerp_w,
        lerp_w_comp: c.lerp_w_comp,
        beta2: c.beta2,
        one_minus_beta2: c.one_minus_beta2,
        bc2_sqrt: c.bc2_sqrt,
        eps: c.eps,
        neg_step_size: c.neg_step_size,
        small_weight: c.small_weight(),
    }
}

/// One AdamW step over a range of the engine's flat buffers, with kiln-optim's constants:
/// bitwise the values of kiln-optim's CPU kernel.
pub(crate) fn adamw_range(
    dev: &CudaDevice,
    p: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, f32>,
    m: &mut CudaViewMut<'_, f32>,
    v: &mut CudaViewMut<'_, f32>,
    c: &StepConsts,
) -> Result<()> {
    Ok(kiln_kernels::cuda::adamw_range(
        dev,
        p,
        g,
        m,
        v,
        &adamw_consts(c),
    )?)
}

/// Copies (or adds, unless `overwrite`) the gradient `g` of parameter `name` into `dst`, in
/// f32: the device form of [`crate::flat::tensor_into_slice`], bit for bit.
pub(crate) fn accumulate_grad(
    dev: &CudaDevice,
    dst: &mut CudaViewMut<'_, f32>,
    g: &Tensor,
    overwrite: bool,
    name: &str,
) -> Result<()> {
    let n = dst.len();
    if g.elem_count() != n {
        return Err(ParallelError::Param {
            name: name.to_string(),
            expected: format!("a gradient of {n} elements"),
            got: format!("{} elements (shape {:?})", g.elem_count(), g.dims()),
        });
    }
    if n == 0 {
        return Ok(());
    }
    if !matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(ParallelError::Param {
            name: name.to_string(),
            expected: "an f32, f16 or bf16 gradient".into(),
            got: format!("{:?}", g.dtype()),
        });
    }
    let g = g.contiguous()?;
    let (storage, layout) = g.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(ParallelError::Param {
            name: name.to_string(),
            expected: "a gradient on the CUDA device".into(),
            got: format!("a gradient on {:?}", g.device().location()),
        });
    };
    Ok(kiln_kernels::cuda::accumulate_grad(
        dev, dst, cs, layout, overwrite,
    )?)
}

/// Writes device f32 values into a variable on the same device in place, converted to its
/// dtype (device to device; nothing crosses to the host).
pub(crate) fn write_var_from_device(var: &Var, src: &CudaView<'_, f32>) -> Result<()> {
    var.as_tensor().inplace_op1(&WriteFromDevice(src))?;
    Ok(())
}
