//! Measures the model and its fused ops on the CPU, one JSON line per measurement:
//! forward+backward tokens/s of `small_cpu` at batch 8 (and a full step with candle-nn's
//! AdamW), and each fused op (forward + backward) against its composite candle equivalent.
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_model`
//! (optionally `-- --steps 20`, `-- --only model` or `-- --only ops`; glibc's `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000`
//! avoid page-faulting fresh tensors every step).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use kiln_model::{keyed_rng, ops, reference, Gpt, GptConfig, GptOptions};
use rand::Rng;
use std::time::Instant;

fn random(shape: &[usize], scale: f64, key: &str) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut rng = keyed_rng(0, key);
    let v: Vec<f32> = (0..n)
        .map(|_| (scale * (2.0 * rng.gen::<f64>() - 1.0)) as f32)
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Median seconds of `reps` runs of `f` after one warm-up.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
}

fn bench_model(steps: usize) -> Result<()> {
    let cfg = GptConfig::small_cpu();
    let (b, t) = (8usize, cfg.n_ctx);
    let model = Gpt::new(&cfg, &GptOptions::seeded(0))?;
    let mut rng = keyed_rng(1, "bench-data");
    let ids: Vec<u32> = (0..b * (t + 1))
        .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
        .collect();
    let x: Vec<u32> = ids.chunks(t + 1).flat_map(|r| r[..t].to_vec()).collect();
    let y: Vec<u32> = ids.chunks(t + 1).flat_map(|r| r[1..].to_vec()).collect();
    let x = Tensor::from_vec(x, (b, t), &Device::Cpu)?;
    let y = Tensor::from_vec(y, (b, t), &Device::Cpu)?;
    let tokens = (b * t) as f64;

    let fb = time(steps, || {
        let grads = model.loss(&x, &y)?.backward()?;
        std::hint::black_box(grads);
        Ok(())
    })?;
    let flops = cfg.flops_per_token() + cfg.lm_head_flops_per_token();
    println!(
        "{{\"bench\":\"model_fwd_bwd\",\"preset\":\"small_cpu\",\"batch\":{b},\"seq\":{t},\
         \"params\":{},\"ms_per_step\":{:.2},\"tokens_per_s\":{:.0},\"gflops\":{:.2}}}",
        cfg.param_count(),
        fb * 1e3,
        tokens / fb,
        flops * tokens / fb / 1e9
    );

    let vars: Vec<Var> = model
        .named_parameters()
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    let mut opt = AdamW::new(vars, ParamsAdamW::default())?;
    let step = time(steps, || {
        let loss = model.loss(&x, &y)?;
        opt.backward_step(&loss)?;
        Ok(())
    })?;
    println!(
        "{{\"bench\":\"model_train_step\",\"preset\":\"small_cpu\",\"batch\":{b},\"seq\":{t},\
         \"optimizer\":\"candle_nn::AdamW\",\"ms_per_step\":{:.2},\"tokens_per_s\":{:.0}}}",
        step * 1e3,
        tokens / step
    );
    Ok(())
}

type Op = dyn Fn(&[Tensor]) -> Result<Tensor>;

/// Forward + backward of `sum(op(inputs) * r)` through fused and composite versions.
fn bench_op(name: &str, shape: &str, inputs: &[Tensor], fused: &Op, composite: &Op) -> Result<()> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<_, _>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = fused(&ts)?;
    let r = random(out.dims(), 1.0, "r")?;
    let run = |f: &Op| -> Result<f64> {
        time(9, || {
            let out = f(&ts)?;
            let g = (out * &r)?.sum_all()?.backward()?;
            std::hint::black_box(g);
            Ok(())
        })
    };
    let tf = run(fused)?;
    let tc = run(composite)?;
    println!(
        "{{\"bench\":\"op_fwd_bwd\",\"op\":\"{name}\",\"shape\":\"{shape}\",\"fused_ms\":{:.3},\
         \"composite_ms\":{:.3},\"speedup\":{:.2}}}",
        tf * 1e3,
        tc * 1e3,
        tc / tf
    );
    Ok(())
}

/// kiln-model's fused ops against candle's composite ones, and the model's tokens/s; one JSON
/// line per measurement.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_model")]
struct Args {
    /// Steps of the model measurement
    #[arg(long, value_name = "N", default_value_t = 10)]
    steps: usize,
    /// Only the model (`model`) or only the ops (`ops`)
    #[arg(long, value_name = "PART")]
    only: Option<String>,
}

fn main() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (steps, only) = (args.steps, args.only);
    if only.as_deref() != Some("ops") {
        bench_model(steps)?;
    }
    if only.as_deref() == Some("model") {
        return Ok(());
    }

    let (b, t, d, h, v) = (8usize, 128usize, 256usize, 4usize, 8192usize);
    bench_op(
        "layer_norm",
        "[1024,256]",
        &[
            random(&[b * t, d], 2.0, "x")?,
            random(&[d], 0.5, "w")?.affine(1.0, 1.0)?,
            random(&[d], 0.5, "b")?,
        ],
        &|x| Ok(ops::layer_norm(&x[0], &x[1], &x[2], 1e-5)?),
        &|x| Ok(reference::layer_norm(&x[0], &x[1], &x[2], 1e-5)?),
    )?;
    bench_op(
        "causal_softmax",
        "[8,4,128,128]",
        &[random(&[b, h, t, t], 4.0, "s")?],
        &|x| Ok(ops::causal_softmax_scaled(&x[0], 0.125)?),
        &|x| Ok(reference::causal_softmax_scaled(&x[0], 0.125)?),
    )?;
    bench_op(
        "gelu",
        "[1024,1024]",
        &[random(&[b * t, 4 * d], 3.0, "g")?],
        &|x| Ok(ops::gelu(&x[0])?),
        &|x| Ok(reference::gelu(&x[0])?),
    )?;
    bench_op(
        "bias_gelu",
        "[1024,1024]",
        &[
            random(&[b * t, 4 * d], 3.0, "g")?,
            random(&[4 * d], 1.0, "gb")?,
        ],
        &|x| Ok(ops::bias_gelu(&x[0], &x[1])?),
        &|x| Ok(reference::bias_gelu(&x[0], &x[1])?),
    )?;
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 31 % v) as u32).collect();
    let targets = Tensor::new(targets, &Device::Cpu)?;
    let t2 = targets.clone();
    bench_op(
        "cross_entropy",
        "[1024,8192]",
        &[random(&[b * t, v], 5.0, "l")?],
        &move |x| Ok(ops::cross_entropy(&x[0], &targets, None)?),
        &move |x| Ok(reference::cross_entropy(&x[0], &t2, None)?),
    )?;
    Ok(())
}
