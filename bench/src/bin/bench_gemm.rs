//! Speed of the CPU linear op's products at a GPT's shapes: for each (rows, in, out), the
//! forward `x W^T + b` and the two backward products (`dx = dy W`, `dW = dy^T x`), as kiln's
//! `linear` runs them on candle's worker pool, in GFLOP/s (median of several repetitions).
//! `backward_gflops` is the two backward products' FLOPs over the time `backward()` adds to
//! the forward, so it also counts candle's bookkeeping around the op (the sum's gradient, a
//! buffer and an add per input): a lower bound on the products' own rate.
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_gemm [-- --dtype bf16|f16] [--shape ROWS,IN,OUT]`.
//! With no shape, small_cpu's (1024 rows: QKV, attention output, MLP up and down, LM head) and
//! d512's. Prints one JSON line per shape and product.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use candle_core::{Device, Tensor, Var};
use kiln_parallel::tp::{linear, with_matmul_precision, MatmulPrecision};
use std::time::Instant;

const REPS: usize = 15;

fn median_secs(mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    // a few unmeasured runs first: the worker pool, the packing buffers and the allocator's
    // cache warm up (one was not enough for the first shape of a run)
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[REPS / 2])
}

/// The CPU linear op's products at a GPT's shapes in GFLOP/s; one JSON line per shape and
/// product.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_gemm")]
struct Args {
    /// Operand precision: f32, bf16 or f16 (f32 accumulation)
    #[arg(long, value_name = "DTYPE")]
    dtype: Option<String>,
    /// One shape, ROWS,IN,OUT (default: small_cpu's and d512's)
    #[arg(long, value_name = "ROWS,IN,OUT")]
    shape: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let value = |flag: &str| match flag {
        "--dtype" => args.dtype.clone(),
        _ => args.shape.clone(),
    };
    let precision = match value("--dtype").as_deref() {
        None | Some("f32") => MatmulPrecision::Highest,
        Some("bf16") => MatmulPrecision::Bf16,
        Some("f16") => MatmulPrecision::F16,
        Some(other) => anyhow::bail!("--dtype: expected f32, bf16 or f16, got {other}"),
    };
    let shapes: Vec<(usize, usize, usize)> = match value("--shape") {
        Some(s) => {
            let v: Vec<usize> = s
                .split(',')
                .map(|x| x.parse())
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("--shape {s}: {e}"))?;
            anyhow::ensure!(v.len() == 3, "--shape: expected ROWS,IN,OUT, got {s}");
            vec![(v[0], v[1], v[2])]
        }
        None => vec![
            (1024, 256, 768),
            (1024, 256, 256),
            (1024, 256, 1024),
            (1024, 1024, 256),
            (1024, 256, 8192),
            (1024, 512, 1536),
            (1024, 512, 2048),
            (1024, 2048, 512),
            (1024, 512, 8192),
        ],
    };
    let dev = Device::Cpu;
    for (rows, inf, outf) in shapes {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, inf), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.05, (outf, inf), &dev)?)?;
        let b = Var::from_tensor(&Tensor::zeros(outf, candle_core::DType::F32, &dev)?)?;
        let flops = 2.0 * (rows * inf * outf) as f64;
        let fwd = median_secs(|| {
            with_matmul_precision(precision, || linear(&x, &w, Some(&b)))?;
            Ok(())
        })?;
        let both = median_secs(|| {
            let y = with_matmul_precision(precision, || linear(&x, &w, Some(&b)))?;
            let _ = y.sum_all()?.backward()?;
            Ok(())
        })?;
        println!(
            "{{\"bench\":\"gemm\",\"dtype\":\"{}\",\"rows\":{rows},\"in\":{inf},\"out\":{outf},\"forward_gflops\":{:.1},\"backward_gflops\":{:.1}}}",
            value("--dtype").unwrap_or_else(|| "f32".into()),
            flops / fwd / 1e9,
            2.0 * flops / (both - fwd).max(1e-9) / 1e9,
        );
    }
    Ok(())
}
