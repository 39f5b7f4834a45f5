//! The collective backends a run can choose from, by name.

use crate::error::{CommError, Result};
use std::fmt;
use std::str::FromStr;

/// The collective backend of a run. A closed set: kiln-launch starts every one of them, and a
/// new backend is a change it must follow.
///
/// ```
/// use kiln_comm::Backend;
/// let b: Backend = "mpi".parse()?;
/// assert_eq!((b, b.name()), (Backend::Mpi, "mpi"));
/// assert!(Backend::Thread.is_built());
/// assert!("gloo".parse::<Backend>().is_err());
/// # Ok::<(), kiln_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Every rank a thread of one process ([`crate::ThreadComm`]): the embedded default.
    #[default]
    Thread,
    /// One rank per process over MPI (`MpiComm`, feature `mpi`), launched by mpirun or srun.
    Mpi,
    /// One rank per process and GPU over NCCL (`nccl::NcclComm`, feature `nccl`): GPU
    /// `LOCAL_RANK`, NCCL's unique id through kiln-launch's rendezvous store; launched by
    /// mpirun, srun or any launcher that sets torchrun's variables.
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
