//! Prepares the default corpus for training: trains a byte-level BPE tokenizer (8192 entries) on
//! the training splits of `data/{shakespeare,austen,web_bible}.txt`, and writes it with the
//! token shards of each corpus (the last 5% of every file held out as the validation split)
//! under a cache folder. A second run finds everything in place and returns at once; a trainer
//! calls the same `kiln_data::prepare_corpus` itself when the shards are missing.
//!
//! ```text
//! cargo run --release --example prepare_data -- [--out DIR] [--data DIR] [--vocab N] [--shards N]
//! ```
//! `--out` defaults to `$KILN_DATA_CACHE` or `.cache/kiln-data`; `--data` to the repository's
//! `data/` folder.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

use anyhow::{bail, Context};
use kiln_data::{default_cache_dir, prepare_corpus, PrepareConfig};
use std::path::PathBuf;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut out = default_cache_dir();
    let mut data = PathBuf::from("data");
    if !data.join("shakespeare.txt").exists() {
        data = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/data"));
    }
    let mut vocab = 8192usize;
    let mut shards = 4usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--out" => out = PathBuf::from(val()?),
            "--data" => data = PathBuf::from(val()?),
            "--vocab" => vocab = val()?.parse()?,
            "--shards" => shards = val()?.parse()?,
            "-h" | "--help" => {
                println!("prepare_data [--out DIR] [--data DIR] [--vocab N] [--shards N]");
                return Ok(());
            }
            other => bail!("unknown argument {other}"),
        }
    }
    let cfg = PrepareConfig {
        vocab_size: vocab,
        train_shards: shards,
        ..PrepareConfig::new(&data, &out)
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
            s.train[0].parent().map(|d| d.display().to_string()).unwrap_or_default()
        );
    }
    Ok(())
}
