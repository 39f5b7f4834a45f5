//! The MPI library of the process: [`Mpi`] initialises it with `MPI_THREAD_MULTIPLE`, makes
//! the world communicator and finalises it (or, after a failure, deliberately does not).

use super::peers::{host_hash, Peers};
use super::raw::{self, CommHandle};
use super::wait::Waiter;
use super::{MpiComm, MpiCommConfig, State};
use crate::communicator::OpKind;
use crate::error::{CommError, Result};
use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

#[derive(Debug)]
pub(super) struct Runtime {
    /// An [`Mpi`] handle exists.
    pub(super) live: bool,
    /// `MPI_Finalize` ran (or was skipped for good): no MPI call may follow.
    pub(super) finalized: bool,
    /// A communicator failed with operations in flight.
    pub(super) broken: bool,
}

static RUNTIME: Mutex<Runtime> = Mutex::new(Runtime {
    live: false,
    finalized: false,
    broken: false,
});

pub(super) fn runtime() -> MutexGuard<'static, Runtime> {
    RUNTIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The MPI library of this process: initialised with `MPI_THREAD_MULTIPLE` by [`Mpi::init`],
/// finalised when dropped. Keep it on the main thread for the life of the run (it is not
/// `Send`, as MPI wants `MPI_Finalize` on the thread that initialised it) and create the world
/// communicator with [`Mpi::world`].
///
/// ```no_run
/// use kiln_comm::{CommExt, Communicator, Mpi, MpiCommConfig, ReduceOp};
/// // run under `mpirun -np 4 ./app`
/// let mpi = Mpi::init()?;
/// let world = mpi.world(MpiCommConfig::default())?;
/// let mut v = [world.rank() as f32];
/// world.all_reduce(&mut v, ReduceOp::Sum)?;
/// assert_eq!(v[0], 6.0);
/// # Ok::<(), kiln_comm::CommError>(())
/// ```
#[derive(Debug)]
pub struct Mpi {
    /// kiln called `MPI_Init_thread` (and so calls `MPI_Finalize`).
    owns: bool,
    _main_thread: PhantomData<*const ()>,
}

impl Mpi {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE` (the data-parallel communication thread and
    /// the async checkpoint writer call collectives from their own threads), or adopts an MPI
    /// the application initialised, if it provides that level.
    pub fn init() -> Result<Mpi> {
        let mut rt = runtime();
        if rt.live {
            return Err(CommError::Config(
                "MPI is already initialised by kiln in this process: use the existing Mpi".into(),
            ));
        }
        let (initialized, finalized) = raw::state()?;
        if finalized || rt.finalized {
            return Err(CommError::Config(
                "MPI was finalised in this process and cannot be initialised again".into(),
            ));
        }
        let owns = !initialized;
        let multiple = if owns {
            raw::init_thread_multiple()?
        } else {
            raw::thread_multiple()?
        };
        if !multiple {
            if owns {
                raw::finalize()?;
                rt.finalized = true;
            }
            return Err(raw::err(
                "MPI_Init_thread",
                "the MPI library does not provide MPI_THREAD_MULTIPLE, which kiln needs (the \
                 communication thread and the checkpoint writer call MPI concurrently); use an \
                 MPI built with thread support (Open MPI 4+ is)",
            ));
        }
        rt.live = true;
        Ok(Mpi {
            owns,
            _main_thread: PhantomData,
        })
    }

    /// A communicator over every process of the job (a duplicate of `MPI_COMM_WORLD`, so kiln's
    /// traffic never matches the application's). Collective: every process must call it.
    pub fn world(&self, config: MpiCommConfig) -> Result<MpiComm> {
        let start = Instant::now();
        let world = CommHandle::world();
        world.errors_return()?;
        let (rank, size) = world.rank_and_size()?;
        // the duplicate's handle is written when the request completes: keep it on the heap,
        // leaked if the request never does
        let out = Box::into_raw(Box::new(raw::null_comm()));
        // SAFETY: `out` is a live heap allocation, freed below only after completion.
        let mut reqs = [unsafe { world.idup(out)? }];
        let waiter = Waiter::new(OpKind::Split, rank, config.timeout, start);
        if let Err(e) = waiter.wait(&mut reqs, &[]) {
            runtime().broken = true;
            return Err(e);
        }
        // SAFETY: the request completed, so MPI wrote the handle; the box is ours again.
        let dup = CommHandle::adopt(*unsafe { Box::from_raw(out) });
        dup.errors_return()?;

        // where every rank runs, for the liveness watch
        let name = raw::processor_name()?;
        let mine = vec![host_hash(&name), u64::from(std::process::id())];
        let mut all = vec![0u64; 2 * size];
        // SAFETY: both buffers are heap allocations leaked on failure (below) and read only
        // after completion; `all` holds 16 bytes per rank.
        let mut reqs =
            [unsafe { dup.iallgather(mine.as_ptr().cast(), 16, all.as_mut_ptr().cast::<u8>())? }];
        if let Err(e) = waiter.wait(&mut reqs, &[]) {
            std::mem::forget(mine);
            std::mem::forget(all);
            runtime().broken = true;
            return Err(e);
        }
        let ids: Vec<(u64, u32)> = all
            .chunks_exact(2)
            .map(|w| (w[0], u32::try_from(w[1]).unwrap_or(0)))
            .collect();
        Ok(MpiComm {
            handle: dup,
            rank,
            size,
            world_ranks: (0..size).collect(),
            peers: Arc::new(Peers::new(rank, &ids)),
            config,
            seq: AtomicU64::new(0),
            last: Mutex::new(None),
            state: Mutex::new(State::default()),
        })
    }
}

impl Mpi {
    /// Drops the runtime without `MPI_Finalize`, for a rank that is failing: finalising waits
    /// for every other rank (which may be stuck in a collective with this one until their
    /// timeout), while exiting without it makes the launcher end the whole job at once.
    pub fn abandon(self) {
        runtime().broken = true;
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        let mut rt = runtime();
        rt.live = false;
        if rt.finalized {
            return;
        }
        rt.finalized = true;
        // After a failed collective a peer may be dead: MPI_Finalize could wait for it forever.
        // Leave MPI as it is; the process exits and the launcher ends the job.
        if self.owns && !rt.broken {
            // nothing to report to: a failing finalize is the launcher's to see
            let _ = raw::finalize();
        }
    }
}
