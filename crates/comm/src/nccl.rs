//! The NCCL backend (feature `nccl`): one rank per GPU, collectives on device buffers over
//! NCCL through cudarc.
//!
//! - [`NcclComm`] implements [`Communicator`], so the control collectives every caller makes
//!   (found-inf flags, exact norm sums, loss averages, checkpoint agreement) work on host slices
//!   as on any backend: copied to the device, reduced by NCCL, copied back. Uneven
//!   [`chunk_range`] chunks are padded to equal ones on the device for NCCL.
//! - Its `*_device` methods run the collectives in place on device buffers (cudarc
//!   [`CudaSlice`]s and views) on the communicator's own CUDA stream. cudarc's event tracking
//!   orders them after the kernels that wrote the buffers on another stream (the compute
//!   stream) and the compute stream's later reads after them. Device collectives need equal
//!   chunks ([`Capabilities::even_chunks_only`]): a caller pads its flat buffers to a multiple
//!   of the world.
//! - Every call waits for its collective with a deadline, polling the stream and
//!   `ncclCommGetAsyncError`: past [`Communicator::timeout`] the communicator is aborted
//!   (`ncclCommAbort`) and the call returns [`CommError::Timeout`], so a dead peer is an error,
//!   not a hang. An aborted communicator fails every later call.
//! - f16 and bf16 reduce in their own type on NCCL, not in f32 as the thread and MPI backends
//!   do, and NCCL's ring and tree orders are not rank order: results are deterministic for one
//!   topology but not bitwise the host backends' ([`Capabilities::rank_ordered`] is false).
//!   Equivalence tests against the host backends therefore use a tolerance (f32: 1e-6
//!   relative per reduction; f16/bf16: their epsilon times the world).
//! - Without the NVIDIA driver or libnccl on the machine, creating a communicator returns
//!   [`CommError::BackendUnavailable`] naming the missing library; cudarc is never asked to
//!   load it (it would panic).
//!
//! One rank per process is the intended use: kiln-launch's `nccl_from_env` takes the rank,
//! world and local rank from the launcher (torchrun-style variables, Open MPI, Slurm), the GPU
//! from the local rank, and hands rank 0's [`NcclId`] to the others through its rendezvous
//! store; [`NcclComm::new`] then takes the id, however it travelled.

use crate::communicator::{chunk_range, Capabilities, Communicator, Descriptor, OpKind};
use crate::elem::{Buf, BufMut, CommElem, DType, ReduceOp};
use crate::error::{CommError, Result};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nccl::sys;
use half::{bf16, f16};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const BACKEND: &str = "nccl";

/// The libraries a communicator needs at run time, each with the names tried in order.
const LIBRARIES: [(&str, &[&str]); 2] = [
    ("the NVIDIA driver library", &["libcuda.so.1", "libcuda.so"]),
    ("NCCL", &["libnccl.so.2", "libnccl.so"]),
];

/// Checks that the NVIDIA driver library and libnccl can be loaded on this machine (what every
/// [`NcclComm`] constructor checks first). [`CommError::BackendUnavailable`] names the missing
/// one and the names tried.
pub fn available() -> Result<()> {
    for (what, names) in LIBRARIES {
        // SAFETY: loading a shared library runs its initialisers; the CUDA driver and NCCL are
        // loaded the same way by cudarc a moment later.
        let found = names
            .iter()
            .any(|n| unsafe { libloading::Library::new(*n) }.is_ok());
        if !found {
            return Err(CommError::BackendUnavailable {
                backend: BACKEND,
                reason: format!(
                    "{what} cannot be loaded (tried {}): install the NVIDIA driver and NCCL \
                     (pip's nvidia-nccl-cu13 puts libnccl.so.2 under site-packages/nvidia; add \
                     its folder to LD_LIBRARY_PATH)",
                    names.join(", ")
                ),
            });
        }
    }
    Ok(())
}

/// NCCL's unique id of a communicator: created by one rank ([`NcclId::new`]) and handed to
/// the others as bytes ([`NcclId::to_bytes`], [`NcclId::from_bytes`]).
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`); needs the libraries ([`available`]).
    pub fn new() -> Result<NcclId> {
        available()?;
        let id =
            cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", &e))?;
        Ok(NcclId(id))
    }

    /// The id's 128 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    /// The id from [`NcclId::to_bytes`]; another length is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId> {
        let mut internal = [0 as std::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(CommError::Config(format!(
                "an NCCL unique id has {} bytes, got {}",
                internal.len(),
                bytes.len()
            )));
        }
        for (d, &b) in internal.iter_mut().zip(bytes) {
            *d = b as std::ffi::c_char;
        }
        Ok(NcclId(sys::ncclUniqueId { internal }))
    }
}

/// Element types NCCL reduces: kiln's [`CommElem`]s.
pub trait NcclElem: CommElem + DeviceRepr + ValidAsZeroBits + sealed::Sealed {
    /// NCCL's data type.
    fn nccl_type() -> sys::ncclDataType_t;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! nccl_elem {
    ($($t:ty => $n:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl NcclElem for $t {
            fn nccl_type() -> sys::ncclDataType_t {
                sys::ncclDataType_t::$n
            }
        }
    )*};
}
nccl_elem!(f32 => ncclFloat32, f64 => ncclFloat64, f16 => ncclFloat16, bf16 => ncclBfloat16,
    i64 => ncclInt64, u32 => ncclUint32);

fn nccl_err(call: &str, e: &cudarc::nccl::result::NcclError) -> CommError {
    CommError::Backend {
        backend: BACKEND,
        message: format!("{call} failed: {:?}", e.0),
    }
}

fn cuda_err(call: &str, e: cudarc::driver::DriverError) -> CommError {
    CommError::Backend {
        backend: BACKEND,
        message: format!("{call} failed: {e}"),
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// The raw communicator, used under the lock only.
struct Raw {
    comm: sys::ncclComm_t,
    /// Set once the communicator has been aborted (timeout or asynchronous error).
    aborted: Option<String>,
    seq: u64,
    last: Option<Descriptor>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls do not overlap;
// every use goes through the `Mutex` in `NcclComm`.
unsafe impl Send for Raw {}

/// A group of ranks over NCCL, one GPU each. See the module docs.
pub struct NcclComm {
    raw: Mutex<Raw>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

/// The CUDA context of GPU `ordinal`, or why there is none.
fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    available()?;
    let count = CudaContext::device_count().map_err(|e| CommError::BackendUnavailable {
        backend: BACKEND,
        reason: format!("the CUDA driver cannot count devices: {e}"),
    })?;
    if ordinal >= count.max(0) as usize {
        return Err(CommError::BackendUnavailable {
            backend: BACKEND,
            reason: format!("no CUDA device {ordinal}: this machine has {count}"),
        });
    }
    CudaContext::new(ordinal).map_err(|e| cuda_err("cuCtx for the device", e))
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world` on GPU `ordinal`. Collective: every rank
    /// calls it with the same id; if they have not all joined within `timeout` the call
    /// returns [`CommError::Timeout`] (the pending initialisation is abandoned).
    pub fn new(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: NcclId,
        timeout: Duration,
    ) -> Result<NcclComm> {
        if world == 0 || rank >= world {
            return Err(CommError::Config(format!(
                "NCCL rank {rank} of a world of {world}"
            )));
        }
        let (nranks, r) = (c_int(world, "world size")?, c_int(rank, "rank")?);
        let ctx = context(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        // ncclCommInitRank blocks until every rank has joined: run it on a thread of its own
        // and give up on it past the deadline
        let (tx, rx) = std::sync::mpsc::channel();
        let init_ctx = ctx.clone();
        std::thread::Builder::new()
            .name(format!("kiln-nccl-init-{rank}"))
            .spawn(move || {
                let out = init_ctx
                    .bind_to_thread()
                    .map_err(|e| cuda_err("binding the CUDA context", e))
                    .and_then(|()| {
                        let mut comm = std::mem::MaybeUninit::uninit();
                        // SAFETY: `comm` is written by ncclCommInitRank before it is read.
                        unsafe {
                            cudarc::nccl::result::comm_init_rank(
                                comm.as_mut_ptr(),
                                nranks,
                                id.0,
                                r,
                            )
                            .map_err(|e| nccl_err("ncclCommInitRank", &e))?;
                            Ok(SendComm(comm.assume_init()))
                        }
                    });
                let _ = tx.send(out);
            })
            .map_err(|e| CommError::Config(format!("cannot start the NCCL init thread: {e}")))?;
        let t0 = Instant::now();
        let comm = match rx.recv_timeout(timeout) {
            Ok(out) => out?.0,
            Err(_) => {
                return Err(CommError::Timeout {
                    op: OpKind::Barrier,
                    rank,
                    waited: t0.elapsed(),
                    missing: Vec::new(),
                })
            }
        };
        Ok(NcclComm {
            raw: Mutex::new(Raw {
                comm,
                aborted: None,
                seq: 0,
                last: None,
            }),
            ctx,
            stream,
            rank,
            world,
            timeout,
        })
    }

    /// The communicator's CUDA stream: its collectives run there.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The GPU's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn lock(&self) -> Result<MutexGuard<'_, Raw>> {
        let raw = self.raw.lock().map_err(|_| CommError::Backend {
            backend: BACKEND,
            message: "a thread panicked inside an NCCL call".into(),
        })?;
        if let Some(why) = &raw.aborted {
            return Err(CommError::Backend {
                backend: BACKEND,
                message: format!("the communicator was aborted earlier: {why}"),
            });
        }
        Ok(raw)
    }

    /// Records the call, enqueues it with `enqueue(comm, stream)` and waits for it with the
    /// deadline.
    fn run(
        &self,
        raw: &mut Raw,
        desc: Descriptor,
        enqueue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<()>,
    ) -> Result<()> {
        raw.seq += 1;
        raw.last = Some(desc);
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the CUDA context", e))?;
        enqueue(raw.comm, self.stream.cu_stream() as sys::cudaStream_t)?;
        self.wait(raw, desc.op)
    }

    /// Polls the stream and NCCL's asynchronous error until the work enqueued so far is done.
    fn wait(&self, raw: &mut Raw, op: OpKind) -> Result<()> {
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        let t0 = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.abort(raw, format!("CUDA error while waiting: {e}"))),
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator and a valid out pointer.
            let res = unsafe { sys::ncclCommGetAsyncError(raw.comm, &mut state) };
            if res != sys::ncclResult_t::ncclSuccess
                || !matches!(
                    state,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                )
            {
                return Err(self.abort(raw, format!("asynchronous NCCL error {state:?} in {op}")));
            }
            let waited = t0.elapsed();
            if waited > self.timeout {
                let _ = self.abort(raw, format!("{op} timed out after {waited:?}"));
                return Err(CommError::Timeout {
                    op,
                    rank: self.rank,
                    waited,
                    missing: Vec::new(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Aborts the communicator (every later call fails) and returns the error to report.
    fn abort(&self, raw: &mut Raw, why: String) -> CommError {
        if raw.aborted.is_none() {
            // SAFETY: a live communicator; it is never used again once `aborted` is set.
            let _ = unsafe { cudarc::nccl::result::comm_abort(raw.comm) };
            raw.aborted = Some(why.clone());
        }
        CommError::Backend {
            backend: BACKEND,
            message: why,
        }
    }

    fn check_len(&self, op: OpKind, what: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected == got {
            Ok(())
        } else {
            Err(CommError::BadLength {
                op,
                rank: self.rank,
                what,
                expected,
                got,
            })
        }
    }

    fn descriptor<T: NcclElem>(
        raw: &Raw,
        op: OpKind,
        len: usize,
        reduce: Option<ReduceOp>,
        root: Option<usize>,
    ) -> Descriptor {
        Descriptor::new(raw.seq, op, Some(T::DTYPE), len, reduce, root)
    }

    /// All-reduces a device buffer in place (`op` over the ranks; f16 and bf16 in their own
    /// type). Blocks until done or the deadline.
    pub fn all_reduce_device<T: NcclElem, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        let mut raw = self.lock()?;
        let n = buf.len();
        let desc = Self::descriptor::<T>(&raw, OpKind::AllReduce, n, Some(op), None);
        let stream = self.stream.clone();
        self.run(&mut raw, desc, |comm, s| {
            let (ptr, _record) = buf.device_ptr_mut(&stream);
            // SAFETY: `ptr` holds `n` elements of T on this communicator's device.
            unsafe {
                cudarc::nccl::result::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    n,
                    T::nccl_type(),
                    nccl_op(op),
                    comm,
                    s,
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_err("ncclAllReduce", &e))
        })
    }

    /// Reduce-scatters `input` (`world * output.len()` elements) into this rank's `output`
    /// (chunk `rank` of equal chunks). Blocks until done or the deadline.
    pub fn reduce_scatter_device<T: NcclElem, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
    ) -> Result<()> {
        let n = output.len();
        self.check_len(OpKind::ReduceScatter, "input", n * self.world, input.len())?;
        let mut raw = self.lock()?;
        let desc = Self::descriptor::<T>(&raw, OpKind::ReduceScatter, input.len(), Some(op), None);
        let stream = self.stream.clone();
        self.run(&mut raw, desc, |comm, s| {
            let (src, _r) = input.device_ptr(&stream);
            let (dst, _w) = output.device_ptr_mut(&stream);
            // SAFETY: `src` holds world * n elements, `dst` n, on this device.
            unsafe {
                cudarc::nccl::result::reduce_scatter(
                    src as *const _,
                    dst as *mut _,
                    n,
                    T::nccl_type(),
                    nccl_op(op),
                    comm,
                    s,
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_err("ncclReduceScatter", &e))
        })
    }

    /// All-gathers every rank's `input` (equal lengths) into `output` (`world * input.len()`),
    /// rank by rank. Blocks until done or the deadline.
    pub fn all_gather_device<T: NcclElem, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        input: &I,
        output: &mut O,
    ) -> Result<()> {
        let n = input.len();
        self.check_len(OpKind::AllGather, "output", n * self.world, output.len())?;
        let mut raw = self.lock()?;
        let desc = Self::descriptor::<T>(&raw, OpKind::AllGather, output.len(), None, None);
        let stream = self.stream.clone();
        self.run(&mut raw, desc, |comm, s| {
            let (src, _r) = input.device_ptr(&stream);
            let (dst, _w) = output.device_ptr_mut(&stream);
            // SAFETY: `src` holds n elements, `dst` world * n, on this device.
            unsafe {
                cudarc::nccl::result::all_gather(
                    src as *const _,
                    dst as *mut _,
                    n,
                    T::nccl_type(),
                    comm,
                    s,
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_err("ncclAllGather", &e))
        })
    }

    /// Broadcasts `root`'s device buffer into `buf` on every rank. Blocks until done or the
    /// deadline.
    pub fn broadcast_device<T: NcclElem, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        root: usize,
    ) -> Result<()> {
        if root >= self.world {
            return Err(CommError::BadRoot {
                op: OpKind::Broadcast,
                root,
                world: self.world,
            });
        }
        let root_c = c_int(root, "root")?;
        let mut raw = self.lock()?;
        let n = buf.len();
        let desc = Self::descriptor::<T>(&raw, OpKind::Broadcast, n, None, Some(root));
        let stream = self.stream.clone();
        self.run(&mut raw, desc, |comm, s| {
            let (ptr, _w) = buf.device_ptr_mut(&stream);
            // SAFETY: `ptr` holds n elements on this device.
            unsafe {
                cudarc::nccl::result::broadcast(
                    ptr as *const _,
                    ptr as *mut _,
                    n,
                    T::nccl_type(),
                    root_c,
                    comm,
                    s,
                )
            }
            .map(|_| ())
            .map_err(|e| nccl_err("ncclBroadcast", &e))
        })
    }

    /// All-reduces several device buffers in one NCCL group call (bucketed gradients): one
    /// launch and one wait for all of them.
    pub fn all_reduce_many_device<T: NcclElem, B: DevicePtrMut<T>>(
        &self,
        bufs: &mut [B],
        op: ReduceOp,
    ) -> Result<()> {
        let mut raw = self.lock()?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let desc = Self::descriptor::<T>(&raw, OpKind::AllReduce, total, Some(op), None);
        let stream = self.stream.clone();
        self.run(&mut raw, desc, |comm, s| {
            cudarc::nccl::result::group_start().map_err(|e| nccl_err("ncclGroupStart", &e))?;
            let mut first_err = None;
            for b in bufs.iter_mut() {
                let n = b.len();
                let (ptr, _w) = b.device_ptr_mut(&stream);
                // SAFETY: `ptr` holds n elements on this device.
                let r = unsafe {
                    cudarc::nccl::result::all_reduce(
                        ptr as *const _,
                        ptr as *mut _,
                        n,
                        T::nccl_type(),
                        nccl_op(op),
                        comm,
                        s,
                    )
                };
                if let Err(e) = r {
                    first_err.get_or_insert(nccl_err("ncclAllReduce", &e));
                }
            }
            cudarc::nccl::result::group_end().map_err(|e| nccl_err("ncclGroupEnd", &e))?;
            first_err.map_or(Ok(()), Err)
        })
    }

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

/// A communicator handle that crosses to the init thread and back.
struct SendComm(sys::ncclComm_t);
// SAFETY: the handle is created on the init thread and only used by the receiving thread after.
unsafe impl Send for SendComm {}

fn c_int(v: usize, what: &str) -> Result<std::ffi::c_int> {
    std::ffi::c_int::try_from(v)
        .map_err(|_| CommError::Config(format!("NCCL {what} {v} does not fit in an int")))
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let Ok(raw) = self.raw.get_mut() {
            if raw.aborted.is_none() {
                let _ = self.ctx.bind_to_thread();
                // SAFETY: a live communicator, not used after this.
                let _ = unsafe { cudarc::nccl::result::comm_destroy(raw.comm) };
            }
        }
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
