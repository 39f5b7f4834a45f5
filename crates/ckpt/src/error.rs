//! The error type of kiln-ckpt.

use crate::tensor::DType;

/// Everything saving, loading, verifying or resharding a checkpoint can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CkptError {
    /// An i/o operation on a path failed.
    #[error("{op} {path}: {source}")]
    File {
        /// What was attempted (`write`, `read`, `rename`, ...).
        op: &'static str,
        /// The storage path.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An i/o error without a path.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// A file or directory that should exist does not.
    #[error("missing {path}")]
    NotFound {
        /// The storage path.
        path: String,
    },
    /// A collective failed.
    #[error("communication failed: {0}")]
    Comm(#[from] kiln_comm::CommError),
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
    /// A tensor is not in the state dict or checkpoint.
    #[error("missing tensor {name}")]
    MissingTensor {
        /// The tensor (`part/name` where the part is known).
        name: String,
    },
    /// A part is not in the checkpoint.
    #[error("missing part {part}")]
    MissingPart {
        /// The part.
        part: String,
    },
    /// Strict load: the target expects tensors the checkpoint lacks.
    #[error("part {part}: checkpoint lacks tensors {names:?}")]
    MissingKeys {
        /// The part.
        part: String,
        /// The missing tensors.
        names: Vec<String>,
    },
    /// Strict load: the checkpoint holds tensors (or parts) the target does not expect.
    #[error("part {part}: checkpoint has unexpected tensors {names:?}")]
    UnexpectedKeys {
        /// The part (empty when listing unexpected parts).
        part: String,
        /// The unexpected tensors or parts.
        names: Vec<String>,
    },
    /// A metadata entry is missing or does not deserialize.
    #[error("metadata {key}: {reason}")]
    Meta {
        /// The key.
        key: String,
        /// What was wrong.
        reason: String,
    },
    /// A part or tensor name is not allowed.
    #[error("invalid name {name:?}: {reason}")]
    BadName {
        /// The name.
        name: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// A storage path is not allowed (absolute, `..`, empty component).
    #[error("invalid storage path {path:?}")]
    BadPath {
        /// The path.
        path: String,
    },
    /// A shard description does not fit the tensor it describes.
    #[error("tensor {name}: invalid shard: {reason}")]
    BadShard {
        /// The tensor.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// A rank file is not a valid kiln safetensors file.
    #[error("{path}: invalid safetensors file: {reason}")]
    Format {
        /// The storage path (or `<bytes>` when parsing a buffer).
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// A manifest does not parse or is inconsistent.
    #[error("{path}: invalid manifest: {reason}")]
    Manifest {
        /// The storage path (or `<bytes>`).
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// A checkpoint was written by a newer format than this build reads.
    #[error("{path}: format version {found} is newer than the supported version {supported}")]
    UnsupportedVersion {
        /// The file.
        path: String,
        /// The version found.
        found: u64,
        /// The newest version this build reads.
        supported: u32,
    },
    /// A file's sha256 differs from the one the manifest records.
    #[error("checksum mismatch in {path}: manifest says sha256 {expected}, file has {got}")]
    Checksum {
        /// The file.
        path: String,
        /// The recorded sha256 (hex).
        expected: String,
        /// The computed sha256 (hex).
        got: String,
    },
    /// A file's size differs from the one the manifest records (truncated or extended).
    #[error("size mismatch in {path}: manifest says {expected} bytes, file has {got}")]
    SizeMismatch {
        /// The file.
        path: String,
        /// The recorded size.
        expected: u64,
        /// The actual size.
        got: u64,
    },
    /// Ranks called save or load with different steps.
    #[error("ranks disagree on the checkpoint step: smallest {min}, largest {max}")]
    StepMismatch {
        /// The smallest step passed by any rank.
        min: u64,
        /// The largest step passed by any rank.
        max: u64,
    },
    /// The checkpoint was saved with another world layout (use resharding to change it).
    #[error("checkpoint layout is {got} but this run is {expected}; load it with load_resharded")]
    LayoutMismatch {
        /// This run's layout.
        expected: crate::Layout,
        /// The checkpoint's layout.
        got: crate::Layout,
    },
    /// The communicator's world size does not match the layout.
    #[error("layout {layout} needs {expected} ranks but the communicator has {got}")]
    WorldMismatch {
        /// The layout.
        layout: crate::Layout,
        /// dp * tp.
        expected: usize,
        /// The communicator's world size.
        got: usize,
    },
    /// The checkpoint belongs to another model configuration.
    #[error("checkpoint is for model config {got:?}, this run is {expected:?}")]
    ModelMismatch {
        /// This run's model config hash.
        expected: String,
        /// The checkpoint's.
        got: String,
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
    /// A resharding request cannot be served from the saved shards.
    #[error("cannot reshard tensor {name}: {reason}")]
    Reshard {
        /// The tensor.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// Another rank failed its part of a collective save or load.
    #[error("{op} failed on rank(s) {ranks:?}: {reason}")]
    PeerFailed {
        /// The operation.
        op: &'static str,
        /// The ranks that failed.
        ranks: Vec<usize>,
        /// The first failing rank's error message.
        reason: String,
    },
    /// An invalid configuration value.
    #[error("invalid checkpoint configuration: {0}")]
    Config(String),
    /// The background writer thread panicked.
    #[error("background checkpoint writer panicked: {0}")]
    WriterPanicked(String),
}

impl CkptError {
    /// True for errors that mean "this checkpoint is damaged or incomplete" (missing file,
    /// checksum or size mismatch, unparseable file or manifest): `load_latest` skips such a
    /// checkpoint and falls back to an older one. Other errors (i/o, version, layout, model
    /// mismatch) stop the load.
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            CkptError::NotFound { .. }
                | CkptError::Checksum { .. }
                | CkptError::SizeMismatch { .. }
                | CkptError::Format { .. }
                | CkptError::Manifest { .. }
        )
    }

    /// Replaces the tensor name of a tensor-level error (used where a nameless tensor is known
    /// by name one level up).
    pub(crate) fn named(self, n: &str) -> Self {
        match self {
            CkptError::DtypeMismatch { expected, got, .. } => CkptError::DtypeMismatch {
                name: n.to_string(),
                expected,
                got,
            },
            CkptError::ShapeMismatch { expected, got, .. } => CkptError::ShapeMismatch {
                name: n.to_string(),
                expected,
                got,
            },
            CkptError::ByteLength {
                dtype,
                shape,
                expected,
                got,
                ..
            } => CkptError::ByteLength {
                name: n.to_string(),
                dtype,
                shape,
                expected,
                got,
            },
            CkptError::ElementCount { expected, got, .. } => CkptError::ElementCount {
                name: n.to_string(),
                expected,
                got,
            },
            CkptError::BadShard { reason, .. } => CkptError::BadShard {
                name: n.to_string(),
                reason,
            },
            CkptError::NotDivisible {
                dim, size, factor, ..
            } => CkptError::NotDivisible {
                name: n.to_string(),
                dim,
                size,
                factor,
            },
            other => other,
        }
    }
}

/// Result alias of kiln-ckpt.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;
