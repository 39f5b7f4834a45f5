//! kiln-data
#![deny(missing_docs)]

mod batch;
mod cache;
mod drift;
mod error;
mod fsutil;
mod loader;
mod mixture;
mod ngram;
mod plan;
mod prefetch;
mod prepare;
mod rng;
mod sample;
mod sampler;
mod shard;
mod source;
mod state;
mod tokenizer;
mod transform;

pub use batch::Batch;
pub use cache::{ChunkCache, ChunkCacheStats};
pub use drift::{kl_divergence, DriftMonitor, DriftReport};
pub use error::{DataError, Result};
pub use loader::{DataLoader, LoaderConfig, LoaderStats};
pub use mixture::{Mixture, WeightChange};
pub use ngram::{NgramLm, PerplexityFilter};
pub use prepare::{
    default_cache_dir, prepare_corpus, split_validation, PrepareConfig, PreparedCorpus,
    PreparedSource, DEFAULT_CORPORA,
};
pub use rng::{splitmix64, stream_key, stream_rng, Permutation, Purpose, SampleRng};
pub use sample::{SampleId, SkipSet};
pub use sampler::{
    Cursor, DistributedSampler, GlobalBatch, PlannedSample, SamplerConfig, TailPolicy,
};
pub use shard::{
    write_shard, Shard, ShardHeader, ShardLayout, ShardWriter, TokenDtype, Verify, HEADER_BYTES,
    SHARD_MAGIC, SHARD_VERSION,
};
pub use source::TokenSource;
pub use state::{LoaderState, SourceState, LOADER_STATE_VERSION};
pub use tokenizer::{sample_text, Tokenizer, EOT_TOKEN};
pub use transform::{
    apply_transforms, transform_rng, SampleView, SpanMask, TokenDropout, Transform,
};
