//! The error type of kiln-parallel.

/// Everything kiln-parallel can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParallelError {
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] kiln_comm::CommError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The optimizer failed.
    #[error(transparent)]
    Optim(#[from] kiln_optim::OptimError),
    /// The loss scaler failed (for example the scale fell below its minimum).
    #[error(transparent)]
    Precision(#[from] kiln_precision::PrecisionError),
    /// A kernel failed (kiln-kernels).
    #[error(transparent)]
    Kernel(#[from] kiln_kernels::KernelError),
    /// The segmented executor failed.
    #[error(transparent)]
    Memory(#[from] kiln_memory::MemoryError),
    /// An invalid parallel configuration; the message prints every factor.
    #[error("invalid parallel configuration: {0}")]
    Config(String),
    /// A parameter or gradient does not match the layout.
    #[error("parameter {name}: expected {expected}, got {got}")]
    Param {
        /// The parameter.
        name: String,
        /// What the layout holds.
        expected: String,
        /// What was given.
        got: String,
    },
    /// The communication thread stopped.
    #[error("communication thread of rank {rank} stopped: {message}")]
    CommThread {
        /// The rank.
        rank: usize,
        /// Why.
        message: String,
    },
}

/// Result alias of kiln-parallel.
pub type Result<T, E = ParallelError> = std::result::Result<T, E>;
