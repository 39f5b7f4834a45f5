//! The engine's optimizer step on CUDA (feature `cuda`): kernels in `kernels/step.cu`,
//! compiled to PTX by build.rs and loaded once per device.

use crate::error::{ParallelError, Result};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, InplaceOp1, Layout, Storage, Tensor, Var};
use kiln_optim::StepConsts;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kiln_parallel_step.ptx"));
const MODULE: &str = "kiln_parallel_step";

/// One AdamW step over device buffers of `p.len()` elements (parameters, gradients, both
/// moments), with the constants of [`kiln_optim::AdamWConfig::step_consts`]: bitwise the
/// values kiln-optim's CPU kernel computes, element by element. A length mismatch is an error
/// naming the buffer and changes nothing.
pub fn adamw_step(
    dev: &CudaDevice,
    p: &mut CudaSlice<f32>,
    g: &CudaSlice<f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    c: &StepConsts,
) -> Result<()> {
    adamw_range(
        dev,
        &mut p.slice_mut(..),
        &g.slice(..),
        &mut m.slice_mut(..),
        &mut v.slice_mut(..),
        c,
    )
}

/// [`adamw_step`] over views (a range of the engine's flat buffers).
pub(crate) fn adamw_range(
    dev: &CudaDevice,
    p: &mut CudaViewMut<'_, f32>,
    g: &CudaView<'_, f32>,
    m: &mut CudaViewMut<'_, f32>,
    v: &mut CudaViewMut<'_, f32>,
    c: &StepConsts,
) -> Result<()> {
    let n = p.len();
    for (what, len) in [
        ("gradients", g.len()),
        ("exp_avg", m.len()),
        ("exp_avg_sq", v.len()),
    ] {
        if len != n {
            return Err(ParallelError::Config(format!(
                "adamw_step (cuda): {what} has {len} elements, the parameters {n}"
            )));
        }
    }
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise("adamw_step (cuda)", n)?;
    let f = func(dev, "adamw_f32")?;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    let (len, small) = (n as u64, i32::from(c.small_weight()));
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
    // SAFETY: the arguments match `adamw_f32` in kernels/step.cu; every buffer holds n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

fn func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

/// One thread per element, 256 per block.
fn elementwise(op: &str, n: usize) -> Result<LaunchConfig> {
    let grid = u32::try_from(n.div_ceil(256))
        .map_err(|_| ParallelError::Config(format!("{op}: {n} elements is too many")))?;
    Ok(LaunchConfig {
        grid_dim: (grid.max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
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
    let g = g.contiguous()?;
    let (storage, layout) = g.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(ParallelError::Param {
            name: name.to_string(),
            expected: "a gradient on the CUDA device".into(),
            got: format!("a gradient on {:?}", g.device().location()),
        });
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| ParallelError::Config(format!("gradient of {name} is not contiguous")))?;
    let cfg = elementwise("accumulate_grad (cuda)", n)?;
    let (len, ow) = (n as u64, i32::from(overwrite));
    let stream = dev.cuda_stream();
    macro_rules! go {
        ($kernel:literal, $src:expr) => {{
            let f = func(dev, $kernel)?;
            let src = $src.slice(start..end);
            let mut l = stream.launch_builder(&f);
            l.arg(&mut *dst).arg(&src).arg(&len).arg(&ow);
            // SAFETY: `accum_grad_*` in kernels/step.cu: dst and src hold n elements.
            unsafe { l.launch(cfg) }.w()?;
        }};
    }
    match &cs.slice {
        CudaStorageSlice::F32(s) => go!("accum_grad_f32", s),
        CudaStorageSlice::F16(s) => go!("accum_grad_f16", s),
        CudaStorageSlice::BF16(s) => go!("accum_grad_bf16", s),
        _ => {
            return Err(ParallelError::Param {
                name: name.to_string(),
                expected: "an f32, f16 or bf16 gradient".into(),
                got: format!("{:?}", g.dtype()),
            })
        }
    }
    Ok(())
}

/// Bins the squares of `x` (after multiplying it in place by `inv` when `scale`) into `bins`
/// (512 integers: see `square_bins` in kernels/step.cu and [`kiln_optim::SquareSum::add_bins`])
/// and ORs NaN (1) and infinity (2) into `flags[0]`.
pub(crate) fn square_bins(
    dev: &CudaDevice,
    x: &mut CudaViewMut<'_, f32>,
    inv: Option<f32>,
    bins: &mut CudaViewMut<'_, u64>,
    flags: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    let n = x.len();
    if n == 0 {
        return Ok(());
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
    // SAFETY: `square_bins` in kernels/step.cu: x holds n floats, bins 512 u64, flags one u32.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// `g *= coef` (clipping).
pub(crate) fn scale(dev: &CudaDevice, g: &mut CudaViewMut<'_, f32>, coef: f32) -> Result<()> {
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
    // SAFETY: `scale_f32` in kernels/step.cu: g holds n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// `old = now - old` (the update of a step).
pub(crate) fn delta(
    dev: &CudaDevice,
    old: &mut CudaViewMut<'_, f32>,
    now: &CudaView<'_, f32>,
) -> Result<()> {
    let n = old.len();
    if n != now.len() {
        return Err(ParallelError::Config(format!(
            "delta (cuda): {n} old values, {} new",
            now.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let cfg = elementwise("delta (cuda)", n)?;
    let f = func(dev, "delta_f32")?;
    let len = n as u64;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    l.arg(old).arg(now).arg(&len);
    // SAFETY: `delta_f32` in kernels/step.cu: both hold n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}

/// Writes device f32 values into a variable on the same device in place, converted to its
/// dtype (device to device; nothing crosses to the host).
pub(crate) fn write_var_from_device(var: &Var, src: &CudaView<'_, f32>) -> Result<()> {
    var.as_tensor().inplace_op1(&WriteFromDevice(src))?;
    Ok(())
}

struct WriteFromDevice<'a, 'b>(&'a CudaView<'b, f32>);

impl InplaceOp1 for WriteFromDevice<'_, '_> {
    fn name(&self) -> &'static str {
        "kiln-write-params-device"
    }

    fn cpu_fwd(
        &self,
        _storage: &mut candle_core::CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<()> {
        Err(candle_core::Error::Msg(
            "kiln-write-params-device: the variable is on the CPU, the values on a CUDA device"
                .into(),
        ))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("kiln-write-params-device: variable is not contiguous".into())
        })?;
        let n = end - start;
        if n != self.0.len() {
            return Err(candle_core::Error::Msg(format!(
                "kiln-write-params-device: variable holds {n} elements, got {}",
                self.0.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let dev = storage.device.clone();
        let cfg = elementwise("write_var_from_device", n)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let len = n as u64;
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($kernel:literal, $dst:expr) => {{
                let f = dev
                    .get_or_load_custom_func($kernel, MODULE, PTX)?
                    .into_cuda_function();
                let mut dst = $dst.slice_mut(start..end);
                let mut l = stream.launch_builder(&f);
                l.arg(&mut dst).arg(self.0).arg(&len);
                // SAFETY: `write_param_*` in kernels/step.cu: dst and src hold n elements.
                unsafe { l.launch(cfg) }.w()?;
            }};
        }
        match &mut storage.slice {
            CudaStorageSlice::F32(d) => go!("write_param_f32", d),
            CudaStorageSlice::F16(d) => go!("write_param_f16", d),
            CudaStorageSlice::BF16(d) => go!("write_param_bf16", d),
            _ => {
                return Err(candle_core::Error::Msg(
                    "kiln-write-params-device: the variable is not f32, f16 or bf16".into(),
                ))
            }
        }
        Ok(())
    }
}
