//! Megatron-LM's conjugate operators as candle custom ops: `f` ([`copy_to_tp_region`]) and
//! `g` ([`reduce_from_tp_region`]), plus the gather and scatter along the last dimension.
//!
//! Each op runs its collective on the CPU storage of its input (f32, f16, bf16 or f64; half
//! precision is reduced in f32 by kiln-comm) and its backward calls the conjugate collective.
//! On CUDA (feature `cuda`) the ops stage through host memory until a device communicator
//! (NCCL) exists: the input is copied to the host, the same host logic runs, and the result is
//! copied back to a new buffer on the input's device.
//! A failed collective surfaces as a candle error that carries the [`kiln_comm::CommError`]
//! text, never as a panic. Every rank of the group must apply the same ops in the same order,
//! forward and backward, as for any collective.

use crate::error::{ParallelError, Result};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use kiln_comm::{CommElem, CommExt, Communicator, ReduceOp};
use kiln_kernels::custom_op::contiguous;
use kiln_kernels::map_float_storage;
use std::sync::Arc;

/// The tensor-parallel group the ops and layers communicate over (shared by every layer of a
/// model replica).
pub type TpComm = Arc<dyn Communicator>;

/// A collective failure inside a candle op, carrying the communicator's message.
pub(crate) fn comm_error(op: &'static str, e: kiln_comm::CommError) -> candle_core::Error {
    candle_core::Error::msg(format!("{op}: {e}"))
}

fn all_reduced<T: CommElem>(
    data: &[T],
    layout: &Layout,
    comm: &dyn Communicator,
    reduce: ReduceOp,
    op: &'static str,
) -> candle_core::Result<Vec<T>> {
    let mut out = contiguous(data, layout, op)?.to_vec();
    comm.all_reduce(&mut out, reduce)
        .map_err(|e| comm_error(op, e))?;
    Ok(out)
}

/// Rows and width of a tensor viewed as `[rows, last]`.
fn rows_and_last(layout: &Layout, op: &'static str) -> candle_core::Result<(usize, usize)> {
    match layout.dims().last() {
        Some(&n) if n > 0 => Ok((layout.shape().elem_count() / n, n)),
        _ => Err(candle_core::Error::msg(format!(
            "{op}: expected a tensor with a non-empty last dimension, got {:?}",
            layout.dims()
        ))),
    }
}

/// All-gathers `[rows, n]` blocks from every rank into `[rows, n * world]`, rank `k`'s block
/// in columns `k * n .. (k + 1) * n`.
fn gathered_last<T: CommElem>(
    data: &[T],
    layout: &Layout,
    comm: &dyn Communicator,
    op: &'static str,
) -> candle_core::Result<Vec<T>> {
    let x = contiguous(data, layout, op)?;
    let (rows, n) = rows_and_last(layout, op)?;
    let world = comm.world_size();
    let Some(&fill) = x.first() else {
        return Ok(Vec::new());
    };
    let mut flat = vec![fill; x.len() * world];
    comm.all_gather(x, &mut flat)
        .map_err(|e| comm_error(op, e))?;
    let block = rows * n;
    let mut out = Vec::with_capacity(flat.len());
    for r in 0..rows {
        for k in 0..world {
            let at = k * block + r * n;
            out.extend_from_slice(&flat[at..at + n]);
        }
    }
    Ok(out)
}

/// This rank's columns `rank * n .. (rank + 1) * n` of `[rows, n * world]`.
fn scattered_last<T: Copy>(
    data: &[T],
    layout: &Layout,
    world: usize,
    rank: usize,
    op: &'static str,
) -> candle_core::Result<Vec<T>> {
    let x = contiguous(data, layout, op)?;
    let (_, wide) = rows_and_last(layout, op)?;
    if wide % world != 0 {
        return Err(candle_core::Error::msg(format!(
            "{op}: last dimension {wide} is not divisible by the tensor-parallel degree {world}"
        )));
    }
    let n = wide / world;
    let mut out = Vec::with_capacity(x.len() / world);
    for row in x.chunks_exact(wide) {
        out.extend_from_slice(&row[rank * n..(rank + 1) * n]);
    }
    Ok(out)
}

fn with_last(layout: &Layout, last: usize) -> Shape {
    let mut dims = layout.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = last;
    }
    Shape::from(dims)
}

/// All-reduce as a forward-only op (the backward of `f`, and [`all_reduce_tensor`]).
struct AllReduce {
    comm: TpComm,
    reduce: ReduceOp,
    name: &'static str,
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name;
        let out = map_float_storage!(s, op, |v| all_reduced(v, l, &*self.comm, self.reduce, op)?);
        Ok((out, l.shape().clone()))
    }

    /// The same host logic as `cpu_fwd`, staged through host memory (see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        kiln_kernels::cuda::staged_fwd(self, s, l)
    }
}

/// Megatron's `f`: identity forward, all-reduce (sum) of the gradient backward.
struct CopyToTp {
    comm: TpComm,
}

impl CustomOp1 for CopyToTp {
    fn name(&self) -> &'static str {
        "kiln-tp-copy-to-region"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let out = map_float_storage!(s, op, |v| contiguous(v, l, op)?.to_vec());
        Ok((out, l.shape().clone()))
    }

    /// The same host logic as `cpu_fwd`, staged through host memory (see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        kiln_kernels::cuda::staged_fwd(self, s, l)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = grad.contiguous()?.apply_op1_no_bwd(&AllReduce {
            comm: self.comm.clone(),
            reduce: ReduceOp::Sum,
            name: "kiln-tp-copy-to-region-bwd",
        })?;
        Ok(Some(g))
    }
}

/// Megatron's `g`: all-reduce (sum) forward, identity backward.
struct ReduceFromTp {
    comm: TpComm,
}

impl CustomOp1 for ReduceFromTp {
    fn name(&self) -> &'static str {
        "kiln-tp-reduce-from-region"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let out = map_float_storage!(s, op, |v| all_reduced(
            v,
            l,
            &*self.comm,
            ReduceOp::Sum,
            op
        )?);
        Ok((out, l.shape().clone()))
    }

    /// The same host logic as `cpu_fwd`, staged through host memory (see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        kiln_kernels::cuda::staged_fwd(self, s, l)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// All-gather along the last dimension forward, this rank's slice of the gradient backward.
struct GatherFromTp {
    comm: TpComm,
}

impl CustomOp1 for GatherFromTp {
    fn name(&self) -> &'static str {
        "kiln-tp-gather-from-region"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, n) = rows_and_last(l, op)?;
        let out = map_float_storage!(s, op, |v| gathered_last(v, l, &*self.comm, op)?);
        Ok((out, with_last(l, n * self.comm.world_size())))
    }

    /// The same host logic as `cpu_fwd`, staged through host memory (see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        kiln_kernels::cuda::staged_fwd(self, s, l)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = grad.contiguous()?.apply_op1_no_bwd(&ScatterToTp {
            comm: self.comm.clone(),
        })?;
        Ok(Some(g))
    }
}

/// This rank's slice of the last dimension forward, all-gather of the gradient backward.
struct ScatterToTp {
    comm: TpComm,
}

impl CustomOp1 for ScatterToTp {
    fn name(&self) -> &'static str {
        "kiln-tp-scatter-to-region"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        let (_, wide) = rows_and_last(l, op)?;
        let out = map_float_storage!(s, op, |v| scattered_last(v, l, world, rank, op)?);
        Ok((out, with_last(l, wide / world)))
    }

    /// The same host logic as `cpu_fwd`, staged through host memory (see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        kiln_kernels::cuda::staged_fwd(self, s, l)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = grad.contiguous()?.apply_op1_no_bwd(&GatherFromTp {
            comm: self.comm.clone(),
        })?;
        Ok(Some(g))
    }
}

fn check_last(x: &Tensor, op: &'static str, divisor: usize) -> Result<()> {
    match x.dims().last() {
        Some(&n) if n > 0 && n % divisor == 0 => Ok(()),
        _ => Err(ParallelError::Param {
            name: format!("{op} input"),
            expected: format!("a last dimension that is a positive multiple of {divisor}"),
            got: format!("{:?}", x.dims()),
        }),
    }
}

/// Megatron's `f`: the identity forward; backward, the gradient is all-reduced (summed) over
/// the tensor-parallel group. Put it where a replicated activation enters column-parallel
/// computation, so that each rank's partial input gradient is summed.
///
/// With one rank this is `x` itself (no op is recorded); otherwise the output is a contiguous
/// copy.
pub fn copy_to_tp_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    Ok(kiln_memory::tape::apply_op1(
        &x.contiguous()?,
        CopyToTp { comm: comm.clone() },
    )?)
}

/// Megatron's `g`: all-reduce (sum) over the tensor-parallel group forward; backward, the
/// gradient passes through unchanged. Put it where row-parallel partial sums leave the
/// parallel region.
///
/// With one rank this is `x` itself (no op is recorded).
pub fn reduce_from_tp_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    Ok(kiln_memory::tape::apply_op1(
        &x.contiguous()?,
        ReduceFromTp { comm: comm.clone() },
    )?)
}

/// Concatenates every rank's `x` `[.., n]` along the last dimension into `[.., n * tp]`
/// (rank `k`'s part in columns `k * n .. (k + 1) * n`); backward, each rank keeps its own
/// columns of the gradient. Turns a column-parallel output back into the whole one.
pub fn gather_from_tp_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    check_last(x, "gather_from_tp_region", 1)?;
    Ok(kiln_memory::tape::apply_op1(
        &x.contiguous()?,
        GatherFromTp { comm: comm.clone() },
    )?)
}

/// This rank's columns `rank * n .. (rank + 1) * n` of `x` `[.., n * tp]`; backward, the
/// gradients of every rank's columns are all-gathered. The inverse of
/// [`gather_from_tp_region`]: splits a replicated activation for a row-parallel layer.
pub fn scatter_to_tp_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    check_last(x, "scatter_to_tp_region", comm.world_size())?;
    Ok(kiln_memory::tape::apply_op1(
        &x.contiguous()?,
        ScatterToTp { comm: comm.clone() },
    )?)
}

/// All-reduces a float tensor over the group with `reduce`, outside autograd (the result
/// has no gradient link to `x`).
pub fn all_reduce_tensor(x: &Tensor, reduce: ReduceOp, comm: &TpComm) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1_no_bwd(&AllReduce {
        comm: comm.clone(),
        reduce,
        name: "kiln-tp-all-reduce",
    })?)
}
