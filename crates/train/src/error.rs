//! The error type of kiln-train.

use std::path::PathBuf;

/// Everything configuring, building or running a trainer can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A field of the run configuration is out of range or inconsistent with another.
    #[error("invalid run config: {field}: {reason}")]
    Config {
        /// The field, as a dotted path (`RunConfig.parallel.dp`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration file could not be parsed (or a configuration written as TOML).
    #[error("cannot parse {}: {source}", path.display())]
    Parse {
        /// The file (`<string>` for a document in memory).
        path: PathBuf,
        /// The TOML parser's (or writer's) error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A file operation failed.
    #[error("{op} {}: {source}", path.display())]
    File {
        /// What was attempted.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The corpus could not be turned into a tokenizer and token shards: a text file is
    /// missing or unreadable, or the cache folder cannot be written. The message names the file.
    #[error("cannot prepare the corpus {corpora:?} from {}: {source}", data_dir.display())]
    Prepare {
        /// The corpora (`RunConfig.data.corpora`), each a `<name>.txt` in `data_dir`.
        corpora: Vec<String>,
        /// The folder of the text files (`RunConfig.data.data_dir`), made absolute against the
        /// working directory when it was configured relative.
        data_dir: PathBuf,
        /// What kiln-data's preparation failed with (naming the file as configured).
        #[source]
        source: Box<kiln_data::DataError>,
    },
    /// A checkpoint does not fit this run.
    #[error("checkpoint of step {step}: {reason}")]
    Checkpoint {
        /// The checkpoint's step.
        step: u64,
        /// What does not fit.
        reason: String,
    },
    /// A builder part is missing or does not fit the others.
    #[error("trainer builder: {0}")]
    Builder(String),
    /// A rank of [`crate::run_threads`] failed, or another rank's failure as this rank
    /// learned of it (its message is all that crosses ranks and processes).
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The failing rank.
        rank: usize,
        /// Its error, as text.
        message: String,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(Box<kiln_comm::CommError>),
    /// Starting this process's rank under its launcher failed.
    #[error(transparent)]
    Launch(Box<kiln_launch::LaunchError>),
    /// The parallel engine failed.
    #[error(transparent)]
    Parallel(Box<kiln_parallel::ParallelError>),
    /// The model failed.
    #[error(transparent)]
    Model(Box<kiln_model::ModelError>),
    /// The data pipeline failed.
    #[error(transparent)]
    Data(Box<kiln_data::DataError>),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Ckpt(Box<kiln_ckpt::CkptError>),
    /// Monitoring failed, or the circuit breaker halted the run.
    #[error(transparent)]
    Monitor(Box<kiln_monitor::MonitorError>),
    /// The segmented executor or a micro-batch failed.
    #[error(transparent)]
    Memory(Box<kiln_memory::MemoryError>),
    /// Loss scaling failed.
    #[error(transparent)]
    Precision(Box<kiln_precision::PrecisionError>),
    /// The optimizer or the schedule rejected its settings.
    #[error(transparent)]
    Optim(Box<kiln_optim::OptimError>),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(Box<candle_core::Error>),
    /// A post-training component (LoRA, DPO, QAT) failed.
    #[error(transparent)]
    Tune(Box<kiln_tune::TuneError>),
    /// An i/o error without a path.
    #[error(transparent)]
    Io(Box<std::io::Error>),
}

impl TrainError {
    /// A configuration error naming `field`.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        TrainError::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

macro_rules! boxed_from {
    ($($variant:ident: $ty:ty),* $(,)?) => {
        $(
            impl From<$ty> for TrainError {
                fn from(e: $ty) -> Self {
                    TrainError::$variant(Box::new(e))
                }
            }
        )*
    };
}

boxed_from!(
    Comm: kiln_comm::CommError,
    Launch: kiln_launch::LaunchError,
    Parallel: kiln_parallel::ParallelError,
    Model: kiln_model::ModelError,
    Data: kiln_data::DataError,
    Ckpt: kiln_ckpt::CkptError,
    Monitor: kiln_monitor::MonitorError,
    Memory: kiln_memory::MemoryError,
    Precision: kiln_precision::PrecisionError,
    Optim: kiln_optim::OptimError,
    Candle: candle_core::Error,
    Io: std::io::Error,
    Tune: kiln_tune::TuneError,
);

impl From<kiln_state::StateError> for TrainError {
    fn from(e: kiln_state::StateError) -> Self {
        TrainError::Ckpt(Box::new(e.into()))
    }
}

/// The result type of kiln-train.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
