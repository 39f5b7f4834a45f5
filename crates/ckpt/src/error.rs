//! The error type of kiln-ckpt.

use kiln_state::StateError;

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
    /// A component's state, a tensor or a shard is not what was asked for (dtype, shape,
    /// element count, metadata, shard, missing tensor).
    #[error(transparent)]
    State(#[from] StateError),
    /// A collective failed.
    #[error("communication failed: {0}")]
    Comm(#[from] kiln_comm::CommError),
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
}

/// Result alias of kiln-ckpt.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;
