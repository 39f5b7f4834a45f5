//! Starting kiln's ranks: who this process is under torchrun-style variables, Open MPI's
//! mpirun, PMI or Slurm's srun ([`LaunchEnv`]), the world communicator of the backend a run
//! asks for ([`init_from_env`]), a TCP rendezvous store on `MASTER_ADDR:MASTER_PORT`
//! ([`TcpStore`]), kiln's own launcher for the processes of one node ([`LocalLaunch`],
//! torchrun's `--nproc-per-node`; `kiln launch` is its command line), and elastic restarts
//! after a crash ([`Supervisor`], torchrun's `--max-restarts`; `kiln supervise` is its command
//! line) with the progress-file watcher it times recoveries with ([`ProgressWatcher`]).
//!
//! kiln-comm owns the communicators and knows nothing of launchers; this crate reads the
//! launcher's variables and hands each backend what it needs (the NCCL unique id travels
//! through the store).
//!
//! ```
//! use kiln_comm::Communicator;
//! use kiln_launch::{init_from_env, Backend, Launcher};
//! // no launcher variables here: one process, a world of one thread rank
//! let launched = init_from_env(Backend::Thread)?;
//! assert_eq!(launched.env.launcher, Launcher::None);
//! assert_eq!(launched.comm.world_size(), 1);
//! # Ok::<(), kiln_launch::LaunchError>(())
//! ```
#![deny(missing_docs)]

mod env;
mod error;
mod events;
mod local;
mod nodelist;
mod progress;
mod store;
mod supervise;
mod token;

pub use env::{LaunchEnv, Launcher};
pub use error::{LaunchError, Result};
pub use events::{ChildExit, SuperviseEvent};
pub use local::{LaunchOutcome, LocalLaunch};
pub use nodelist::expand_nodelist;
pub use progress::{ProgressLine, ProgressWatcher};
pub use store::TcpStore;
pub use supervise::{
    Attempt, RestartDecision, SuperviseEnd, SuperviseOutcome, Supervisor, SupervisorConfig,
};
pub use token::{StoreToken, STORE_TOKEN_VAR};

pub use kiln_comm::Backend;
use kiln_comm::{Communicator, ThreadComm, ThreadCommConfig};
use std::time::Duration;

/// Keeps the backend's runtime alive (MPI is finalised when it drops): hold it, on the main
/// thread, until the run's communicators are gone.
#[derive(Debug, Default)]
pub struct Runtime {
    #[cfg(feature = "mpi")]
    mpi: Option<kiln_comm::Mpi>,
}

impl Runtime {
    /// Ends the runtime of a failing rank without waiting for the others (MPI: no
    /// `MPI_Finalize`, see `Mpi::abandon`); the process should exit with an error
    /// next, so that the launcher ends the job.
    pub fn abandon(self) {
        #[cfg(feature = "mpi")]
        if let Some(m) = self.mpi {
            m.abandon();
        }
    }

    /// The MPI runtime, when the backend is MPI.
    #[cfg(feature = "mpi")]
    pub fn mpi(&self) -> Option<&kiln_comm::Mpi> {
        self.mpi.as_ref()
    }
}

/// A started rank: who it is, its world communicator, and the runtime behind it.
#[derive(Debug)]
pub struct Launched {
    /// What the launcher said.
    pub env: LaunchEnv,
    /// The backend of `comm`.
    pub backend: Backend,
    /// The world communicator (rank and size agree with `env`).
    pub comm: Box<dyn Communicator>,
    /// The backend's runtime; drop it last.
    pub runtime: Runtime,
}

/// [`init_with`] with the default timeout (300 s).
pub fn init_from_env(backend: Backend) -> Result<Launched> {
    init_with(backend, kiln_comm::DEFAULT_TIMEOUT)
}

/// Reads [`LaunchEnv::from_env`] and creates the world communicator of `backend`:
/// - `thread`: one process holding one rank; a launcher that asks for more processes is an
///   error (the thread backend runs its ranks inside one process: see `kiln_comm::spawn`);
/// - `mpi`: initialises MPI with `MPI_THREAD_MULTIPLE` and checks that MPI's rank and size
///   agree with the launcher's variables;
/// - `nccl`: `nccl_from_env` (feature `nccl`) on GPU `LOCAL_RANK`.
pub fn init_with(backend: Backend, timeout: Duration) -> Result<Launched> {
    let env = LaunchEnv::from_env()?;
    match backend {
        Backend::Thread => {
            if env.world_size > 1 {
                return Err(LaunchError::Env {
                    variable: format!("world size {} ({} launch)", env.world_size, env.launcher),
                    message: "the thread backend runs every rank inside one process: start one \
                              process and give it the world size, or choose the mpi backend"
                        .into(),
                });
            }
            let comm = ThreadComm::group(1, ThreadCommConfig::with_timeout(timeout))?
                .pop()
                .ok_or_else(|| kiln_comm::CommError::Config("no thread rank was created".into()))?;
            Ok(Launched {
                env,
                backend,
                comm: Box::new(comm),
                runtime: Runtime::default(),
            })
        }
        Backend::Mpi => init_mpi(env, timeout),
        Backend::Nccl => init_nccl(env, timeout),
    }
}

/// NCCL: GPU `LOCAL_RANK`, the unique id through the rendezvous store.
#[cfg(feature = "nccl")]
fn init_nccl(env: LaunchEnv, timeout: Duration) -> Result<Launched> {
    let comm = nccl_from_env(&env, 0, timeout)?;
    Ok(Launched {
        env,
        backend: Backend::Nccl,
        comm: Box::new(comm),
        runtime: Runtime::default(),
    })
}

/// The NCCL world communicator of this process under a launcher (feature `nccl`): rank, world
/// and local rank from `env` ([`LaunchEnv::from_env`]), GPU `device_offset + local rank` (so
/// that several processes per node take one GPU each), NCCL's unique id made by rank 0 and
/// handed to the others through the rendezvous store on `MASTER_ADDR:MASTER_PORT`. Without a
/// launcher: a world of one on GPU `device_offset`.
#[cfg(feature = "nccl")]
pub fn nccl_from_env(
    env: &LaunchEnv,
    device_offset: usize,
    timeout: Duration,
) -> Result<kiln_comm::nccl::NcclComm> {
    use kiln_comm::nccl::{available, NcclComm, NcclId};
    available()?;
    let ordinal = device_offset + env.local_rank;
    if env.world_size <= 1 {
        return Ok(NcclComm::new(ordinal, 0, 1, NcclId::new()?, timeout)?);
    }
    let store = TcpStore::for_rank(env, timeout)?;
    let key = "kiln/nccl/unique_id";
    let id = if env.rank == 0 {
        let id = NcclId::new()?;
        store.set(key, &id.to_bytes())?;
        id
    } else {
        NcclId::from_bytes(&store.get(key)?)?
    };
    Ok(NcclComm::new(
        ordinal,
        env.rank,
        env.world_size,
        id,
        timeout,
    )?)
}

#[cfg(not(feature = "nccl"))]
fn init_nccl(_env: LaunchEnv, _timeout: Duration) -> Result<Launched> {
    Err(LaunchError::Comm(kiln_comm::CommError::Config(
        "the nccl backend is not built in: enable kiln-launch's `nccl` feature (cargo build \
         --features nccl,cuda; it needs CUDA's compiler: see docs/gpu.md)"
            .into(),
    )))
}

#[cfg(feature = "mpi")]
fn init_mpi(env: LaunchEnv, timeout: Duration) -> Result<Launched> {
    let mpi = kiln_comm::Mpi::init()?;
    let comm = mpi.world(kiln_comm::MpiCommConfig::with_timeout(timeout))?;
    let (rank, size) = (comm.rank(), comm.world_size());
    if env.launcher != Launcher::None && (rank, size) != (env.rank, env.world_size) {
        return Err(LaunchError::Env {
            variable: format!("{} rank {} of {}", env.launcher, env.rank, env.world_size),
            message: format!(
                "MPI says this process is rank {rank} of {size}: the launcher's variables \
                 describe another job (srun without --mpi=pmix, or a stale export?)"
            ),
        });
    }
    Ok(Launched {
        env,
        backend: Backend::Mpi,
        comm: Box::new(comm),
        runtime: Runtime { mpi: Some(mpi) },
    })
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(_env: LaunchEnv, _timeout: Duration) -> Result<Launched> {
    Err(LaunchError::Comm(kiln_comm::CommError::Config(
        "the mpi backend is not built in: enable kiln-launch's `mpi` feature (cargo build \
         --features mpi; it needs Open MPI: apt-get install openmpi-bin libopenmpi-dev \
         libclang-dev)"
            .into(),
    )))
}
