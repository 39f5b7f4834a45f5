//! The error type of kiln-precision.

/// Everything kiln-precision can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PrecisionError {
    /// Gradients overflowed while the loss scale was already at its minimum: training cannot go
    /// on without silently skipping every step.
    #[error("loss scale underflow: gradients overflowed at scale {scale} which is already the minimum {min_scale}")]
    ScaleUnderflow {
        /// The scale at which the overflow happened.
        scale: f32,
        /// The configured minimum scale.
        min_scale: f32,
    },
    /// Two slices of one call have different lengths.
    #[error("{op}: {what} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Which argument was wrong.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A configuration value outside its valid range.
    #[error("invalid {name} {value}: {reason}")]
    InvalidConfig {
        /// The option.
        name: &'static str,
        /// The value given.
        value: f64,
        /// What it must satisfy.
        reason: &'static str,
    },
    /// A saved scaler state that does not belong to this kind of scaler.
    #[error("cannot load a {got} scaler state into a {expected} scaler")]
    StateKind {
        /// The kind of this scaler.
        expected: &'static str,
        /// The kind recorded in the state.
        got: &'static str,
    },
    /// A dtype name that is not f32, f16 or bf16.
    #[error("unknown compute dtype `{got}`: expected f32, f16 or bf16")]
    UnknownDType {
        /// The name given.
        got: String,
    },
    /// A collective (all-reducing the found-inf flag) failed.
    #[error(transparent)]
    Comm(#[from] kiln_comm::CommError),
}

/// Result alias of kiln-precision.
pub type Result<T, E = PrecisionError> = std::result::Result<T, E>;
