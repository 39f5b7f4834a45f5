//! The NCCL backend (feature `nccl`): one rank per GPU, collectives on device buffers over
//! NCCL through cudarc.
//!
//! - [`NcclComm`] implements [`Communicator`](crate::Communicator), so the control collectives every caller makes
//!   (found-inf flags, exact norm sums, loss averages, checkpoint agreement) work on host slices
//!   as on any backend: copied to the device, reduced by NCCL, copied back. Uneven
//!   [`chunk_range`](crate::chunk_range) chunks are padded to equal ones on the device for NCCL.
//! - Its `*_device` methods run the collectives in place on device buffers (cudarc
//!   [`CudaSlice`](cudarc::driver::CudaSlice)s and views) on the communicator's own CUDA stream. cudarc's event tracking
//!   orders them after the kernels that wrote the buffers on another stream (the compute
//!   stream) and the compute stream's later reads after them. Device collectives need equal
//!   chunks ([`Capabilities::even_chunks_only`](crate::Capabilities::even_chunks_only)): a caller pads its flat buffers to a multiple
//!   of the world.
//! - Every call waits for its collective with a deadline, polling the stream and
//!   `ncclCommGetAsyncError`: past [`Communicator::timeout`](crate::Communicator::timeout) the communicator is aborted
//!   (`ncclCommAbort`) and the call returns [`CommError::Timeout`], so a dead peer is an error,
//!   not a hang. An aborted communicator fails every later call.
//! - f16 and bf16 reduce in their own type on NCCL, not in f32 as the thread and MPI backends
//!   do, and NCCL's ring and tree orders are not rank order: results are deterministic for one
//!   topology but not bitwise the host backends' ([`Capabilities::rank_ordered`](crate::Capabilities::rank_ordered) is false).
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

use crate::communicator::{Descriptor, OpKind};
use crate::elem::{CommElem, ReduceOp};
use crate::error::{CommError, Result};
use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nccl::sys;
use half::{bf16, f16};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod host;

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
