//! The error type of kiln-optim.

/// Everything kiln-optim can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// A buffer passed to a call does not have the length the optimizer or the call requires.
    #[error("{op}: {what} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Which buffer was wrong.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A hyperparameter outside its valid range.
    #[error("invalid {name} {value}: {reason}")]
    InvalidHyperparameter {
        /// The hyperparameter.
        name: &'static str,
        /// The value given.
        value: f64,
        /// What it must satisfy.
        reason: &'static str,
    },
    /// A range that is empty, reversed, out of order or outside the buffer.
    #[error("{what} {start}..{end} is out of order or outside a buffer of {len} elements")]
    BadRange {
        /// What the range was for.
        what: &'static str,
        /// Its start.
        start: usize,
        /// Its end.
        end: usize,
        /// The buffer's length.
        len: usize,
    },
    /// A collective (all-reducing the gradient norm) failed.
    #[error(transparent)]
    Comm(#[from] kiln_comm::CommError),
}

/// Result alias of kiln-optim.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;

pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(OptimError::LengthMismatch {
            op,
            what,
            expected,
            got,
        })
    }
}
