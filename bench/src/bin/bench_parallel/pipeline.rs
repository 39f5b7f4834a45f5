//! The pipeline rows of `bench_parallel`: each schedule at pp=2 on thread ranks, its bubble
//! measured from the ranks' traces against theory and the simulator, the micro-batches in
//! flight against the schedule's, and the activation memory per stage against kiln-memory's
//! estimate.

use super::{median, LIVE};
use candle_core::{DType, Device, Tensor};
use kiln_comm::{spawn, Communicator, ThreadComm};
use kiln_memory::{
    Executor, MemPrecision, MemoryPlan, MicroBatch, RecomputePolicy, SegmentParams, StaticParams,
};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::pipeline::{
    peak_in_flight, theoretical_bubble, theoretical_bubble_with, Action, ComputeKind, Costs,
    PipelineSpec, Schedule, ScheduleKind,
};
use kiln_parallel::{
    stage_segments, DataParallel, DataParallelConfig, ParallelDims, PipelineTrace, StageSplit,
    ZeroStage,
};
use kiln_precision::NoScaler;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// One pipeline row.
pub struct PipeCase {
    pub name: &'static str,
    kind: ScheduleKind,
    pp: usize,
    virtual_stages: usize,
    micro_batches: usize,
}

/// The rows: every schedule at pp=2, 8 micro-batches.
pub const CASES: [PipeCase; 4] = [
    PipeCase {
        name: "pp2_gpipe",
        kind: ScheduleKind::GPipe,
        pp: 2,
        virtual_stages: 1,
        micro_batches: 8,
    },
    PipeCase {
        name: "pp2_1f1b",
        kind: ScheduleKind::OneFOneB,
        pp: 2,
        virtual_stages: 1,
        micro_batches: 8,
    },
    PipeCase {
        name: "pp2_interleaved",
        kind: ScheduleKind::Interleaved,
        pp: 2,
        virtual_stages: 2,
        micro_batches: 8,
    },
    PipeCase {
        name: "pp2_zb_h1",
        kind: ScheduleKind::ZbH1,
        pp: 2,
        virtual_stages: 1,
        micro_batches: 8,
    },
];

/// The micro-batch `k` of step `s`: `rows` sequences of `seq` tokens.
fn micro_batch(
    cfg: &GptConfig,
    s: usize,
    k: usize,
    rows: usize,
    seq: usize,
) -> anyhow::Result<MicroBatch> {
    let ids: Vec<u32> = (0..rows * (seq + 1))
        .map(|i| (((s * 7919 + k * 104729 + i) * 2654435761) >> 9) as u32 % cfg.vocab_size as u32)
        .collect();
    let all = Tensor::from_vec(ids, (rows, seq + 1), &Device::Cpu)?;
    Ok(MicroBatch::new(
        all.narrow(1, 0, seq)?.contiguous()?,
        all.narrow(1, 1, seq)?.contiguous()?,
    )?)
}

/// Per model stage, the live heap bytes one micro-batch's forward leaves held (what the
/// backward keeps, the stage's output and its received input included), measured on this
/// thread with the whole model's parameters resident (they are allocated before).
fn measured_stage_bytes(
    cfg: &GptConfig,
    dtype: DType,
    stages: &[Range<usize>],
    rows: usize,
    seq: usize,
) -> anyhow::Result<Vec<u64>> {
    let model = Gpt::new(cfg, &GptOptions::seeded(1).with_compute_dtype(dtype))?;
    let params: Vec<SegmentParams> = model
        .segment_param_lists()
        .into_iter()
        .map(SegmentParams::new)
        .collect();
    let exec = Executor::new(RecomputePolicy::None);
    let batch = micro_batch(cfg, 0, 0, rows, seq)?;
    // one untimed pass through every stage first, so that lazily built state is not counted
    let mut out = Vec::with_capacity(stages.len());
    for _ in 0..2 {
        out.clear();
        let mut input = batch.inputs().clone();
        for segs in stages {
            let mut provider = StaticParams::new(params.clone());
            let before = LIVE.load(Ordering::SeqCst);
            let received = input.copy()?;
            let f = exec.forward(&model, segs.clone(), received, &batch, &mut provider)?;
            let after = LIVE.load(Ordering::SeqCst);
            out.push(after.saturating_sub(before) as u64);
            input = f.output.copy()?;
            drop(f);
        }
    }
    Ok(out)
}

/// kiln-memory's activation estimate of one micro-batch of each model stage: its blocks'
/// share of [`MemoryPlan::activation_bytes`], the embedding output on the stage holding the
/// embedding, the logits and their gradient on the stage holding the head.
fn estimated_stage_bytes(
    cfg: &GptConfig,
    dtype: DType,
    stages: &[Range<usize>],
    rows: usize,
) -> Vec<u64> {
    let shape = cfg.shape();
    let plan = |layers: u64| MemoryPlan {
        shape: kiln_memory::ModelShape {
            n_layers: layers,
            ..shape
        },
        precision: if dtype == DType::F32 {
            MemPrecision::F32
        } else {
            MemPrecision::Mixed16
        },
        stage: ZeroStage::Replicated,
        dp: 1,
        tp: 1,
        micro_batch: rows as u64,
        recompute: RecomputePolicy::None,
        bucket_bytes: 0,
        sequence_parallel: false,
    };
    let ends = plan(0).activation_bytes();
    let per_block = plan(1).activation_bytes() - ends;
    let p = plan(0);
    let embedding = p.precision.compute_bytes() * shape.ctx * rows as u64 * shape.d_model;
    let head = ends - embedding;
    let n = cfg.n_layers + 2;
    stages
        .iter()
        .map(|segs| {
            let blocks = (segs.start.max(1)..segs.end.min(n - 1)).len() as u64;
            let mut b = blocks * per_block;
            if segs.start == 0 {
                b += embedding;
            }
            if segs.end == n {
                b += head;
            }
            b
        })
        .collect()
}

/// The most bytes a rank's actions hold at once: a forward of chunk `c` adds `bytes[c]`, its
/// whole backward or weight gradient releases them (the engine's in-flight count).
fn peak_bytes(actions: impl Iterator<Item = Action>, bytes: &[u64]) -> u64 {
    let (mut now, mut peak) = (0u64, 0u64);
    for a in actions {
        match a.compute() {
            Some(ComputeKind::Forward) => {
                now += bytes[a.chunk()];
                peak = peak.max(now);
            }
            Some(ComputeKind::Backward) | Some(ComputeKind::BackwardWeight) => {
                now = now.saturating_sub(bytes[a.chunk()]);
            }
            _ => {}
        }
    }
    peak
}

/// Mean length of the spans of this compute kind over every trace, `None` without any.
fn mean_span(traces: &[Vec<PipelineTrace>], what: impl Fn(&Action) -> bool) -> Option<f64> {
    let spans: Vec<f64> = traces
        .iter()
        .flatten()
        .flat_map(|t| t.spans.iter())
        .filter(|(a, _, _)| what(a))
        .map(|(_, s, e)| e - s)
        .collect();
    (!spans.is_empty()).then(|| spans.iter().sum::<f64>() / spans.len() as f64)
}

fn json_list<T: std::fmt::Display>(v: &[T]) -> String {
    let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(","))
}

/// Runs one row: `steps` timed steps after one untimed; its JSON line.
pub fn run(
    c: &PipeCase,
    cfg: &GptConfig,
    preset: &str,
    dtype: DType,
    steps: usize,
    global_batch: usize,
    seq: usize,
) -> anyhow::Result<String> {
    let (pp, v, m) = (c.pp, c.virtual_stages, c.micro_batches);
    if global_batch % m != 0 {
        anyhow::bail!("the global batch ({global_batch}) must split into {m} micro-batches");
    }
    let rows = global_batch / m;
    let spec = PipelineSpec {
        stages: pp,
        virtual_stages: v,
        micro_batches: m,
    };
    let schedule = Schedule::build(c.kind, spec)?;
    let shape = cfg.shape();
    let stages = stage_segments(&shape, pp * v, &StageSplit::Balanced)?;
    let stage_bytes = measured_stage_bytes(cfg, dtype, &stages, rows, seq)?;
    let stage_estimate = estimated_stage_bytes(cfg, dtype, &stages, rows);
    let results = spawn(
        pp,
        |comm: ThreadComm| -> anyhow::Result<(Vec<f64>, Vec<PipelineTrace>)> {
            let dims = ParallelDims::with_pipeline(1, 1, pp, pp, &shape)?;
            let groups = dims.build_groups(&comm)?;
            let world: Arc<dyn Communicator> = Arc::new(comm);
            let rank = dims.pp_rank(world.rank());
            let tp: Arc<dyn Communicator> = Arc::from(groups.tp);
            let model = Gpt::tensor_parallel(
                cfg,
                &GptOptions::seeded(1).with_compute_dtype(dtype),
                tp.clone(),
            )?;
            let chunks: Vec<Range<usize>> = (0..v)
                .map(|k| stages[spec.stage_of(rank, k)].clone())
                .collect();
            let mut lists = model.segment_param_lists();
            for (i, l) in lists.iter_mut().enumerate() {
                if !chunks.iter().any(|c| c.contains(&i)) {
                    l.clear();
                }
            }
            let held: std::collections::HashSet<String> =
                lists.iter().flatten().map(|(n, _)| n.clone()).collect();
            let splits: Vec<_> = model
                .param_splits()
                .into_iter()
                .filter(|(n, _)| held.contains(n))
                .collect();
            let dpc = DataParallelConfig {
                max_grad_norm: Some(1.0),
                ..Default::default()
            };
            let embedding: Option<Arc<dyn Communicator>> = groups.embedding.map(Arc::from);
            let mut engine = DataParallel::new(&lists, &*groups.dp, dpc)?
                .with_world(world.clone())
                .with_param_splits(&splits)?
                .with_tensor_parallel(tp)
                .with_pipeline(Arc::from(groups.pp), embedding, &["wte"])?;
            let (mut times, mut traces) = (Vec::new(), Vec::new());
            for s in 0..steps + 1 {
                let mbs = (0..m)
                    .map(|k| micro_batch(cfg, s, k, rows, seq))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let t = Instant::now();
                engine.pipeline_step(&model, &schedule, &chunks, &mbs, &mut NoScaler)?;
                engine.apply(1e-3)?;
                if s > 0 {
                    times.push(t.elapsed().as_secs_f64());
                    let trace = engine
                        .last_pipeline_trace()
                        .ok_or_else(|| anyhow::anyhow!("no pipeline trace after a step"))?;
                    traces.push(trace.clone());
                }
            }
            Ok((times, traces))
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let step_s = results
        .iter()
        .map(|r| median(r.0.clone()))
        .fold(0.0, f64::max);
    let traces: Vec<Vec<PipelineTrace>> = results.into_iter().map(|r| r.1).collect();
    // per step: 1 - the ranks' compute over ranks x the longest rank's step
    let bubbles: Vec<f64> = (0..steps)
        .map(|s| {
            let busy: f64 = traces.iter().map(|t| t[s].compute_s()).sum();
            let span = traces.iter().map(|t| t[s].step_s).fold(0.0, f64::max);
            1.0 - busy / (pp as f64 * span)
        })
        .collect();
    let bubble = median(bubbles);
    let forward = mean_span(&traces, |a| matches!(a, Action::Forward { .. })).unwrap_or(0.0);
    let (backward_input, backward_weight) = if c.kind == ScheduleKind::ZbH1 {
        (
            mean_span(&traces, |a| matches!(a, Action::BackwardInput { .. })).unwrap_or(0.0),
            mean_span(&traces, |a| matches!(a, Action::BackwardWeight { .. })).unwrap_or(0.0),
        )
    } else {
        // a whole backward costs backward_input + backward_weight
        (
            mean_span(&traces, |a| matches!(a, Action::Backward { .. })).unwrap_or(0.0),
            0.0,
        )
    };
    let p2p = mean_span(&traces, |a| a.send_to().is_some()).unwrap_or(0.0);
    let costs = Costs {
        forward,
        backward_input,
        backward_weight,
        p2p,
    };
    let simulated = schedule.simulate(&costs)?;
    let theory = theoretical_bubble(c.kind, spec);
    let theory_measured = theoretical_bubble_with(c.kind, spec, &costs);
    let in_flight: Vec<usize> = traces
        .iter()
        .map(|t| t.iter().map(|x| x.peak_in_flight).max().unwrap_or(0))
        .collect();
    let in_flight_schedule: Vec<usize> = schedule.ranks.iter().map(|l| peak_in_flight(l)).collect();
    let mib = |b: u64| format!("{:.2}", b as f64 / (1024.0 * 1024.0));
    let mut act_measured = Vec::with_capacity(pp);
    let mut act_estimate = Vec::with_capacity(pp);
    for (rank, t) in traces.iter().enumerate() {
        let chunk =
            |bytes: &[u64]| -> Vec<u64> { (0..v).map(|k| bytes[spec.stage_of(rank, k)]).collect() };
        // the order the rank ran (the trace of its last step) with the measured bytes
        let ran = t
            .last()
            .map(|x| x.spans.iter().map(|s| s.0).collect::<Vec<_>>());
        let measured = peak_bytes(ran.unwrap_or_default().into_iter(), &chunk(&stage_bytes));
        let estimate = peak_bytes(
            schedule.ranks[rank].iter().copied(),
            &chunk(&stage_estimate),
        );
        act_measured.push(mib(measured));
        act_estimate.push(mib(estimate));
    }
    let tokens = (global_batch * seq) as f64;
    Ok(format!(
        "{{\"bench\":\"parallel\",\"config\":\"{}\",\"preset\":\"{preset}\",\"pp\":{pp},\"schedule\":\"{}\",\"virtual_stages\":{v},\"micro_batches\":{m},\"dtype\":\"{dtype:?}\",\"global_batch\":{global_batch},\"seq\":{seq},\"steps\":{steps},\"step_s\":{step_s:.4},\"tokens_per_s\":{:.1},\"bubble_measured\":{bubble:.4},\"bubble_theory\":{theory:.4},\"bubble_theory_measured_costs\":{theory_measured:.4},\"bubble_simulated\":{:.4},\"forward_s\":{forward:.5},\"backward_s\":{:.5},\"backward_input_s\":{backward_input:.5},\"backward_weight_s\":{backward_weight:.5},\"p2p_s\":{p2p:.6},\"peak_in_flight\":{},\"peak_in_flight_schedule\":{},\"stage_activation_mib_per_micro_batch\":{},\"stage_activation_estimate_mib_per_micro_batch\":{},\"peak_activation_mib\":{},\"peak_activation_estimate_mib\":{}}}",
        c.name,
        c.kind,
        tokens / step_s,
        simulated.bubble_fraction,
        backward_input + backward_weight,
        json_list(&in_flight),
        json_list(&in_flight_schedule),
        json_list(&stage_bytes.iter().map(|b| mib(*b)).collect::<Vec<_>>()),
        json_list(&stage_estimate.iter().map(|b| mib(*b)).collect::<Vec<_>>()),
        json_list(&act_measured),
        json_list(&act_estimate),
    ))
}
