//! kiln's CUDA kernels (feature `cuda`) and their launchers: the fused ops (`ops.cu`, launched
//! from each op's `cuda_fwd`), the fused causal attention (`attn.cu`), and the data-parallel
//! engine's optimizer step over flat device buffers (`step.cu`: AdamW, gradient accumulation,
//! the exact squared-norm bins, clipping, the parameter write-back). build.rs compiles each
//! `.cu` file to PTX for `CUDA_COMPUTE_CAP` (and assembles it with ptxas, so a kernel that
//! does not compile fails the build); each is loaded once per device. f32, f16 and bf16 storage
//! (half types computed in f32, as on the CPU); inputs must be contiguous.
//!
//! [`staged_fwd`] runs a CPU op on a CUDA tensor through host memory, for ops whose work is on
//! the host (kiln-parallel's collectives, the vocab-parallel cross-entropy's gradient).

use crate::KernelError;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape, WithDType};

pub(crate) mod attn;
pub(crate) mod llama;
pub(crate) mod ops;
mod staging;
mod step;

pub use staging::{staged_fwd, to_host};
pub use step::{
    accumulate_grad, adamw_range, adamw_step, delta, scale, square_bins, AdamWConsts,
    WriteFromDevice,
};

/// A storage type the kernels take.
pub(crate) trait KernelElem: CudaDType + DeviceRepr + ValidAsZeroBits + WithDType {}
impl KernelElem for f32 {}
impl KernelElem for half::f16 {}
impl KernelElem for half::bf16 {}

/// Runs `$body` with the type alias `$t` bound to the Rust type of `$dtype` (f32, f16, bf16).
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other, $op)),
        }
    };
}
pub(crate) use by_dtype;

/// A kernel of `op` that cannot run as asked ([`KernelError::Cuda`]), as a candle error.
pub(crate) fn err(op: &'static str, msg: impl std::fmt::Display) -> candle_core::Error {
    KernelError::Cuda {
        op,
        reason: msg.to_string(),
    }
    .into()
}

/// The contiguous part of `s` that `l` describes, as `T`.
pub(crate) fn input<'a, T: KernelElem>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &'static str,
) -> Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err(op, "input is not contiguous"))?;
    Ok(slice.slice(a..b))
}

/// Threads per block for rows of `len` elements: a multiple of 32, at most 1024.
pub(crate) fn block_for(len: usize) -> u32 {
    (len.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// `grid` blocks of `block` threads.
pub(crate) fn cfg(op: &'static str, grid: usize, block: u32) -> Result<LaunchConfig> {
    let grid = u32::try_from(grid).map_err(|_| err(op, format!("{grid} blocks is too many")))?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One thread per element, 256 per block.
pub(crate) fn elementwise(op: &'static str, len: usize) -> Result<LaunchConfig> {
    cfg(op, len.div_ceil(256), 256)
}

/// `v` as the kernels' `int`.
pub(crate) fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| err(op, format!("size {v} does not fit the kernel's int")))
}

/// A fresh device buffer every element of which the kernel writes.
pub(crate) fn output<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every launch writes all `len` elements before anything reads them.
    unsafe { dev.alloc::<T>(len) }
}

/// A kernel's output buffer as candle storage of `shape`.
pub(crate) fn wrap<T: KernelElem>(
    out: CudaSlice<T>,
    dev: &CudaDevice,
    shape: Shape,
) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(out, dev.clone()), shape)
}
