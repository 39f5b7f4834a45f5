//! The error type of kiln-monitor.

use crate::breaker::HaltReason;
use crate::watchdog::HangReport;
use std::path::PathBuf;

/// Everything kiln-monitor can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MonitorError {
    /// A file operation of a sink failed.
    #[error("{op} {path}: {source}")]
    File {
        /// What was being done (`create`, `write`, `flush`).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An I/O error without a file to name (a console or an in-memory writer).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Serialising a record to JSON failed.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A collective of the cross-rank aggregation failed.
    #[error(transparent)]
    Comm(#[from] kiln_comm::CommError),
    /// A configuration value is out of range.
    #[error("invalid {name}: expected {expected}, got {got}")]
    InvalidConfig {
        /// The parameter.
        name: &'static str,
        /// What is accepted.
        expected: String,
        /// What was passed.
        got: String,
    },
    /// Drawing the plot failed.
    #[error("plot {path}: {message}")]
    Plot {
        /// The PNG being drawn.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A sink was used after `close`.
    #[error("{sink} sink used after close")]
    Closed {
        /// Which sink.
        sink: &'static str,
    },
    /// The circuit breaker halted the run.
    #[error("{0}")]
    Halted(Box<HaltReason>),
    /// The watchdog saw no step complete within its timeout.
    #[error("{0}")]
    Hang(Box<HangReport>),
    /// No peak FLOP/s is known for a device in a dtype (an unknown GPU, a CPU without a
    /// clock or a known vector unit).
    #[error("no {dtype} peak FLOP/s for {device}: {reason}")]
    Peak {
        /// The device (a GPU's name, a CPU's model name).
        device: String,
        /// The number format asked for.
        dtype: kiln_state::DType,
        /// Why, and what to do.
        reason: String,
    },
}

/// `Result` with [`MonitorError`].
pub type Result<T> = std::result::Result<T, MonitorError>;

impl MonitorError {
    pub(crate) fn file(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| MonitorError::File { op, path, source }
    }

    pub(crate) fn config(
        name: &'static str,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> Self {
        MonitorError::InvalidConfig {
            name,
            expected: expected.into(),
            got: got.to_string(),
        }
    }
}
