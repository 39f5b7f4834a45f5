//! Activation recompute: peak memory and time of one forward + backward of an 8-layer GPT,
//! with every block recomputed and with every block checkpointed selectively (its LayerNorm and
//! GELU outputs computed again), against none.
//!
//! Each policy runs in a fresh child process (so memory freed by one run and kept by the
//! allocator cannot hide the next run's peak); peak memory is the child's peak resident set
//! (`VmHWM`) minus its resident set just before the pass (Linux; elsewhere `null`). Times are
//! medians of the passes after the first. Prints one JSON line per policy and one with the
//! ratios against none.
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_recompute` (`-- --batch N --layers N`).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use candle_core::{Device, Tensor};
use clap::Parser;
use kiln_memory::{
    CollectGrads, Executor, MicroBatch, RecomputePolicy, SegmentParams, StaticParams,
};
use kiln_model::{Gpt, GptConfig, GptOptions};
use std::time::Instant;

/// Peak memory and time of one forward + backward of a GPT under each activation
/// checkpointing policy, each in a fresh child process; one JSON line per policy and one with
/// the ratios against none.
#[derive(Debug, Clone, Parser)]
#[command(name = "bench_recompute")]
struct Args {
    /// Sequences per pass
    #[arg(long, value_name = "N", default_value_t = 8)]
    batch: usize,
    /// Layers of the small_cpu model
    #[arg(long, value_name = "N", default_value_t = 8)]
    layers: usize,
    /// Timed passes (after one untimed)
    #[arg(long, value_name = "N", default_value_t = 3)]
    reps: usize,
    /// Run one policy and print its line (how the parent starts each child)
    #[arg(long, value_name = "POLICY", hide = true)]
    child: Option<String>,
}

fn status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(policy) = &args.child {
        return child(&args, policy);
    }
    let mut lines = Vec::new();
    for policy in ["none", "every_block", "selective"] {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(["--batch", &args.batch.to_string(), "--layers"])
            .args([&args.layers.to_string(), "--reps", &args.reps.to_string()])
            .args(["--child", policy])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "child {policy} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = String::from_utf8(out.stdout)?.trim().to_string();
        println!("{line}");
        lines.push(serde_json::from_str::<serde_json::Value>(&line)?);
    }
    let t = |v: &serde_json::Value| v["fwd_bwd_s"].as_f64().unwrap_or(f64::NAN);
    let m = |v: &serde_json::Value| v["peak_mib"].as_f64();
    let ratio = |i: usize| match (m(&lines[0]), m(&lines[i])) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:.3}", b / a),
        _ => "null".into(),
    };
    println!(
        "{{\"bench\":\"recompute_ratio\",\"peak_memory_ratio\":{},\"time_overhead\":{:.3},\"selective_peak_memory_ratio\":{},\"selective_time_overhead\":{:.3}}}",
        ratio(1),
        t(&lines[1]) / t(&lines[0]) - 1.0,
        ratio(2),
        t(&lines[2]) / t(&lines[0]) - 1.0
    );
    Ok(())
}

fn child(args: &Args, policy_name: &str) -> anyhow::Result<()> {
    let (batch, layers, reps) = (args.batch, args.layers, args.reps);
    let mut cfg = GptConfig::small_cpu();
    cfg.n_layers = layers;
    let seq = cfg.n_ctx;
    let model = Gpt::new(&cfg, &GptOptions::seeded(5))?;
    let ids: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| ((i * 2654435761) >> 7) as u32 % cfg.vocab_size as u32)
        .collect();
    let all = Tensor::from_vec(ids, (batch, seq + 1), &Device::Cpu)?;
    let (x, y) = (
        all.narrow(1, 0, seq)?.contiguous()?,
        all.narrow(1, 1, seq)?.contiguous()?,
    );
    let params: Vec<SegmentParams> = model
        .segment_param_lists()
        .into_iter()
        .map(SegmentParams::new)
        .collect();
    let policy: RecomputePolicy = policy_name.parse()?;
    let exec = Executor::new(policy);
    let micro = MicroBatch::new(x, y)?;
    let mut times = Vec::new();
    let mut peak = None;
    let mut loss = 0.0f32;
    for rep in 0..reps + 1 {
        let mut provider = StaticParams::new(params.clone());
        let mut grads = CollectGrads::default();
        let base = status_kib("VmRSS:");
        let t = Instant::now();
        let out = exec.run(&model, &micro, &mut provider, &mut grads, 1.0)?;
        times.push(t.elapsed().as_secs_f64());
        loss = out.loss.to_scalar::<f32>()?;
        if rep == 0 {
            if let (Some(b), Some(p)) = (base, status_kib("VmHWM:")) {
                peak = Some(p.saturating_sub(b));
            }
        }
    }
    times.remove(0);
    times.sort_by(f64::total_cmp);
    let t = times[times.len() / 2];
    println!(
        "{{\"bench\":\"recompute\",\"policy\":\"{policy_name}\",\"layers\":{layers},\"batch\":{batch},\"seq\":{seq},\"fwd_bwd_s\":{t:.4},\"peak_mib\":{},\"loss\":{loss}}}",
        peak.map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "null".into())
    );
    Ok(())
}
