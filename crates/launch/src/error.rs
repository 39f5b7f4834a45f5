//! The error type of kiln-launch.

use kiln_comm::CommError;

/// Everything starting a rank, its rendezvous or its supervision can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// A launcher variable is missing, malformed or contradicts another.
    #[error("launch environment: {variable}: {message}")]
    Env {
        /// The variable (or variables) at fault, as `NAME=value`.
        variable: String,
        /// What is wrong with it.
        message: String,
    },
    /// The rendezvous store could not be reached, or did not answer in time.
    #[error("rendezvous store at {addr}: {message}")]
    Store {
        /// `host:port` of the store.
        addr: String,
        /// What went wrong (the key it waited for, the socket error).
        message: String,
    },
    /// The rendezvous store refused this process: the token it presented is not the job's
    /// (another job's store on this port, or a launcher that handed out another token).
    #[error("rendezvous store at {addr} refused this process ({client}): {reason}")]
    Refused {
        /// `host:port` of the store.
        addr: String,
        /// This process's end of the connection, as the store saw it (`host:port`), and its pid.
        client: String,
        /// Why, with where this process's token came from.
        reason: String,
    },
    /// Creating the world communicator failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Result alias of kiln-launch.
pub type Result<T, E = LaunchError> = std::result::Result<T, E>;
