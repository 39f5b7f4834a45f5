//! Step time and tokens/s of kiln's parallel strategies on the GPT `small_cpu` preset.
//!
//! Prints one JSON line per configuration: plain data parallel at dp=1 and dp=2 (gradient
//! all-reduce overlapped with the backward on a communication thread, and not), ZeRO stages 1-3
//! at dp=2, tensor parallel at tp=2, and dp=2 x tp=2 with ZeRO-1. All ranks are threads of this process sharing the
//! machine's cores, so on a 2-core machine dp=2 cannot be faster than dp=1 per token: the numbers
//! compare the strategies' overheads with each other, at the same global batch.
//!
//! Then one line per pipeline schedule at pp=2 (`pp2_gpipe`, `pp2_1f1b`, `pp2_interleaved` with
//! v=2, `pp2_zb_h1`), m=8 micro-batches of one sequence (the same global batch): tokens/s, the
//! measured bubble (`1 - sum of the ranks' compute / (ranks x step)`, from each rank's
//! `kiln_parallel::PipelineTrace`, median over the steps) against theory
//! (`kiln_parallel::pipeline::theoretical_bubble`) and against the simulator run with the
//! forward and backward times measured in the traces; per rank the
//! most micro-batches in flight against the schedule's; and per rank the peak activation memory
//! (the live heap bytes one micro-batch's forward of each stage keeps, its received input
//! included, counted by this binary's allocator, times the micro-batches in flight) against
//! kiln-memory's estimate (`MemoryPlan::activation_bytes` per block, the embedding output on the
//! first stage and the logits on the last, times the schedule's in-flight count). pp=2 only:
//! on 2 cores, 4 stages would time-share the cores and the measured bubble would be the
//! scheduler's.
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_parallel` (`-- --steps N`, `--preset tiny`,
//! `--dtype f16|bf16` for the compute dtype, `--only dp2_tp2_zero1` for one configuration).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

/// kiln's allocator (freed activation-sized blocks kept for the next step instead of
/// page-faulted back in), counting the live bytes for the activation-memory rows.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to KilnAlloc unchanged; the counter only reads the sizes
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded
        let p = unsafe { kiln_train::alloc::KilnAlloc.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded
        let p = unsafe { kiln_train::alloc::KilnAlloc.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded
        unsafe { kiln_train::alloc::KilnAlloc.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded
        let p = unsafe { kiln_train::alloc::KilnAlloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

use candle_core::{Device, Tensor};
use kiln_comm::{spawn, Communicator, ThreadComm};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::{DataParallel, DataParallelConfig, ParallelDims, ZeroStage};
use kiln_precision::NoScaler;
use std::sync::Arc;
use std::time::Instant;

#[path = "bench_parallel/pipeline.rs"]
mod pipeline;

struct Case {
    name: &'static str,
    dp: usize,
    tp: usize,
    stage: ZeroStage,
    overlap: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Data parallel, overlap, the ZeRO stages and tensor parallel on a GPT preset; one JSON line
/// per case.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_parallel")]
struct Args {
    /// Timed steps per case
    #[arg(long, value_name = "N", default_value_t = 4)]
    steps: usize,
    /// The model preset
    #[arg(long, value_name = "NAME", default_value = "small_cpu")]
    preset: String,
    /// Compute dtype: f32, f16 or bf16
    #[arg(long, value_name = "DTYPE", default_value = "f32")]
    dtype: String,
    /// Only the case of this name
    #[arg(long, value_name = "CASE", value_parser = clap::builder::PossibleValuesParser::new(CASE_NAMES))]
    only: Option<String>,
}

/// Every case, as `--only` takes it: the data- and tensor-parallel rows, then the pipeline's.
const CASE_NAMES: [&str; 12] = [
    "dp1",
    "dp2_overlap",
    "dp2_no_overlap",
    "dp2_zero1",
    "dp2_zero2",
    "dp2_zero3",
    "tp2",
    "dp2_tp2_zero1",
    "pp2_gpipe",
    "pp2_1f1b",
    "pp2_interleaved",
    "pp2_zb_h1",
];

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (steps, preset) = (args.steps, args.preset.clone());
    let dtype = match args.dtype.as_str() {
        "f16" => candle_core::DType::F16,
        "bf16" => candle_core::DType::BF16,
        _ => candle_core::DType::F32,
    };
    let only = args.only.clone();
    let cfg = GptConfig::by_name(&preset)?;
    let (global_batch, seq) = (8usize, cfg.n_ctx.min(128));
    let shape = cfg.shape();
    let cases = [
        Case {
            name: "dp1",
            dp: 1,
            tp: 1,
            stage: ZeroStage::Replicated,
            overlap: true,
        },
        Case {
            name: "dp2_overlap",
            dp: 2,
            tp: 1,
            stage: ZeroStage::Replicated,
            overlap: true,
        },
        Case {
            name: "dp2_no_overlap",
            dp: 2,
            tp: 1,
            stage: ZeroStage::Replicated,
            overlap: false,
        },
        Case {
            name: "dp2_zero1",
            dp: 2,
            tp: 1,
            stage: ZeroStage::Zero1,
            overlap: true,
        },
        Case {
            name: "dp2_zero2",
            dp: 2,
            tp: 1,
            stage: ZeroStage::Zero2,
            overlap: true,
        },
        Case {
            name: "dp2_zero3",
            dp: 2,
            tp: 1,
            stage: ZeroStage::Zero3,
            overlap: true,
        },
        Case {
            name: "tp2",
            dp: 1,
            tp: 2,
            stage: ZeroStage::Replicated,
            overlap: true,
        },
        Case {
            name: "dp2_tp2_zero1",
            dp: 2,
            tp: 2,
            stage: ZeroStage::Zero1,
            overlap: true,
        },
    ];
    for c in cases {
        if only.as_deref().is_some_and(|o| o != c.name) {
            continue;
        }
        let world = c.dp * c.tp;
        let results = spawn(
            world,
            |comm: ThreadComm| -> anyhow::Result<(f64, f64, f64)> {
                let dims = ParallelDims::new(c.dp, c.tp, world, &shape)?;
                let groups = dims.build_groups(&comm)?;
                let world_comm: Arc<dyn Communicator> = Arc::new(comm);
                let tp: Arc<dyn Communicator> = Arc::from(groups.tp);
                let model = Gpt::tensor_parallel(
                    &cfg,
                    &GptOptions::seeded(1).with_compute_dtype(dtype),
                    tp.clone(),
                )?;
                let dpc = DataParallelConfig {
                    stage: c.stage,
                    overlap: c.overlap,
                    max_grad_norm: Some(1.0),
                    ..Default::default()
                };
                let mut engine = DataParallel::new(&model.segment_param_lists(), &*groups.dp, dpc)?
                    .with_world(world_comm.clone())
                    .with_param_splits(&model.param_splits())?
                    .with_tensor_parallel(tp);
                let per = global_batch / c.dp;
                let dp_rank = dims.dp_rank(world_comm.rank());
                let mut times = Vec::new();
                let mut waits = Vec::new();
                let mut computes = Vec::new();
                for s in 0..steps + 1 {
                    let ids: Vec<u32> = (0..per * (seq + 1))
                        .map(|i| {
                            (((s * 7919 + dp_rank * 104729 + i) * 2654435761) >> 9) as u32
                                % cfg.vocab_size as u32
                        })
                        .collect();
                    let all = Tensor::from_vec(ids, (per, seq + 1), &Device::Cpu)?;
                    let (x, y) = (all.narrow(1, 0, seq)?, all.narrow(1, 1, seq)?);
                    let t = Instant::now();
                    let r = engine.step(
                        &model,
                        &[kiln_memory::MicroBatch::new(x, y)?],
                        1e-3,
                        &mut NoScaler,
                    )?;
                    if s > 0 {
                        times.push(t.elapsed().as_secs_f64());
                        waits.push(r.comm_wait_s);
                        computes.push(r.compute_s);
                    }
                }
                Ok((median(times), median(waits), median(computes)))
            },
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let step_s = results.iter().map(|r| r.0).fold(0.0, f64::max);
        let (wait_s, compute_s) = (results[0].1, results[0].2);
        let tokens = (global_batch * seq) as f64;
        println!(
            "{{\"bench\":\"parallel\",\"config\":\"{}\",\"preset\":\"{}\",\"dp\":{},\"tp\":{},\"zero_stage\":{},\"overlap\":{},\"dtype\":\"{dtype:?}\",\"global_batch\":{global_batch},\"seq\":{seq},\"steps\":{steps},\"step_s\":{step_s:.4},\"tokens_per_s\":{:.1},\"compute_s\":{compute_s:.4},\"comm_wait_s\":{wait_s:.4}}}",
            c.name,
            preset,
            c.dp,
            c.tp,
            c.stage.number(),
            c.overlap,
            tokens / step_s
        );
    }
    for c in pipeline::CASES {
        if only.as_deref().is_some_and(|o| o != c.name) {
            continue;
        }
        let line = pipeline::run(&c, &cfg, &preset, dtype, steps, global_batch, seq)?;
        println!("{line}");
    }
    Ok(())
}
