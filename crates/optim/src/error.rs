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
    /// A name that does not match any parameter.
    #[error("{what}: no parameter named {name:?}")]
    UnknownParameter {
        /// Where the name came from.
        what: &'static str,
        /// The name.
        name: String,
    },
    /// Text that does not parse as what it should be.
    #[error("cannot read {text:?} as an {what}: {reason}")]
    Parse {
        /// What the text should describe.
        what: &'static str,
        /// The text.
        text: String,
        /// Why it does not parse.
        reason: String,
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

/// An [`OptimError::InvalidHyperparameter`] as an `Err`.
pub(crate) fn invalid<T>(name: &'static str, value: f64, reason: &'static str) -> Result<T> {
    Err(OptimError::InvalidHyperparameter {
        name,
        value,
        reason,
    })
}
