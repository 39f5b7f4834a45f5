//! kiln-data
#![deny(missing_docs)]

mod error;
mod fsutil;
mod rng;
mod sample;
mod tokenizer;

pub use error::{DataError, Result};
pub use rng::{splitmix64, stream_key, stream_rng, Permutation, Purpose, SampleRng};
pub use sample::{SampleId, SkipSet};
pub use tokenizer::{sample_text, Tokenizer, EOT_TOKEN};
