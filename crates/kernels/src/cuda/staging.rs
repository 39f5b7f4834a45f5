//! Host staging of a custom op on CUDA: its `cuda_fwd` copies the contiguous part of its input
//! to host memory, runs the very host logic of its `cpu_fwd` on it and copies the result back
//! to a new buffer on the input's device. f32, f16, bf16 and f64, as on the CPU. For ops whose
//! work happens on the host anyway: kiln-parallel's collectives over host communicators (thread
//! ranks, MPI), and the vocab-parallel cross-entropy's gradient.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape};

/// The contiguous part of `s` that `l` addresses, copied to host memory (one device-to-host
/// copy; the stream is synchronized before it returns).
pub fn to_host(s: &CudaStorage, l: &Layout, op: &'static str) -> candle_core::Result<CpuStorage> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| super::err(op, "input is not contiguous"))?;
    let dev = s.device();
    Ok(match s.dtype() {
        DType::F32 => CpuStorage::F32(dev.clone_dtoh(&s.as_cuda_slice::<f32>()?.slice(a..b))?),
        DType::F16 => {
            CpuStorage::F16(dev.clone_dtoh(&s.as_cuda_slice::<half::f16>()?.slice(a..b))?)
        }
        DType::BF16 => {
            CpuStorage::BF16(dev.clone_dtoh(&s.as_cuda_slice::<half::bf16>()?.slice(a..b))?)
        }
        DType::F64 => CpuStorage::F64(dev.clone_dtoh(&s.as_cuda_slice::<f64>()?.slice(a..b))?),
        other => return Err(candle_core::Error::UnsupportedDTypeForOp(other, op)),
    })
}

/// `op`'s forward on a CUDA input: the input staged to the host ([`to_host`]), `op.cpu_fwd`
/// on it, and its result copied to a new buffer on the same device.
pub fn staged_fwd<O: CustomOp1 + ?Sized>(
    op: &O,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let host = to_host(s, l, op.name())?;
    let (out, shape) = op.cpu_fwd(&host, &Layout::contiguous(l.shape()))?;
    Ok((s.device().storage_from_cpu_storage_owned(out)?, shape))
}
