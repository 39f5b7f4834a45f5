//! The error type of kiln-tune.

/// Everything post-training can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TuneError {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kiln_model::ModelError),
    /// A tensor-parallel operation failed.
    #[error(transparent)]
    Parallel(#[from] kiln_parallel::ParallelError),
    /// A micro-batch is missing a tensor or its tensors do not fit together.
    #[error(transparent)]
    Memory(#[from] kiln_memory::MemoryError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] kiln_comm::CommError),
    /// Reading or writing a state dict failed.
    #[error(transparent)]
    State(#[from] kiln_state::StateError),
    /// The data sampler failed.
    #[error(transparent)]
    Data(#[from] kiln_data::DataError),
    /// A configuration value is invalid.
    #[error("invalid {field}: {message}")]
    Config {
        /// The field, as a user writes it (`lora.rank`).
        field: &'static str,
        /// What is wrong, with the value given.
        message: String,
    },
    /// A batch or example does not fit what the operation needs.
    #[error("{what}: expected {expected}, got {got}")]
    Input {
        /// What was given (`preference pair 3`, `targets`).
        what: String,
        /// What was expected.
        expected: String,
        /// What was given.
        got: String,
    },
    /// A tensor in a file or state is missing, unknown or misshapen.
    #[error("tensor {name} in {file}: {reason}")]
    Tensor {
        /// The tensor.
        name: String,
        /// The file (or state) it was read from.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl TuneError {
    pub(crate) fn config(field: &'static str, message: impl Into<String>) -> Self {
        TuneError::Config {
            field,
            message: message.into(),
        }
    }

    pub(crate) fn input(
        what: impl Into<String>,
        expected: impl Into<String>,
        got: impl Into<String>,
    ) -> Self {
        TuneError::Input {
            what: what.into(),
            expected: expected.into(),
            got: got.into(),
        }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        TuneError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// The result type of kiln-tune.
pub type Result<T, E = TuneError> = std::result::Result<T, E>;
