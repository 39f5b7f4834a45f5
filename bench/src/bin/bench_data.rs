//! Loader throughput and consumer wait, on the prepared default corpus (prepared first if
//! missing). Prints one JSON line per measurement:
//!
//! - `throughput`: tokens/s the loader delivers to a consumer that does nothing else, with 1
//!   and 2 worker threads (a mixture of the three corpora, ctx 128, batch 8, token dropout on);
//! - `paced`: a consumer that needs a batch every 256 ms, the `small-cpu` trainer's rate of
//!   about 4000 tokens/s at batch 8 x ctx 128, and the fraction of its time spent waiting for
//!   data (`wait_fraction`, 0..1; the target is under 0.01).
//!
//! ```text
//! cargo run --release -p kiln-bench --bin bench_data -- [--out DIR] [--paced-batches N]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use kiln_data::{
    default_cache_dir, prepare_corpus, DataLoader, LoaderConfig, PrepareConfig, TokenDropout,
    Verify,
};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const CTX: usize = 128;
const BATCH: usize = 8;
const TRAINER_TOKENS_PER_S: f64 = 4000.0;

/// The data loader's throughput and a paced consumer's wait; one JSON line per measurement.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_data")]
struct Args {
    /// The prepared corpus's cache folder (default: $KILN_DATA_CACHE, else .cache/kiln-data)
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Batches the paced consumer takes
    #[arg(long, value_name = "N", default_value_t = 24)]
    paced_batches: usize,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let out = args.out.clone().unwrap_or_else(default_cache_dir);
    let paced_batches = args.paced_batches;
    let mut data = PathBuf::from("data");
    if !data.join("shakespeare.txt").exists() {
        data = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data"));
    }
    let prepared = prepare_corpus(&PrepareConfig::new(&data, &out))?;
    let sources = prepared.train_sources(Verify::Full)?;
    let total_tokens: u64 = sources.iter().map(|s| s.tokens()).sum();
    eprintln!(
        "corpus: {} sources, {total_tokens} training tokens, vocab {} ({})",
        sources.len(),
        prepared.vocab_size,
        if prepared.reused {
            "found prepared"
        } else {
            "prepared now"
        }
    );
    let loader = |workers: usize| -> anyhow::Result<DataLoader> {
        let cfg = LoaderConfig {
            workers,
            seed: 7,
            ..LoaderConfig::new(CTX, BATCH)
        };
        let mut l = DataLoader::new(sources.clone(), Some(&[1.0, 1.0, 1.0]), cfg)?;
        l.add_transform(Arc::new(TokenDropout::new(0.05, prepared.eot)?));
        Ok(l)
    };

    for workers in [1usize, 2] {
        let mut l = loader(workers)?;
        let n = 20_000usize;
        let t = Instant::now();
        let mut sum = 0u64;
        for _ in 0..n {
            let b = l.next_batch()?;
            sum = sum.wrapping_add(b.inputs[0] as u64);
        }
        let secs = t.elapsed().as_secs_f64();
        let st = l.stats();
        println!(
            "{}",
            json!({
                "bench": "throughput",
                "workers": workers,
                "batch": BATCH,
                "ctx": CTX,
                "batches": n,
                "tokens_per_s": (n * BATCH * CTX) as f64 / secs,
                "batches_per_s": n as f64 / secs,
                "wait_fraction": st.wait.as_secs_f64() / secs,
                "staged_hits": st.staged_hits,
                "staged_misses": st.staged_misses,
                "chunk_hits": st.chunks.hits,
                "chunk_misses": st.chunks.misses,
                "checksum": sum,
            })
        );
    }

    let step = Duration::from_secs_f64((BATCH * CTX) as f64 / TRAINER_TOKENS_PER_S);
    for workers in [1usize, 2] {
        let mut l = loader(workers)?;
        let t = Instant::now();
        let mut waited = Duration::ZERO;
        let mut worst = Duration::ZERO;
        for _ in 0..paced_batches {
            let w = Instant::now();
            let b = l.next_batch()?;
            let dt = w.elapsed();
            waited += dt;
            worst = worst.max(dt);
            std::hint::black_box(&b);
            // the trainer's step
            std::thread::sleep(step);
        }
        let secs = t.elapsed().as_secs_f64();
        let st = l.stats();
        println!(
            "{}",
            json!({
                "bench": "paced",
                "workers": workers,
                "batch": BATCH,
                "ctx": CTX,
                "batches": paced_batches,
                "consumer_tokens_per_s": TRAINER_TOKENS_PER_S,
                "tokens_per_s": (paced_batches * BATCH * CTX) as f64 / secs,
                "wait_fraction": waited.as_secs_f64() / secs,
                "worst_wait_ms": worst.as_secs_f64() * 1e3,
                "staged_hits": st.staged_hits,
                "staged_misses": st.staged_misses,
            })
        );
    }
    Ok(())
}
