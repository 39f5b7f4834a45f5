//! `kiln prepare-data`: prepares the default corpus for training. Trains a byte-level BPE
//! tokenizer on the training splits of `data/{shakespeare,austen,web_bible}.txt`, and writes it
//! with the token shards of each corpus (the last 5% of every file held out as the validation
//! split) under a cache folder. A second run finds everything in place and returns at once; a
//! trainer calls the same `kiln_data::prepare_corpus` itself when the shards are missing.

use kiln_data::{default_cache_dir, prepare_corpus, PrepareConfig};
use std::path::PathBuf;
use std::time::Instant;

/// `kiln prepare-data`.
#[derive(Debug, Clone, clap::Args)]
pub struct PrepareArgs {
    /// The cache folder to write (default: $KILN_DATA_CACHE, else .cache/kiln-data)
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The folder of the corpus text files
    #[arg(long, value_name = "DIR", default_value = "data")]
    pub data: PathBuf,
    /// Tokenizer entries
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub vocab: usize,
    /// Training shards per corpus
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub shards: usize,
}

impl PrepareArgs {
    /// Prepares (or finds) the corpus and prints what is where.
    pub fn run(&self) -> anyhow::Result<()> {
        let out = self.out.clone().unwrap_or_else(default_cache_dir);
        let cfg = PrepareConfig {
            vocab_size: self.vocab,
            train_shards: self.shards,
            ..PrepareConfig::new(&self.data, &out)
        };
        let t = Instant::now();
        let p = prepare_corpus(&cfg)?;
        println!(
            "{} in {:.1} s: tokenizer {} (vocab {}, end-of-text {})",
            if p.reused { "found" } else { "prepared" },
            t.elapsed().as_secs_f64(),
            p.tokenizer.display(),
            p.vocab_size,
            p.eot
        );
        for s in &p.sources {
            println!(
                "  {:<12} {:>9} bytes -> train {:>9} tokens in {} shards, val {:>7} tokens ({:.2} bytes/token)  {}",
                s.name,
                s.input_bytes,
                s.train_tokens,
                s.train.len(),
                s.val_tokens,
                s.input_bytes as f64 / (s.train_tokens + s.val_tokens) as f64,
                s.train
                    .first()
                    .and_then(|f| f.parent())
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            );
        }
        Ok(())
    }
}
