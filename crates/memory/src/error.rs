//! The error type of kiln-memory.

/// Everything kiln-memory can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A segment produced something the executor cannot use.
    #[error("segment {segment}: {message}")]
    Segment {
        /// The segment index.
        segment: usize,
        /// What was wrong.
        message: String,
    },
    /// A parameter provider or gradient hook failed.
    #[error("{what} failed at segment {segment}: {source}")]
    Hook {
        /// `parameter provider` or `gradient hook`.
        what: &'static str,
        /// The segment index.
        segment: usize,
        /// The underlying error.
        source: BoxError,
    },
    /// An invalid configuration (zero sizes, degrees that do not divide).
    #[error("invalid {field}: {message}")]
    Config {
        /// The field that is wrong.
        field: &'static str,
        /// Why.
        message: String,
    },
    /// A micro-batch tensor is missing or does not fit the others.
    #[error("micro-batch tensor `{tensor}`: expected {expected}, got {got}")]
    Batch {
        /// The tensor's name (`inputs`, `targets`, `loss_mask` or a per-example name).
        tensor: String,
        /// What was expected.
        expected: String,
        /// What was found.
        got: String,
    },
    /// No micro-batch size fits the memory budget.
    #[error("no micro-batch fits {budget} bytes: batch 1 needs {needed} bytes")]
    DoesNotFit {
        /// The budget in bytes.
        budget: u64,
        /// What the smallest micro-batch needs.
        needed: u64,
    },
}

/// The error type of hook and provider implementations (they live in other crates).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias of kiln-memory.
pub type Result<T, E = MemoryError> = std::result::Result<T, E>;
