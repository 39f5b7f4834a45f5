//! The error type of kiln-state.

use crate::tensor::DType;

/// What describing, reading or restoring a component's state can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// A tensor holds another element type than the one asked for.
    #[error("tensor {name}: expected dtype {expected}, got {got}")]
    DtypeMismatch {
        /// The tensor.
        name: String,
        /// The dtype asked for.
        expected: DType,
        /// The dtype stored.
        got: DType,
    },
    /// A tensor has another shape than the one expected.
    #[error("tensor {name}: expected shape {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// The shape expected.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// A byte buffer does not fit the dtype and shape it is declared with.
    #[error("tensor {name}: {dtype} {shape:?} needs {expected} bytes, got {got}")]
    ByteLength {
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes the dtype and shape need (saturating at `u128::MAX`).
        expected: u128,
        /// Bytes given.
        got: usize,
    },
    /// A typed buffer has the wrong number of elements.
    #[error("tensor {name}: expected {expected} elements, got {got}")]
    ElementCount {
        /// The tensor.
        name: String,
        /// Elements the tensor holds.
        expected: usize,
        /// Elements of the buffer given.
        got: usize,
    },
    /// A tensor is not in the state dict.
    #[error("missing tensor {name}")]
    MissingTensor {
        /// The tensor (`part/name` where the part is known).
        name: String,
    },
    /// A metadata entry is missing or does not deserialize.
    #[error("metadata {key}: {reason}")]
    Meta {
        /// The key.
        key: String,
        /// What was wrong.
        reason: String,
    },
    /// A tensor name is not allowed.
    #[error("invalid name {name:?}: {reason}")]
    BadName {
        /// The name.
        name: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// A shard description does not fit the tensor it describes.
    #[error("tensor {name}: invalid shard: {reason}")]
    BadShard {
        /// The tensor.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// A tensor dimension cannot be split evenly into the requested number of parts.
    #[error("cannot reshard tensor {name}: dim {dim} of size {size} is not divisible by {factor}")]
    NotDivisible {
        /// The tensor.
        name: String,
        /// The dimension.
        dim: usize,
        /// Its size.
        size: usize,
        /// The number of parts asked for.
        factor: usize,
    },
    /// A value outside its closed set (a ZeRO stage above 3, an unknown name).
    #[error("invalid {what}: {message}")]
    Invalid {
        /// What was given (`zero stage`).
        what: String,
        /// What was wrong, with the value given.
        message: String,
    },
    /// A component refused the state it was given (another configuration, a collective that
    /// failed while gathering its shards, a layout that does not fit).
    #[error("{component}: {reason}")]
    Component {
        /// The component (`adamw`, `loss scaler`, `data loader`, ...).
        component: String,
        /// What was wrong.
        reason: String,
    },
}

impl StateError {
    /// A [`StateError::Component`] error.
    pub fn component(component: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        StateError::Component {
            component: component.into(),
            reason: reason.to_string(),
        }
    }

    /// Replaces the tensor name of a tensor-level error (used where a nameless tensor is known
    /// by name one level up).
    pub fn named(self, n: &str) -> Self {
        let name = n.to_string();
        match self {
            StateError::DtypeMismatch { expected, got, .. } => StateError::DtypeMismatch {
                name,
                expected,
                got,
            },
            StateError::ShapeMismatch { expected, got, .. } => StateError::ShapeMismatch {
                name,
                expected,
                got,
            },
            StateError::ByteLength {
                dtype,
                shape,
                expected,
                got,
                ..
            } => StateError::ByteLength {
                name,
                dtype,
                shape,
                expected,
                got,
            },
            StateError::ElementCount { expected, got, .. } => StateError::ElementCount {
                name,
                expected,
                got,
            },
            StateError::BadShard { reason, .. } => StateError::BadShard { name, reason },
            StateError::NotDivisible {
                dim, size, factor, ..
            } => StateError::NotDivisible {
                name,
                dim,
                size,
                factor,
            },
            other => other,
        }
    }
}

/// Result alias of kiln-state.
pub type Result<T, E = StateError> = std::result::Result<T, E>;
