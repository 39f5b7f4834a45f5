//! The error type of kiln-train.

use std::path::PathBuf;

/// Everything configuring, building or running a trainer can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A field of the run configuration is out of range or inconsistent with another.
    #[error("invalid run config: {field}: {reason}")]
    Config {
        /// The field, as a dotted path (`RunConfig.parallel.dp`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration file could not be parsed.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    File {
        /// What was attempted.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A checkpoint does not fit this run.
    #[error("checkpoint of step {step}: {reason}")]
    Checkpoint {
        /// The checkpoint's step.
        step: u64,
        /// What does not fit.
        reason: String,
    },
    /// A builder part is missing or does not fit the others.
    #[error("trainer builder: {0}")]
    Builder(String),
    /// A rank of [`crate::run_threads`] failed.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The failing rank.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(Box<kiln_comm::CommError>),
    /// The parallel engine failed.
    #[error(transparent)]
    Parallel(Box<kiln_parallel::ParallelError>),
    /// The model failed.
    #[error(transparent)]
    Model(Box<kiln_model::ModelError>),
    /// The data pipeline failed.
    #[error(transparent)]
    Data(Box<kiln_data::DataError>),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Ckpt(Box<kiln_ckpt::CkptError>),
    /// Monitoring failed, or the circuit breaker halted the run.
    #[error(transparent)]
    Monitor(Box<kiln_monitor::MonitorError>),
    /// Loss scaling failed.
    #[error(transparent)]
    Precision(Box<kiln_precision::PrecisionError>),
    /// The optimizer or the schedule rejected its settings.
    #[error(transparent)]
    Optim(Box<kiln_optim::OptimError>),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(Box<candle_core::Error>),
    /// An i/o error without a path.
    #[error(transparent)]
    Io(Box<std::io::Error>),
}

impl TrainError {
    /// A configuration error naming `field`.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        TrainError::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

macro_rules! boxed_from {
    ($($variant:ident: $ty:ty),* $(,)?) => {
        $(
            impl From<$ty> for TrainError {
                fn from(e: $ty) -> Self {
                    TrainError::$variant(Box::new(e))
                }
            }
        )*
    };
}

boxed_from!(
    Comm: kiln_comm::CommError,
    Parallel: kiln_parallel::ParallelError,
    Model: kiln_model::ModelError,
    Data: kiln_data::DataError,
    Ckpt: kiln_ckpt::CkptError,
    Monitor: kiln_monitor::MonitorError,
    Precision: kiln_precision::PrecisionError,
    Optim: kiln_optim::OptimError,
    Candle: candle_core::Error,
    Io: std::io::Error,
);

impl From<kiln_state::StateError> for TrainError {
    fn from(e: kiln_state::StateError) -> Self {
        TrainError::Ckpt(Box::new(e.into()))
    }
}

/// The result type of kiln-train.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
