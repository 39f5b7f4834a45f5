//! The data pipeline of kiln: text to token shards, and shards to deterministic, resumable,
//! prefetched batches for every data-parallel rank.
//!
//! - Text to tokens: [`Tokenizer`] (a byte-level BPE trained in-process, saved as
//!   `tokenizer.json`; GPT-2's r50k_base behind the `gpt2-bpe` feature), [`prepare_corpus`]
//!   (tokenizer and train/validation shards under a cache folder, idempotent; optionally
//!   dropping the training documents of highest perplexity, [`QualityConfig`]).
//! - Shards: [`ShardWriter`] / [`write_shard`] write files with a checksummed header
//!   (atomically); [`TokenShard`] maps one and validates it, with errors naming the file;
//!   [`TokenSource`] reads a source's shards as one stream of windows of `ctx + 1` tokens.
//! - Order: [`DistributedSampler`] (a keyed permutation per epoch, a disjoint slice per rank,
//!   equal batch counts, [`TailPolicy`]), [`Mixture`] (several sources with weights that can
//!   change during training), [`SkipSet`] (samples never to yield again).
//! - Loading: [`DataLoader`] ties them together with worker threads, a bounded channel of staged
//!   batches, a [`ChunkCache`] of decoded shard chunks over the memory-mapped files, per-sample
//!   [`Transform`]s ([`TokenDropout`], [`SpanMask`]) and a [`LoaderState`] that resumes bitwise,
//!   also into another dp size. A failing or stalled worker is an error naming it and the sample.
//! - Quality: [`PerplexityFilter`] over an [`NgramLm`] (interpolated Kneser-Ney), and a
//!   [`DriftMonitor`] reporting the KL divergence of recent batches from a reference.
//!
//! Every random choice is keyed by (seed, purpose, counters) ([`stream_rng`], [`Permutation`]),
//! so the batches are a pure function of the configuration and the saved state.
//!
//! ```
//! use kiln_data::{write_shard, DataLoader, LoaderConfig, TokenDtype, TokenSource, Verify};
//! # fn main() -> kiln_data::Result<()> {
//! let path = std::env::temp_dir().join(format!("kiln-data-doc-{}.bin", std::process::id()));
//! write_shard(&path, &(0..101).collect::<Vec<u32>>(), TokenDtype::U16)?;
//! let source = TokenSource::open("toy", &[&path], Verify::Full)?; // 10 windows of ctx 10
//! let cfg = LoaderConfig { dp: 2, rank: 1, ..LoaderConfig::new(10, 2) };
//! let mut loader = DataLoader::new(vec![source.clone()], None, cfg.clone())?;
//! assert_eq!(loader.batches_per_epoch(), Some(2)); // 10 samples / (2 ranks x 2)
//! let state = loader.loader_state();
//! let batch = loader.next_batch()?;
//! let s = batch.sample_ids[0].index as u32;
//! assert_eq!(batch.row_inputs(0), (10 * s..10 * s + 10).collect::<Vec<u32>>());
//! assert_eq!(batch.row_targets(0)[9], 10 * s + 10);
//! let mut resumed = DataLoader::restore(vec![source], None, cfg, state)?;
//! assert_eq!(resumed.next_batch()?, batch);
//! # std::fs::remove_file(&path)?;
//! # Ok(())
//! # }
//! ```
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
mod quality;
mod rng;
mod sample;
mod sampler;
mod schedule;
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
pub use quality::{QualityConfig, QualityReport};
pub use rng::{splitmix64, stream_key, stream_rng, Permutation, Purpose, SampleRng};
pub use sample::{SampleId, SkipSet};
pub use sampler::{
    Cursor, DistributedSampler, GlobalBatch, PlannedSample, SamplerConfig, TailPolicy,
};
pub use schedule::{MixturePoint, MixtureSchedule};
pub use shard::{
    write_shard, ShardHeader, ShardLayout, ShardWriter, TokenDtype, TokenShard, Verify,
    HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION,
};
pub use source::TokenSource;
pub use state::{LoaderState, SourceState, LOADER_STATE_VERSION};
pub use tokenizer::{sample_text, Tokenizer, EOT_TOKEN};
pub use transform::{
    apply_transforms, transform_rng, SampleView, SpanMask, TokenDropout, Transform,
};
