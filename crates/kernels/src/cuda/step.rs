//! The launchers of `step.cu`: the data-parallel engine's optimizer step over flat f32 device
//! buffers (AdamW, gradient accumulation from candle's gradients, the exact squared-norm bins,
//! clipping, the update, the parameter write-back), bitwise what the CPU computes.

use super::{elementwise, err};
use crate::KernelError;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, InplaceOp1, Layout};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kiln_kernels_step.ptx"));
const MODULE: &str = "kiln_kernels_step";

/// The constants of one AdamW step (PyTorch's `_single_tensor_adamw` with its `lerp` and
/// `addcmul`, in f32), as kiln-optim's `StepConsts` holds them for the CPU kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConsts {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `1 - beta1`, the weight of `exp_avg.lerp_(grad, 1 - beta1)`.
    pub lerp_w: f32,
    /// `1 - lerp_w` in f32, for lerp's large-weight branch.
    pub lerp_w_comp: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`.
    pub neg_step_size: f32,
    /// Whether lerp takes its small-weight branch (`m + w (g - m)`) rather than
    /// `g - (g - m)(1 - w)`.
    pub small_weight: bool,
}

fn func(dev: &CudaDevice, name: &str) -> candle_core::Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

/// One AdamW step over device buffers of `p.len()` elements (parameters, gradients, both
/// moments) with the constants `c`: bitwise the values kiln-optim's CPU kernel computes,
/// element by element. A length mismatch is an error naming the buffer and changes nothing.
pub fn adamw_step(
    dev: &CudaDevice,
    p: &mut CudaSlice<f32>,
    g: &CudaSlice<f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    c: &AdamWConsts,
) -> crate::Result<()> {
    adamw_range(
        dev,
        &mut p.slice_mut(..),
        &g.slice(..),
        &mut m.slice_mut(..),
        &mut v.slice_mut(..),
        c,
    )
}

/// [`adamw_step`] over views (a range of flat buffers).
pub fn adamw_range(
    dev: &CudaDevice,
    p: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, f32>,
    m: &mut CudaViewMut<'_, f32>,
    v: &mut CudaViewMut<'_, f32>,
    c: &AdamWConsts,
) -> crate::Result<()> {
    const OP: &str = "adamw_step (cuda)";
    let n = p.len();
    for (what, len) in [
        ("gradients", g.len()),
        ("exp_avg", m.len()),
        ("exp_avg_sq", v.len()),
    ] {
        if len != n {
            return Err(KernelError::Shape {
                op: OP,
                what,
                expected: format!("{n} elements, as the parameters"),
                got: format!("{len} elements"),
            });
        }
    }
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise(OP, n)?;
    let f = func(dev, "adamw_f32")?;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    let (len, small) = (n as u64, i32::from(c.small_weight));
    l.arg(p).arg(g).arg(m).arg(v).arg(&len);
    l.arg(&c.decay)
        .arg(&c.lerp_w)
        .arg(&c.lerp_w_comp)
        .arg(&c.beta2);
    l.arg(&c.one_minus_beta2)
        .arg(&c.bc2_sqrt)
        .arg(&c.eps)
        .arg(&c.neg_step_size);
    l.arg(&small);
    // SAFETY: the arguments match `adamw_f32` in step.cu; every buffer holds n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// Copies (or adds, unless `overwrite`) the contiguous f32, f16 or bf16 values `g` and its
/// layout `layout` hold into `dst`, in f32: the device form of a gradient copied into a flat
/// buffer, bit for bit the host's.
pub fn accumulate_grad(
    dev: &CudaDevice,
    dst: &mut CudaViewMut<'_, f32>,
    g: &CudaStorage,
    layout: &Layout,
    overwrite: bool,
) -> crate::Result<()> {
    const OP: &str = "accumulate_grad (cuda)";
    let n = dst.len();
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or(KernelError::NotContiguous {
            op: OP,
            what: "the gradient",
        })?;
    if end - start != n {
        return Err(KernelError::Shape {
            op: OP,
            what: "the gradient",
            expected: format!("{n} elements, as the destination"),
            got: format!("{} elements", end - start),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise(OP, n)?;
    let (len, ow) = (n as u64, i32::from(overwrite));
    let stream = dev.cuda_stream();
    macro_rules! go {
        ($kernel:literal, $src:expr) => {{
            let f = func(dev, $kernel)?;
            let src = $src.slice(start..end);
            let mut l = stream.launch_builder(&f);
            l.arg(&mut *dst).arg(&src).arg(&len).arg(&ow);
            // SAFETY: `accum_grad_*` in step.cu: dst and src hold n elements.
            unsafe { l.launch(cfg) }.w()?;
        }};
    }
    match &g.slice {
        CudaStorageSlice::F32(s) => go!("accum_grad_f32", s),
        CudaStorageSlice::F16(s) => go!("accum_grad_f16", s),
        CudaStorageSlice::BF16(s) => go!("accum_grad_bf16", s),
        _ => {
            return Err(KernelError::Dtype {
                op: OP,
                what: "the gradient",
                expected: "f32, f16 or bf16",
                got: candle_core::backend::BackendStorage::dtype(g),
            })
        }
    }
    Ok(())
}

/// Bins the squares of `x` (after multiplying it in place by `inv` when given) into `bins`
/// (512 integers: see `square_bins` in step.cu and kiln-optim's `SquareSum::add_bins`) and ORs
/// NaN (1) and infinity (2) into `flags[0]`.
pub fn square_bins(
    dev: &CudaDevice,
    x: &mut CudaViewMut<'_, f32>,
    inv: Option<f32>,
    bins: &mut CudaViewMut<'_, u64>,
    flags: &mut CudaViewMut<'_, u32>,
) -> crate::Result<()> {
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    if bins.len() < 512 || flags.is_empty() {
        return Err(KernelError::Shape {
            op: "square_bins (cuda)",
            what: "bins and flags",
            expected: "512 bins and a flag".into(),
            got: format!("{} bins and {} flags", bins.len(), flags.len()),
        });
    }
    // a grid-stride loop over at most 1024 blocks: each flushes its 512 bins once
    let blocks = n.div_ceil(256).min(1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = func(dev, "square_bins")?;
    let (len, factor, scale) = (n as u64, inv.unwrap_or(1.0), i32::from(inv.is_some()));
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    l.arg(x).arg(&len).arg(&factor).arg(&scale);
    l.arg(bins).arg(flags);
    // SAFETY: `square_bins` in step.cu: x holds n floats, bins 512 u64, flags one u32
    // (checked above).
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// `g *= coef` (clipping).
pub fn scale(dev: &CudaDevice, g: &mut CudaViewMut<'_, f32>, coef: f32) -> crate::Result<()> {
    let n = g.len();
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise("scale (cuda)", n)?;
    let f = func(dev, "scale_f32")?;
    let len = n as u64;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    l.arg(g).arg(&len).arg(&coef);
    // SAFETY: `scale_f32` in step.cu: g holds n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// `old = now - old` (the update of a step).
pub fn delta(
    dev: &CudaDevice,
    old: &mut CudaViewMut<'_, f32>,
    now: &CudaView<'_, f32>,
) -> crate::Result<()> {
    const OP: &str = "delta (cuda)";
    let n = old.len();
    if n != now.len() {
        return Err(KernelError::Shape {
            op: OP,
            what: "the new values",
            expected: format!("{n} elements, as the old"),
            got: format!("{} elements", now.len()),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise(OP, n)?;
    let f = func(dev, "delta_f32")?;
    let len = n as u64;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    l.arg(old).arg(now).arg(&len);
    // SAFETY: `delta_f32` in step.cu: both hold n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// Writes device f32 values into a tensor on the same device in place, converted to its dtype
/// (f32, f16 or bf16; device to device, nothing crosses to the host): the parameter
/// write-back, applied with `Tensor::inplace_op1` to a variable's tensor.
#[derive(Debug)]
pub struct WriteFromDevice<'a, 'b>(pub &'a CudaView<'b, f32>);

impl InplaceOp1 for WriteFromDevice<'_, '_> {
    fn name(&self) -> &'static str {
        "kiln-write-params-device"
    }

    fn cpu_fwd(
        &self,
        _storage: &mut candle_core::CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<()> {
        Err(KernelError::Device {
            op: self.name(),
            expected: "a variable on the CUDA device of the values",
            got: "a variable on the CPU".into(),
        }
        .into())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let op = self.name();
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or(KernelError::NotContiguous {
                op,
                what: "the variable",
            })?;
        let n = end - start;
        if n != self.0.len() {
            return Err(KernelError::Shape {
                op,
                what: "the variable",
                expected: format!("{} elements, as the values", self.0.len()),
                got: format!("{n} elements"),
            }
            .into());
        }
        if n == 0 {
            return Ok(());
        }
        let dev = storage.device.clone();
        let cfg = elementwise(op, n)?;
        let len = n as u64;
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($kernel:literal, $dst:expr) => {{
                let f = func(&dev, $kernel)?;
                let mut dst = $dst.slice_mut(start..end);
                let mut l = stream.launch_builder(&f);
                l.arg(&mut dst).arg(self.0).arg(&len);
                // SAFETY: `write_param_*` in step.cu: dst and src hold n elements.
                unsafe { l.launch(cfg) }.w()?;
            }};
        }
        match &mut storage.slice {
            CudaStorageSlice::F32(d) => go!("write_param_f32", d),
            CudaStorageSlice::F16(d) => go!("write_param_f16", d),
            CudaStorageSlice::BF16(d) => go!("write_param_bf16", d),
            _ => {
                return Err(err(op, "the variable is not f32, f16 or bf16"));
            }
        }
        Ok(())
    }
}
