//! [`Communicator`] on host slices for [`NcclComm`]: every collective copies the slice to a
//! device buffer on the communicator's stream, runs the NCCL collective, and copies the result
//! back. Uneven [`chunk_range`] chunks are padded to equal ones on the device; an integer
//! average is an NCCL sum divided on the host (NCCL's integer average is not kiln's).
//!
//! Point-to-point messages go the same way: each send's slice is copied to the device, every
//! `ncclSend` and `ncclRecv` of a batch is enqueued between `ncclGroupStart` and
//! `ncclGroupEnd`, and the received bytes are copied back. NCCL checks nothing of a message but
//! its size in bytes and completes a send only with its receive, so on NCCL a send is not eager
//! (only a batch avoids the ordering deadlock), tags and dtypes are not compared
//! ([`Capabilities::detects_mismatch`] is false), and a length mismatch is undefined. Written
//! against NCCL's documented API and compile-checked; it has not run on a GPU.

use super::{c_int, cuda_err, nccl_err, NcclComm, NcclElem, Raw, BACKEND};
use crate::communicator::{chunk_range, Capabilities, Communicator, Descriptor, OpKind};
use crate::elem::{Buf, BufMut, DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::p2p::{check_peers, P2pOp};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;
use std::sync::Mutex;
use std::time::Duration;

impl NcclComm {
    /// A device buffer with `data`, on this communicator's stream.
    fn upload<T: NcclElem>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(data)
            .map_err(|e| cuda_err("copy to the device", e))
    }

    fn download<T: NcclElem>(&self, src: &CudaSlice<T>, dst: &mut [T]) -> Result<()> {
        self.stream
            .memcpy_dtoh(src, dst)
            .map_err(|e| cuda_err("copy to the host", e))
    }

    fn host_all_reduce<T: NcclElem>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut d = self.upload(buf)?;
        let (dev_op, divide) = device_op::<T>(op);
        self.all_reduce_device(&mut d, dev_op)?;
        self.download(&d, buf)?;
        if divide {
            divide_integers(buf, self.world);
        }
        Ok(())
    }

    fn host_reduce_scatter<T: NcclElem>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let len = input.len();
        let mine = chunk_range(len, self.world, self.rank);
        self.check_len(OpKind::ReduceScatter, "output", mine.len(), output.len())?;
        // equal chunks of the largest chunk's size, each rank's data at the start of its own
        let c = len.div_ceil(self.world.max(1));
        let mut padded = vec![T::zeroed(); c * self.world];
        for r in 0..self.world {
            let src = chunk_range(len, self.world, r);
            padded[r * c..r * c + src.len()].copy_from_slice(&input[src]);
        }
        let d_in = self.upload(&padded)?;
        let mut d_out = self
            .stream
            .alloc_zeros::<T>(c)
            .map_err(|e| cuda_err("cuMemAlloc", e))?;
        let (dev_op, divide) = device_op::<T>(op);
        self.reduce_scatter_device(&d_in, &mut d_out, dev_op)?;
        let mut chunk = vec![T::zeroed(); c];
        self.download(&d_out, &mut chunk)?;
        output.copy_from_slice(&chunk[..output.len()]);
        if divide {
            divide_integers(output, self.world);
        }
        Ok(())
    }

    fn host_all_gather<T: NcclElem>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let len = output.len();
        let mine = chunk_range(len, self.world, self.rank);
        self.check_len(OpKind::AllGather, "input", mine.len(), input.len())?;
        let c = len.div_ceil(self.world.max(1));
        let mut padded = vec![T::zeroed(); c];
        padded[..input.len()].copy_from_slice(input);
        let d_in = self.upload(&padded)?;
        let mut d_out = self
            .stream
            .alloc_zeros::<T>(c * self.world)
            .map_err(|e| cuda_err("cuMemAlloc", e))?;
        self.all_gather_device(&d_in, &mut d_out)?;
        let mut all = vec![T::zeroed(); c * self.world];
        self.download(&d_out, &mut all)?;
        for r in 0..self.world {
            let dst = chunk_range(len, self.world, r);
            let n = dst.len();
            output[dst].copy_from_slice(&all[r * c..r * c + n]);
        }
        Ok(())
    }

    fn host_broadcast<T: NcclElem>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let mut d = self.upload(buf)?;
        self.broadcast_device(&mut d, root)?;
        self.download(&d, buf)
    }

    /// A batch of sends and receives of host slices, as bytes, in one NCCL group.
    fn host_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        check_peers(ops, self.rank, self.world)?;
        // device copies of the sends and device buffers for the receives (empty ones move
        // nothing), with each op's index and peer
        let mut sends: Vec<(std::ffi::c_int, CudaSlice<u8>)> = Vec::new();
        let mut recvs: Vec<(usize, std::ffi::c_int, CudaSlice<u8>)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let peer = c_int(op.peer(), "peer")?;
            match op {
                P2pOp::Send { buf, .. } if !buf.is_empty() => {
                    let d = self
                        .stream
                        .clone_htod(buf.as_bytes())
                        .map_err(|e| cuda_err("copy to the device", e))?;
                    sends.push((peer, d));
                }
                P2pOp::Recv { buf, .. } if !buf.is_empty() => {
                    let n = buf.len() * buf.dtype().size_in_bytes();
                    let d = self
                        .stream
                        .alloc_zeros::<u8>(n)
                        .map_err(|e| cuda_err("cuMemAlloc", e))?;
                    recvs.push((i, peer, d));
                }
                _ => {}
            }
        }
        let Some(first) = ops.first() else {
            return Ok(());
        };
        let mut raw = self.lock()?;
        let desc = first.descriptor(raw.seq);
        let stream = self.stream.clone();
        self.run(&mut raw, desc, |comm, s| {
            cudarc::nccl::result::group_start().map_err(|e| nccl_err("ncclGroupStart", &e))?;
            let mut first_err = None;
            for (peer, d) in &sends {
                let (ptr, _r) = d.device_ptr(&stream);
                // SAFETY: `ptr` holds `d.len()` bytes on this communicator's device.
                let r = unsafe {
                    cudarc::nccl::result::send(
                        ptr as *const _,
                        d.len(),
                        sys::ncclDataType_t::ncclUint8,
                        *peer,
                        comm,
                        s,
                    )
                };
                if let Err(e) = r {
                    first_err.get_or_insert(nccl_err("ncclSend", &e));
                }
            }
            for (_, peer, d) in &mut recvs {
                let n = d.len();
                let (ptr, _w) = d.device_ptr_mut(&stream);
                // SAFETY: `ptr` holds `n` bytes on this communicator's device.
                let r = unsafe {
                    cudarc::nccl::result::recv(
                        ptr as *mut _,
                        n,
                        sys::ncclDataType_t::ncclUint8,
                        *peer,
                        comm,
                        s,
                    )
                };
                if let Err(e) = r {
                    first_err.get_or_insert(nccl_err("ncclRecv", &e));
                }
            }
            cudarc::nccl::result::group_end().map_err(|e| nccl_err("ncclGroupEnd", &e))?;
            first_err.map_or(Ok(()), Err)
        })?;
        drop(raw);
        for (i, _, d) in &recvs {
            if let Some(P2pOp::Recv { buf, .. }) = ops.get_mut(*i) {
                self.stream
                    .memcpy_dtoh(d, buf.as_bytes_mut())
                    .map_err(|e| cuda_err("copy to the host", e))?;
            }
        }
        Ok(())
    }
}

/// The reduction NCCL runs for kiln's `op` on `T`, and whether the host divides the result by
/// the world afterwards: NCCL's average of integers is not kiln's (integer division of the sum),
/// so an integer `Avg` is an NCCL sum followed by [`divide_integers`].
fn device_op<T: NcclElem>(op: ReduceOp) -> (ReduceOp, bool) {
    let integer = matches!(T::DTYPE, DType::I64 | DType::U32);
    if integer && op == ReduceOp::Avg {
        (ReduceOp::Sum, true)
    } else {
        (op, false)
    }
}

/// kiln's integer average: the sum divided by the world (integer division).
fn divide_integers<T: NcclElem>(buf: &mut [T], world: usize) {
    match T::DTYPE {
        DType::I64 => {
            for v in bytemuck::cast_slice_mut::<T, i64>(buf) {
                *v /= world as i64;
            }
        }
        DType::U32 => {
            for v in bytemuck::cast_slice_mut::<T, u32>(buf) {
                *v /= world as u32;
            }
        }
        _ => {}
    }
}

macro_rules! host_dispatch {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            BufMut::F32($s) => $body,
            BufMut::F64($s) => $body,
            BufMut::F16($s) => $body,
            BufMut::BF16($s) => $body,
            BufMut::I64($s) => $body,
            BufMut::U32($s) => $body,
        }
    };
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn last_collective(&self) -> Option<Descriptor> {
        self.raw.lock().ok().and_then(|r| r.last)
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        host_dispatch!(buf, b => self.host_all_reduce(b, op))
    }

    fn reduce_scatter_buf(&self, input: Buf<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        match (input, output) {
            (Buf::F32(i), BufMut::F32(o)) => self.host_reduce_scatter(i, o, op),
            (Buf::F64(i), BufMut::F64(o)) => self.host_reduce_scatter(i, o, op),
            (Buf::F16(i), BufMut::F16(o)) => self.host_reduce_scatter(i, o, op),
            (Buf::BF16(i), BufMut::BF16(o)) => self.host_reduce_scatter(i, o, op),
            (Buf::I64(i), BufMut::I64(o)) => self.host_reduce_scatter(i, o, op),
            (Buf::U32(i), BufMut::U32(o)) => self.host_reduce_scatter(i, o, op),
            (i, o) => Err(CommError::DtypeMismatch {
                op: OpKind::ReduceScatter,
                rank: self.rank,
                input: i.dtype(),
                output: o.dtype(),
            }),
        }
    }

    fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        match (input, output) {
            (Buf::F32(i), BufMut::F32(o)) => self.host_all_gather(i, o),
            (Buf::F64(i), BufMut::F64(o)) => self.host_all_gather(i, o),
            (Buf::F16(i), BufMut::F16(o)) => self.host_all_gather(i, o),
            (Buf::BF16(i), BufMut::BF16(o)) => self.host_all_gather(i, o),
            (Buf::I64(i), BufMut::I64(o)) => self.host_all_gather(i, o),
            (Buf::U32(i), BufMut::U32(o)) => self.host_all_gather(i, o),
            (i, o) => Err(CommError::DtypeMismatch {
                op: OpKind::AllGather,
                rank: self.rank,
                input: i.dtype(),
                output: o.dtype(),
            }),
        }
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        host_dispatch!(buf, b => self.host_broadcast(b, root))
    }

    fn barrier(&self) -> Result<()> {
        // a one-element all-reduce: returns once every rank has entered it
        let mut one = [0u32];
        self.host_all_reduce(&mut one, ReduceOp::Sum)
    }

    /// `ncclCommSplit` (through cudarc's `sys`: its safe API lacks it for CUDA 13): the new
    /// communicator shares the GPU and gets a stream of its own.
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        let (color_c, key_c) = (
            c_int(color as usize, "split color")?,
            c_int(key as usize, "split key")?,
        );
        let mut raw = self.lock()?;
        raw.seq += 1;
        raw.last = Some(Descriptor::new(raw.seq, OpKind::Split, None, 0, None, None));
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the CUDA context", e))?;
        let mut new_comm = std::mem::MaybeUninit::uninit();
        // SAFETY: a live parent communicator; `new_comm` is written before it is read; a null
        // config takes the parent's.
        let res = unsafe {
            sys::ncclCommSplit(
                raw.comm,
                color_c,
                key_c,
                new_comm.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if res != sys::ncclResult_t::ncclSuccess {
            return Err(self.abort(&mut raw, format!("ncclCommSplit failed: {res:?}")));
        }
        // SAFETY: written by a successful ncclCommSplit.
        let comm = unsafe { new_comm.assume_init() };
        let (mut count, mut rank) = (0, 0);
        // SAFETY: a live communicator and valid out pointers.
        let (a, b) = unsafe {
            (
                sys::ncclCommCount(comm, &mut count),
                sys::ncclCommUserRank(comm, &mut rank),
            )
        };
        if a != sys::ncclResult_t::ncclSuccess || b != sys::ncclResult_t::ncclSuccess {
            return Err(CommError::Backend {
                backend: BACKEND,
                message: format!("the split communicator's size or rank: {a:?} {b:?}"),
            });
        }
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(Box::new(NcclComm {
            raw: Mutex::new(Raw {
                comm,
                aborted: None,
                seq: 0,
                last: None,
            }),
            ctx: self.ctx.clone(),
            stream,
            rank: rank.max(0) as usize,
            world: count.max(0) as usize,
            timeout: self.timeout,
        }))
    }

    fn p2p_batch(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        self.host_p2p(ops)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            device_buffers: true,
            even_chunks_only: true,
            rank_ordered: false,
            detects_mismatch: false,
        }
    }
}
