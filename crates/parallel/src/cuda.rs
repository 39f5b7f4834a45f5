//! The engine's optimizer step on CUDA (feature `cuda`): kernels in `kernels/step.cu`,
//! compiled to PTX by build.rs and loaded once per device.

use crate::error::{ParallelError, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::CudaDevice;
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
    let grid = u32::try_from(n.div_ceil(256)).map_err(|_| {
        ParallelError::Config(format!("adamw_step (cuda): {n} elements is too many"))
    })?;
    let f = dev
        .get_or_load_custom_func("adamw_f32", MODULE, PTX)?
        .into_cuda_function();
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
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `adamw_f32` in kernels/step.cu; every buffer holds n floats.
    unsafe { l.launch(cfg) }.w()?;
    Ok(())
}
