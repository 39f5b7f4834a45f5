//! The error type of kiln-kernels.
//!
//! A kernel runs inside a candle custom op, whose methods return `candle_core::Result`, so a
//! [`KernelError`] raised there travels as a candle error wrapping it, its message intact
//! (`From<KernelError> for candle_core::Error`).

use candle_core::DType;

/// Everything a kernel can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An input has a shape (or a size) the kernel cannot take.
    #[error("{op}: {what} has shape {got}, expected {expected}")]
    Shape {
        /// The op.
        op: &'static str,
        /// Which input.
        what: &'static str,
        /// The shape (or size) required.
        expected: String,
        /// The shape (or size) passed.
        got: String,
    },
    /// An input has an element type the kernel cannot take.
    #[error("{op}: {what} is {got:?}, expected {expected}")]
    Dtype {
        /// The op.
        op: &'static str,
        /// Which input.
        what: &'static str,
        /// The dtypes accepted.
        expected: &'static str,
        /// The dtype passed.
        got: DType,
    },
    /// An input is strided where the kernel reads contiguous elements (the ops' front ends
    /// make their inputs contiguous).
    #[error("{op}: {what} is not contiguous")]
    NotContiguous {
        /// The op.
        op: &'static str,
        /// Which input.
        what: &'static str,
    },
    /// An input is on another device than the kernel runs on.
    #[error("{op}: expected {expected}, got {got}")]
    Device {
        /// The op.
        op: &'static str,
        /// Where the inputs must be.
        expected: &'static str,
        /// Where they are.
        got: String,
    },
    /// Inputs that each fit but disagree with one another.
    #[error("{op}: {reason}")]
    Mismatch {
        /// The op.
        op: &'static str,
        /// How they disagree, with the sizes.
        reason: String,
    },
    /// A token id or a target is not below the vocabulary size.
    #[error(
        "{op}: {what} {value} at position {index} is out of range for a vocabulary of {vocab}"
    )]
    TokenOutOfRange {
        /// The op.
        op: &'static str,
        /// "token" or "target".
        what: &'static str,
        /// The flat position of the offending id.
        index: usize,
        /// The id.
        value: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A CUDA kernel cannot run as asked (a size past what one launch takes, an input it does
    /// not accept).
    #[error("{op} (cuda): {reason}")]
    Cuda {
        /// The op.
        op: &'static str,
        /// What is wrong, with the values.
        reason: String,
    },
    /// The op itself failed: a worker's task did not run, state the backward needs is
    /// missing, a lock was poisoned.
    #[error("{op}: {reason}")]
    Internal {
        /// The op.
        op: &'static str,
        /// What went wrong.
        reason: String,
    },
}

impl From<KernelError> for candle_core::Error {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// Inputs of `op` that disagree ([`KernelError::Mismatch`]), as the candle error a custom op
/// returns.
pub(crate) fn mismatch(op: &'static str, reason: impl Into<String>) -> candle_core::Error {
    KernelError::Mismatch {
        op,
        reason: reason.into(),
    }
    .into()
}

/// Result alias of kiln-kernels.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
