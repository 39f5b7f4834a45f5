//! The error type of kiln-data.

use crate::SampleId;
use std::path::PathBuf;
use std::time::Duration;

/// Everything the data pipeline can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// An I/O error without a file to name (prefer [`DataError::File`]).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// An I/O error on a named file.
    #[error("{op} {}: {source}", path.display())]
    File {
        /// What was being done: "open", "read", "write", "rename", "map".
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A shard file of zero bytes.
    #[error("shard {} is empty (0 bytes)", path.display())]
    EmptyShard {
        /// The file.
        path: PathBuf,
    },
    /// A shard file shorter than its header says.
    #[error("shard {} is truncated: expected {expected} bytes, got {got}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header (or the header's own size) requires.
        expected: u64,
        /// Bytes on disk.
        got: u64,
    },
    /// A shard file longer than its header says.
    #[error("shard {} has trailing bytes: expected {expected} bytes, got {got}", path.display())]
    Oversized {
        /// The file.
        path: PathBuf,
        /// Bytes the header requires.
        expected: u64,
        /// Bytes on disk.
        got: u64,
    },
    /// A file that does not start with the shard magic bytes.
    #[error("{} is not a kiln token shard: magic {got:?}, expected {expected:?}", path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The magic bytes required.
        expected: [u8; 8],
        /// The bytes found.
        got: [u8; 8],
    },
    /// A shard written by an unsupported format version.
    #[error("shard {} has format version {got}, this build reads version {expected}", path.display())]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version this build reads.
        expected: u32,
        /// The version in the file.
        got: u32,
    },
    /// A shard header with an unknown token dtype code.
    #[error("shard {} has unknown token dtype code {got}", path.display())]
    BadDtype {
        /// The file.
        path: PathBuf,
        /// The code found.
        got: u32,
    },
    /// A checksum that does not match the bytes.
    #[error("shard {} is corrupt: {what} crc32 is {got:#010x}, header says {expected:#010x}", path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
        /// "header" or "payload".
        what: &'static str,
        /// The checksum recorded.
        expected: u32,
        /// The checksum of the bytes read.
        got: u32,
    },
    /// A token that does not fit the shard's dtype.
    #[error("token {token} does not fit a {dtype} shard (max {max})")]
    TokenOutOfRange {
        /// The token.
        token: u32,
        /// The dtype name.
        dtype: &'static str,
        /// Its largest value.
        max: u32,
    },
    /// A tokenizer failure (training, loading, encoding, decoding).
    #[error("tokenizer {op} failed: {message}")]
    Tokenizer {
        /// "train", "load", "save", "encode", "decode".
        op: &'static str,
        /// What the tokenizer library said.
        message: String,
    },
    /// An invalid configuration value.
    #[error("invalid {name}: {message}")]
    Config {
        /// The field or argument.
        name: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A source with too few tokens to form one sample.
    #[error("source {name:?} has {tokens} tokens, a sample needs {needed}")]
    SourceTooSmall {
        /// The source.
        name: String,
        /// Its tokens.
        tokens: u64,
        /// Tokens one sample needs (ctx + 1).
        needed: u64,
    },
    /// A source that cannot fill a batch: too few samples, or too many skipped.
    #[error("source {source_index} cannot fill a batch of {needed} samples: {available} of its {samples} samples are not skipped")]
    Exhausted {
        /// The source index.
        source_index: usize,
        /// Its sample count.
        samples: u64,
        /// Samples not in the skip set.
        available: u64,
        /// Samples one (global) batch needs.
        needed: u64,
    },
    /// An index past the end of a sequence.
    #[error("{what} index {index} out of range (len {len})")]
    OutOfRange {
        /// What was indexed.
        what: &'static str,
        /// The index.
        index: u64,
        /// The length.
        len: u64,
    },
    /// A saved loader state that does not fit the loader it is loaded into.
    #[error("loader state mismatch in {field}: saved {saved}, current {current}")]
    StateMismatch {
        /// The field that differs.
        field: &'static str,
        /// The saved value.
        saved: String,
        /// The loader's value.
        current: String,
    },
    /// A saved loader state from another data-parallel size, loaded with resharding disallowed.
    #[error("loader state saved with dp {saved_dp} (batch {saved_batch} per rank) cannot be loaded with dp {current_dp} (batch {current_batch} per rank): resharding is disabled")]
    DpMismatch {
        /// The dp size in the state.
        saved_dp: usize,
        /// The loader's dp size.
        current_dp: usize,
        /// The per-rank batch in the state.
        saved_batch: usize,
        /// The loader's per-rank batch.
        current_batch: usize,
    },
    /// A loader worker failed while producing a batch.
    #[error("data worker {worker} failed on batch {batch}{}: {source}", fmt_sample(.sample))]
    Worker {
        /// The worker thread index.
        worker: usize,
        /// The global batch index.
        batch: u64,
        /// The sample being produced, when known.
        sample: Option<SampleId>,
        /// The error.
        source: Box<DataError>,
    },
    /// A loader worker panicked while producing a batch.
    #[error("data worker {worker} panicked on batch {batch}{}: {message}", fmt_sample(.sample))]
    WorkerPanicked {
        /// The worker thread index.
        worker: usize,
        /// The global batch index.
        batch: u64,
        /// The sample being produced, when known.
        sample: Option<SampleId>,
        /// The panic message.
        message: String,
    },
    /// The next batch did not arrive within the stall timeout.
    #[error("batch {batch} not ready after {waited:?}: {}", fmt_stall(.worker, .sample))]
    Stalled {
        /// The global batch index awaited.
        batch: u64,
        /// The worker holding it, when one does.
        worker: Option<usize>,
        /// The sample that worker is on, when known.
        sample: Option<SampleId>,
        /// How long the consumer waited.
        waited: Duration,
    },
    /// Every worker exited before the awaited batch arrived.
    #[error("data pipeline closed before batch {batch} arrived: every worker has exited")]
    PipelineClosed {
        /// The global batch index awaited.
        batch: u64,
    },
    /// A transform rejected a sample.
    #[error("transform {name} failed on sample {sample}: {message}")]
    Transform {
        /// The transform.
        name: String,
        /// The sample.
        sample: SampleId,
        /// What went wrong.
        message: String,
    },
    /// A JSON (de)serialisation failure of a named file or value.
    #[error("json {what}: {source}")]
    Json {
        /// What was being read or written.
        what: String,
        /// The serde_json error.
        source: serde_json::Error,
    },
}

fn fmt_sample(s: &Option<SampleId>) -> String {
    match s {
        Some(s) => format!(", sample {s}"),
        None => String::new(),
    }
}

fn fmt_stall(worker: &Option<usize>, sample: &Option<SampleId>) -> String {
    match (worker, sample) {
        (Some(w), Some(s)) => format!("data worker {w} is stuck on sample {s}"),
        (Some(w), None) => format!("data worker {w} holds it"),
        _ => "no worker holds it (the pipeline is not producing)".to_string(),
    }
}

impl DataError {
    pub(crate) fn file(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::File {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(name: &'static str, message: impl Into<String>) -> Self {
        DataError::Config {
            name,
            message: message.into(),
        }
    }

    pub(crate) fn tokenizer(op: &'static str, e: impl std::fmt::Display) -> Self {
        DataError::Tokenizer {
            op,
            message: e.to_string(),
        }
    }
}

/// Result alias of kiln-data.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
