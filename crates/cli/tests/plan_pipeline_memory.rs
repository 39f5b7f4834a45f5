//! The memory of each pipeline rank (`MemoryPlan::estimate_stage`, `kiln plan-memory --pp`):
//!
//! - the micro-batches each rank holds in flight, and the peak of their bytes when its chunks
//!   keep different amounts, equal what kiln-parallel's schedules (the action lists the engine
//!   runs) hold, for GPipe, 1F1B, interleaved and ZB-H1 over many shapes; kiln-memory's even
//!   split is kiln-parallel's `StageSplit::Even`, and the pipelines kiln-parallel refuses
//!   kiln-memory refuses too;
//! - GPT-3 175B at Megatron-LM's layout (tp 8, pp 16, dp 12 with ZeRO-1, micro-batch 1, ctx
//!   2048, 16-bit with full recomputation, 1F1B over 128 micro-batches) fits in 80 GB on every
//!   stage, where the same tp 8 and dp 12 without a pipeline do not;
//! - `kiln plan-memory --pp 16 --tp 8` prints those figures, one row per rank, and names the
//!   largest.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_memory::{
    MemPrecision, MemoryPlan, PipelinePlan, PipelineSchedule, RecomputePolicy, StageEstimate,
    ZeroStage,
};
use kiln_model::GptConfig;
use kiln_parallel::pipeline::{Action, PipelineSpec, Schedule, ScheduleKind};
use kiln_parallel::{stage_segments, StageSplit};
use std::process::Command;

const GB80: u64 = 80_000_000_000;

fn kind(s: PipelineSchedule) -> ScheduleKind {
    match s {
        PipelineSchedule::GPipe => ScheduleKind::GPipe,
        PipelineSchedule::OneFOneB => ScheduleKind::OneFOneB,
        PipelineSchedule::Interleaved => ScheduleKind::Interleaved,
        PipelineSchedule::ZbH1 => ScheduleKind::ZbH1,
    }
}

/// The peak of the weighted activations an action list holds: a forward of chunk `c` adds
/// `w[c]`, its whole backward or its weight gradient releases it.
fn weighted_peak(list: &[Action], w: &[u64]) -> u64 {
    let (mut now, mut peak) = (0u64, 0u64);
    for a in list {
        match a {
            Action::Forward { chunk, .. } => {
                now += w[*chunk];
                peak = peak.max(now);
            }
            Action::Backward { chunk, .. } | Action::BackwardWeight { chunk, .. } => {
                now -= w[*chunk]
            }
            _ => {}
        }
    }
    peak
}

#[test]
fn in_flight_is_what_the_schedules_hold() {
    let shape = GptConfig::by_name("gpt3_175b").unwrap().shape();
    let mut checked = 0;
    for schedule in PipelineSchedule::ALL {
        for p in 1..=6usize {
            for v in 1..=3usize {
                for m in 1..=13usize {
                    let pipe = PipelinePlan::new(p as u64, v as u64, m as u64, schedule);
                    let spec = PipelineSpec {
                        stages: p,
                        virtual_stages: v,
                        micro_batches: m,
                    };
                    let Ok(built) = Schedule::build(kind(schedule), spec) else {
                        assert!(
                            pipe.validate(&shape).is_err(),
                            "kiln-memory takes {schedule} p {p} v {v} m {m}, kiln-parallel not"
                        );
                        continue;
                    };
                    pipe.validate(&shape).unwrap();
                    // chunks keeping different amounts, so the order of chunks matters
                    let w: Vec<u64> = (0..v as u64).map(|c| 1 + 1000 * c * c + 7 * c).collect();
                    for (r, list) in built.ranks.iter().enumerate() {
                        let ones = vec![1; v];
                        assert_eq!(
                            pipe.in_flight(r as u64),
                            weighted_peak(list, &ones),
                            "{schedule} p {p} v {v} m {m} rank {r}"
                        );
                        assert_eq!(
                            pipe.peak_bytes(r as u64, &w),
                            weighted_peak(list, &w),
                            "{schedule} p {p} v {v} m {m} rank {r}, chunks weighing {w:?}"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} pipelines: in-flight counts and weighted peaks as the schedules run");
    assert!(checked > 150, "{checked}");
}

#[test]
fn the_even_split_is_kiln_parallels() {
    let shape = GptConfig::by_name("gpt3_175b").unwrap().shape();
    for stages in [1u64, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96] {
        let pipe = PipelinePlan::new(stages, 1, stages, PipelineSchedule::OneFOneB);
        let ranges = stage_segments(&shape, stages as usize, &StageSplit::Even).unwrap();
        // segment 0 is the embedding and the last the head; the rest are blocks
        let mut theirs: Vec<u64> = ranges.iter().map(|r| r.len() as u64).collect();
        theirs[0] -= 1;
        *theirs.last_mut().unwrap() -= 1;
        assert_eq!(pipe.blocks(shape.n_layers).unwrap(), theirs, "{stages}");
    }
}

fn megatron_plan() -> MemoryPlan {
    MemoryPlan {
        shape: GptConfig::by_name("gpt3_175b").unwrap().shape(),
        precision: MemPrecision::Mixed16,
        stage: ZeroStage::Zero1,
        dp: 12,
        tp: 8,
        micro_batch: 1,
        recompute: RecomputePolicy::EveryBlock,
        bucket_bytes: 25 << 20,
        sequence_parallel: false,
    }
}

fn show(what: &str, stages: &[StageEstimate]) {
    println!("{what}");
    for e in stages {
        let m = &e.memory;
        println!(
            "  rank {:>2}: {:>2} blocks, {:>13} params, model states {:>6.2} GB, {:>2} in flight, \
             activations {:>6.2} GB, comm {:.2} GB, total {:>6.2} GB",
            e.rank,
            e.blocks,
            m.params_per_rank,
            m.model_states() as f64 / 1e9,
            e.in_flight,
            m.activations as f64 / 1e9,
            m.comm_buffers as f64 / 1e9,
            e.total() as f64 / 1e9
        );
    }
}

#[test]
fn gpt3_175b_fits_at_megatrons_layout() {
    let plan = megatron_plan();
    let pipe = PipelinePlan::new(16, 1, 128, PipelineSchedule::OneFOneB);
    let stages = plan.estimate_pipeline(&pipe).unwrap();
    show(
        "gpt3_175b, tp 8 x pp 16 x dp 12, ZeRO-1, full recomputation, 1F1B, 128 micro-batches:",
        &stages,
    );
    for e in &stages {
        assert!(e.total() < GB80, "rank {}: {} bytes", e.rank, e.total());
    }
    let whole = plan.estimate().unwrap();
    println!(
        "without a pipeline (tp 8 x dp 12, ZeRO-1): model states {:.2} GB, activations {:.2} GB, \
         total {:.2} GB",
        whole.model_states() as f64 / 1e9,
        whole.activations as f64 / 1e9,
        whole.total() as f64 / 1e9
    );
    assert!(whole.total() > GB80, "{}", whole.total());
    // the model states alone do not fit without a pipeline, even with dp 64
    let wide = MemoryPlan { dp: 64, ..plan };
    assert!(wide.estimate().unwrap().model_states() > GB80);

    // Korthikanti et al.'s (2022) layout: sequence parallelism and selective recomputation
    let korthikanti = MemoryPlan {
        sequence_parallel: true,
        recompute: RecomputePolicy::Selective(1),
        ..plan
    };
    let selective = korthikanti.estimate_pipeline(&pipe).unwrap();
    show(
        "with sequence parallelism and selective recomputation:",
        &selective,
    );
    for e in &selective {
        assert!(e.total() < GB80, "rank {}: {} bytes", e.rank, e.total());
    }

    // kiln-parallel's default split (balanced by forward FLOPs) gives the head's stage fewer
    // blocks; it fits too
    let ranges = stage_segments(&plan.shape, 16, &StageSplit::Balanced).unwrap();
    let mut blocks: Vec<u64> = ranges.iter().map(|r| r.len() as u64).collect();
    blocks[0] -= 1;
    blocks[15] -= 1;
    let balanced = PipelinePlan {
        stage_blocks: Some(blocks.clone()),
        ..pipe.clone()
    };
    let stages = plan.estimate_pipeline(&balanced).unwrap();
    show(&format!("balanced split {blocks:?}:"), &stages);
    for e in &stages {
        assert!(e.total() < GB80, "rank {}: {} bytes", e.rank, e.total());
    }

    // without recomputation rank 0 keeps L blocks' whole activations under 1F1B and still
    // fits; GPipe holds all 128 micro-batches, 8 times as many, and does not
    let keep_all = MemoryPlan {
        recompute: RecomputePolicy::None,
        ..plan
    };
    let gpipe = PipelinePlan::new(16, 1, 128, PipelineSchedule::GPipe);
    for pipe in [&pipe, &gpipe] {
        let first = keep_all.estimate_stage(pipe, 0).unwrap();
        println!(
            "no recomputation, {} rank 0: {} in flight, activations {:.2} GB, total {:.2} GB",
            pipe.schedule,
            first.in_flight,
            first.memory.activations as f64 / 1e9,
            first.total() as f64 / 1e9
        );
        assert_eq!(
            first.total() < GB80,
            pipe.schedule == PipelineSchedule::OneFOneB
        );
    }
}

#[test]
fn plan_memory_prints_each_stage() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "plan-memory",
            "gpt3_175b",
            "--tp",
            "8",
            "--pp",
            "16",
            "--dp",
            "12",
            "--micro-batches",
            "128",
            "--schedule",
            "1f1b",
        ])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    println!("{printed}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    let gib = |bytes: u64| format!("{:.2}", bytes as f64 / (1u64 << 30) as f64);
    let stages = megatron_plan()
        .estimate_pipeline(&PipelinePlan::new(16, 1, 128, PipelineSchedule::OneFOneB))
        .unwrap();
    let rows: Vec<Vec<&str>> = printed
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 11 && w[0].parse::<u64>().is_ok())
        .collect();
    assert_eq!(rows.len(), 16, "{printed}");
    for (row, e) in rows.iter().zip(&stages) {
        let m = &e.memory;
        let want = [
            e.rank.to_string(),
            e.blocks.to_string(),
            m.params_per_rank.to_string(),
            gib(m.weights),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.model_states()),
            gib(m.comm_buffers),
            e.in_flight.to_string(),
            gib(m.activations),
            gib(e.total()),
        ];
        assert_eq!(row.as_slice(), want, "rank {}", e.rank);
    }
    let top = stages.iter().map(|e| e.total()).max().unwrap();
    let rank = stages.iter().position(|e| e.total() == top).unwrap();
    assert!(
        printed.contains(&format!("largest: rank {rank} with {} GiB", gib(top))),
        "{printed}"
    );
    assert!(printed.contains("1f1b schedule") && printed.contains("dp=12"));

    // a pipeline kiln cannot run is an error naming the factor
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "plan-memory",
            "gpt3_175b",
            "--pp",
            "4",
            "--virtual-stages",
            "2",
            "--schedule",
            "gpipe",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("virtual_stages") && err.contains("gpipe"),
        "{err}"
    );
}
