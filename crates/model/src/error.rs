//! The error type of kiln-model.

use candle_core::DType;

/// Everything building, running or sampling the model can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A size of the configuration is zero.
    #[error("invalid config: {field} must be non-zero")]
    ZeroDimension {
        /// The config field.
        field: &'static str,
    },
    /// The number of heads does not divide the model width.
    #[error("invalid config: n_heads ({n_heads}) must divide d_model ({d_model})")]
    HeadsDoNotDivide {
        /// Attention heads.
        n_heads: usize,
        /// Model width.
        d_model: usize,
    },
    /// Two or more settings of the architecture do not fit together.
    #[error("invalid config: {field}: {reason}")]
    Config {
        /// The config field.
        field: &'static str,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// Query heads that do not split into equal groups over the key/value heads.
    #[error("{op}: kv_heads ({kv_heads}) must divide heads ({heads})")]
    KvHeadsDoNotDivide {
        /// The operation.
        op: &'static str,
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// A numeric setting is out of its valid range.
    #[error("invalid value for {field}: {value} ({expected})")]
    InvalidValue {
        /// The setting.
        field: &'static str,
        /// The value given.
        value: f64,
        /// What the value must be.
        expected: &'static str,
    },
    /// A numeric argument of an operation is out of its valid range.
    #[error("{op}: {what} is {value}, expected {expected}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The value given.
        value: f64,
        /// What the value must be.
        expected: &'static str,
    },
    /// A device that cannot be used: misspelt, not built in, or not present.
    #[error("device {device:?}: {reason}")]
    Device {
        /// The device as written.
        device: String,
        /// What is wrong.
        reason: String,
    },
    /// No preset has this name.
    #[error("unknown model preset {name:?}: expected one of {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The preset names that exist.
        known: String,
    },
    /// A tensor argument has the wrong shape.
    #[error("{op}: {what} has shape {got}, expected {expected}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The shape required.
        expected: String,
        /// The shape passed.
        got: String,
    },
    /// A tensor argument has the wrong element type.
    #[error("{op}: {what} is {got:?}, expected {expected}")]
    Dtype {
        /// The operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The dtypes accepted.
        expected: &'static str,
        /// The dtype passed.
        got: DType,
    },
    /// A sequence is longer than the model's context.
    #[error("{op}: sequence length {got} exceeds the context of {max} positions")]
    SequenceTooLong {
        /// The operation.
        op: &'static str,
        /// The sequence length.
        got: usize,
        /// The model's context length.
        max: usize,
    },
    /// A token id or a target is not below the vocabulary size.
    #[error(
        "{op}: {what} {value} at position {index} is out of range for a vocabulary of {vocab}"
    )]
    TokenOutOfRange {
        /// The operation.
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
    /// A block index beyond the model's depth.
    #[error("block {index} does not exist: the model has {n_blocks} blocks")]
    BlockOutOfRange {
        /// The index asked for.
        index: usize,
        /// The number of blocks.
        n_blocks: usize,
    },
    /// A parameter the call needs was not supplied by its parameter source.
    #[error("parameter {name} was not supplied")]
    MissingParameter {
        /// The parameter name.
        name: String,
    },
    /// A tensor-parallel operation failed.
    #[error(transparent)]
    Parallel(#[from] kiln_parallel::ParallelError),
    /// Sequence parallelism cannot run as asked: a length that does not split over the
    /// tensor-parallel ranks, or a layer that does not take split rows.
    #[error("sequence parallelism: {reason}")]
    SequenceParallel {
        /// What is wrong, with the values.
        reason: String,
    },
    /// Generation was asked to continue an empty prompt.
    #[error("generate: the prompt is empty")]
    EmptyPrompt,
    /// A Hugging Face GPT-2 configuration field kiln's decoder cannot compute.
    #[error("config.json: {field} is {got}, kiln needs {expected}")]
    HfConfig {
        /// The `config.json` field.
        field: &'static str,
        /// Its value.
        got: String,
        /// What kiln supports.
        expected: &'static str,
    },
    /// A tensor of a Hugging Face GPT-2 model or of kiln's parameters that does not fit.
    #[error("tensor {tensor}: {reason}")]
    HfTensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file of a Hugging Face model folder that cannot be read or written.
    #[error("{}: {reason}", file.display())]
    HfFile {
        /// The file (or folder).
        file: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Result alias of kiln-model.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
