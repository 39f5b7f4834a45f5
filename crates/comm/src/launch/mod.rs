//! Starting a rank from what the launcher says: torchrun-style variables, Open MPI's mpirun,
//! PMI and Slurm's srun ([`LaunchEnv`]), the communicator of the backend the run asks for
//! ([`init_from_env`]), a TCP rendezvous store on `MASTER_ADDR:MASTER_PORT`
//! ([`TcpStore`]), kiln's own launcher for the processes of one node ([`LocalLaunch`],
//! torchrun's `--nproc-per-node`; the `launch` example is its command line), and elastic
//! restarts after a crash ([`Supervisor`], torchrun's `--max-restarts`; the `supervise`
//! example is its command line) with the progress-file watcher it times recoveries with
//! ([`ProgressWatcher`]).
//!
//! ```
//! use kiln_comm::launch::{init_from_env, Backend, Launcher};
//! use kiln_comm::Communicator;
//! // no launcher variables here: one process, a world of one thread rank
//! let launched = init_from_env(Backend::Thread)?;
//! assert_eq!(launched.env.launcher, Launcher::None);
//! assert_eq!(launched.comm.world_size(), 1);
//! # Ok::<(), kiln_comm::CommError>(())
//! ```

mod env;
mod events;
mod local;
mod nodelist;
mod progress;
mod store;
mod supervise;

pub use env::{LaunchEnv, Launcher};
pub use events::{ChildExit, SuperviseEvent};
pub use local::{LaunchOutcome, LocalLaunch};
pub use nodelist::expand_nodelist;
pub use progress::{ProgressLine, ProgressWatcher};
pub use store::TcpStore;
pub use supervise::{
    Attempt, Decision, SuperviseEnd, SuperviseOutcome, Supervisor, SupervisorConfig,
};

use crate::error::{CommError, Result};
use crate::{Communicator, ThreadComm, ThreadCommConfig};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The collective backend of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Backend {
    /// Every rank a thread of one process ([`ThreadComm`]): the embedded default.
    #[default]
    Thread,
    /// One rank per process over MPI (`MpiComm`, feature `mpi`), launched by mpirun or srun.
    Mpi,
    /// One rank per process and GPU over NCCL (`nccl::NcclComm`, feature `nccl`): GPU
    /// `LOCAL_RANK`, NCCL's unique id through the rendezvous store; launched by mpirun, srun or
    /// any launcher that sets torchrun's variables.
    Nccl,
}

impl Backend {
    /// Lowercase name, as in configs and flags.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Thread => "thread",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }

    /// True when this build can create the backend's communicators.
    pub fn is_built(self) -> bool {
        match self {
            Backend::Thread => true,
            Backend::Mpi => cfg!(feature = "mpi"),
            Backend::Nccl => cfg!(feature = "nccl"),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "thread" => Ok(Backend::Thread),
            "mpi" => Ok(Backend::Mpi),
            "nccl" => Ok(Backend::Nccl),
            other => Err(CommError::Config(format!(
                "unknown backend '{other}': expected thread, mpi or nccl"
            ))),
        }
    }
}

/// Keeps the backend's runtime alive (MPI is finalised when it drops): hold it, on the main
/// thread, until the run's communicators are gone.
#[derive(Debug, Default)]
pub struct Runtime {
    #[cfg(feature = "mpi")]
    mpi: Option<crate::Mpi>,
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
    pub fn mpi(&self) -> Option<&crate::Mpi> {
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
    init_with(backend, crate::DEFAULT_TIMEOUT)
}

/// Reads [`LaunchEnv::from_env`] and creates the world communicator of `backend`:
/// - `thread`: one process holding one rank; a launcher that asks for more processes is an
///   error (the thread backend runs its ranks inside one process: see `kiln_comm::spawn`);
/// - `mpi`: initialises MPI with `MPI_THREAD_MULTIPLE` and checks that MPI's rank and size
///   agree with the launcher's variables;
/// - `nccl`: `nccl::NcclComm::init_from_env` on GPU `LOCAL_RANK`.
pub fn init_with(backend: Backend, timeout: Duration) -> Result<Launched> {
    let env = LaunchEnv::from_env()?;
    match backend {
        Backend::Thread => {
            if env.world_size > 1 {
                return Err(CommError::Launch {
                    variable: format!("world size {} ({} launch)", env.world_size, env.launcher),
                    message: "the thread backend runs every rank inside one process: start one \
                              process and give it the world size, or choose the mpi backend"
                        .into(),
                });
            }
            let comm = ThreadComm::group(1, ThreadCommConfig::with_timeout(timeout))?
                .pop()
                .ok_or_else(|| CommError::Config("no thread rank was created".into()))?;
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
    let comm = crate::nccl::NcclComm::init_from_env(0, timeout)?;
    Ok(Launched {
        env,
        backend: Backend::Nccl,
        comm: Box::new(comm),
        runtime: Runtime::default(),
    })
}

#[cfg(not(feature = "nccl"))]
fn init_nccl(_env: LaunchEnv, _timeout: Duration) -> Result<Launched> {
    Err(CommError::Config(
        "the nccl backend is not built in: enable kiln-comm's `nccl` feature (cargo build \
         --features nccl,cuda; it needs CUDA's compiler: see docs/gpu.md)"
            .into(),
    ))
}

#[cfg(feature = "mpi")]
fn init_mpi(env: LaunchEnv, timeout: Duration) -> Result<Launched> {
    let mpi = crate::Mpi::init()?;
    let comm = mpi.world(crate::MpiCommConfig::with_timeout(timeout))?;
    let (rank, size) = (comm.rank(), comm.world_size());
    if env.launcher != Launcher::None && (rank, size) != (env.rank, env.world_size) {
        return Err(CommError::Launch {
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
    Err(CommError::Config(
        "the mpi backend is not built in: enable kiln-comm's `mpi` feature (cargo build \
         --features mpi; it needs Open MPI: apt-get install openmpi-bin libopenmpi-dev \
         libclang-dev)"
            .into(),
    ))
}
