//! Throughput of the optimizer-side kernels against memcpy bandwidth measured in the same run:
//! the AdamW step (reads p, g, m, v and writes p, m, v: 28 bytes per parameter), the fused
//! unscale-and-check of kiln-precision (8 bytes per gradient), and the exact sum of squares of
//! global-norm clipping (4 bytes per gradient).
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_optim [-- PARAMS]` (default 16M).
//! Prints one JSON line per measurement: the median of several repetitions.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use kiln_optim::{AdamW, AdamWConfig, Optimizer, SquareSum};
use std::hint::black_box;
use std::time::Instant;

const REPS: usize = 9;

/// Median seconds of `REPS` runs of `f`, after one warm-up run.
fn median_secs(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..REPS)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[REPS / 2]
}

fn line(bench: &str, extra: &str, n: usize, secs: f64, bytes_per_elem: usize, memcpy: f64) {
    let bytes_per_s = (n * bytes_per_elem) as f64 / secs;
    println!(
        "{{\"bench\":\"{bench}\",{extra}\"params\":{n},\"median_s\":{secs:.6},\"params_per_s\":{:.4e},\
         \"bytes_per_s\":{bytes_per_s:.4e},\"memcpy_bytes_per_s\":{memcpy:.4e},\
         \"fraction_of_memcpy\":{:.3}}}",
        n as f64 / secs,
        bytes_per_s / memcpy
    );
}

/// AdamW, SGD and unscale throughput against memcpy; one JSON line per measurement.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_optim")]
struct Args {
    /// f32 parameters
    #[arg(value_name = "PARAMS", default_value_t = 1 << 24)]
    params: usize,
}

fn main() -> anyhow::Result<()> {
    let n = <Args as clap::Parser>::parse().params;
    // touch every page up front: fresh allocations would be timed as page faults
    let src: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3 - 0.5).collect();
    let mut dst = vec![1.0f32; n];

    let memcpy_secs = median_secs(|| dst.copy_from_slice(black_box(&src)));
    let memcpy = (2 * 4 * n) as f64 / memcpy_secs;
    line("memcpy", "", n, memcpy_secs, 8, memcpy);

    let grads = src.clone();
    for threads in [1usize, 2] {
        let mut params = vec![0.5f32; n];
        let mut opt = AdamW::new(n, AdamWConfig::default())?;
        opt.set_threads(threads);
        let secs = median_secs(|| opt.step(&mut params, black_box(&grads), 1e-3).unwrap());
        line(
            "adamw",
            &format!("\"threads\":{threads},"),
            n,
            secs,
            28,
            memcpy,
        );
    }

    let mut g = src.clone();
    let mut found = false;
    // alternate 2 and 0.5 so the values stay put over the repetitions
    let mut inv = 2.0f32;
    let secs = median_secs(|| {
        found |= kiln_precision::unscale_and_check(black_box(&mut g), inv);
        inv = 1.0 / inv;
    });
    assert!(!found);
    line("unscale_and_check", "", n, secs, 8, memcpy);

    for threads in [1usize, 2] {
        let mut norm = 0.0;
        let secs = median_secs(|| norm = SquareSum::of_threads(black_box(&grads), threads).norm());
        assert!(norm > 0.0);
        line(
            "grad_norm_exact",
            &format!("\"threads\":{threads},"),
            n,
            secs,
            4,
            memcpy,
        );
    }
    Ok(())
}
