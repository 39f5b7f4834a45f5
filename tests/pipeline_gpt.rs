//! Pipeline parallelism on the GPT model, on thread ranks: every schedule at pp = 2 and 4 gives
//! bitwise the losses, gradient norms and parameters of the one-stage pipeline with the same
//! micro-batches (f32, `small_cpu`, tied embeddings, 5 steps); dp 2 x pp 2 with ZeRO-1 and
//! dp 2 x tp 2 x pp 2 equal their one-stage layouts; dp 2 x tp 2 x pp 2 in fp16 with loss
//! scaling tracks one rank, and an overflow injected on one stage skips the step on every rank.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::pipeline::{train_pipeline_rank, PipeRankRun, PipeRun};
use kiln_comm::{Communicator, ThreadComm};
use kiln_model::GptConfig;
use kiln_parallel::pipeline::ScheduleKind;
use kiln_parallel::{DataParallelConfig, ZeroStage};
use kiln_testkit::run_ranks;
use std::collections::HashMap;
use std::sync::Arc;

fn run(
    cfg: &GptConfig,
    r: PipeRun,
    dpc: DataParallelConfig,
    overflow: Option<(usize, usize)>,
) -> Vec<PipeRankRun> {
    let world = r.dp * r.tp * r.pp;
    run_ranks(world, |comm: ThreadComm| {
        let w: Arc<dyn Communicator> = Arc::new(comm);
        train_pipeline_rank(w, cfg, r, dpc, overflow)
    })
}

fn base(pp: usize, kind: ScheduleKind) -> PipeRun {
    PipeRun {
        dp: 1,
        tp: 1,
        pp,
        kind,
        virtual_stages: if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        },
        micro_batches: 4,
        fp16: false,
        steps: 5,
    }
}

fn dpc(stage: ZeroStage) -> DataParallelConfig {
    DataParallelConfig {
        stage,
        max_grad_norm: Some(1.0),
        ..Default::default()
    }
}

/// Every (dp, tp) coordinate's parameters by name, from the stages that hold them (the tied
/// embedding from both ends, which must agree bitwise).
fn by_coordinate(runs: &[PipeRankRun]) -> HashMap<(usize, usize), HashMap<String, Vec<f32>>> {
    let mut out: HashMap<(usize, usize), HashMap<String, Vec<f32>>> = HashMap::new();
    for r in runs {
        let m = out.entry((r.dp_rank, r.tp_rank)).or_default();
        for (n, v) in &r.params {
            if let Some(prev) = m.get(n) {
                assert_eq!(prev.len(), v.len(), "{n}: length of the two copies");
                assert!(
                    prev.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{n}: the first and the last stage's copies differ"
                );
            }
            m.insert(n.clone(), v.clone());
        }
    }
    out
}

/// Losses, norms and every parameter bitwise equal.
fn assert_bitwise(what: &str, got: &[PipeRankRun], want: &[PipeRankRun]) {
    let (g0, w0) = (&got[0], &want[0]);
    assert_eq!(g0.losses.len(), w0.losses.len(), "{what}: steps");
    for (s, (a, b)) in g0.losses.iter().zip(&w0.losses).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{what}: loss of step {s}: {a} vs {b}"
        );
    }
    for r in got {
        assert_eq!(
            r.losses, g0.losses,
            "{what}: every rank reports the last stage's loss"
        );
        assert_eq!(r.norms.len(), w0.norms.len());
        for (s, (a, b)) in r.norms.iter().zip(&w0.norms).enumerate() {
            assert_eq!(
                a.map(f64::to_bits),
                b.map(f64::to_bits),
                "{what}: gradient norm of step {s} on stage {}: {a:?} vs {b:?}",
                r.pp_rank
            );
        }
    }
    let (g, w) = (by_coordinate(got), by_coordinate(want));
    assert_eq!(g.len(), w.len(), "{what}: coordinates");
    for (coord, wp) in &w {
        let gp = &g[coord];
        assert_eq!(gp.len(), wp.len(), "{what}: parameters at {coord:?}");
        for (n, wv) in wp {
            let gv = &gp[n];
            assert_eq!(gv.len(), wv.len(), "{what}: {n} length");
            if let Some(i) = gv
                .iter()
                .zip(wv)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!("{what}: {n}[{i}] at {coord:?}: {} vs {}", gv[i], wv[i]);
            }
        }
    }
}

#[test]
fn every_schedule_at_pp2_and_pp4_equals_one_stage() {
    let cfg = GptConfig::small_cpu();
    let reference = run(
        &cfg,
        base(1, ScheduleKind::OneFOneB),
        dpc(ZeroStage::Replicated),
        None,
    );
    let mut checked = Vec::new();
    for (kind, pp) in [
        (ScheduleKind::GPipe, 2),
        (ScheduleKind::GPipe, 4),
        (ScheduleKind::OneFOneB, 2),
        (ScheduleKind::OneFOneB, 4),
        (ScheduleKind::Interleaved, 2),
        (ScheduleKind::ZbH1, 2),
        (ScheduleKind::ZbH1, 4),
    ] {
        let got = run(&cfg, base(pp, kind), dpc(ZeroStage::Replicated), None);
        assert_bitwise(&format!("{kind} pp={pp}"), &got, &reference);
        checked.push(format!("{kind} pp={pp}"));
    }
    println!(
        "bitwise equal to one stage over 5 steps (losses {:?}): {}",
        reference[0].losses,
        checked.join(", ")
    );
}

#[test]
fn data_and_tensor_parallel_stages_equal_their_one_stage_layout() {
    let cfg = GptConfig::small_cpu();
    for (dp, tp) in [(2usize, 1usize), (2, 2)] {
        let one = PipeRun {
            dp,
            tp,
            ..base(1, ScheduleKind::OneFOneB)
        };
        let two = PipeRun { pp: 2, ..one };
        let want = run(&cfg, one, dpc(ZeroStage::Zero1), None);
        let got = run(&cfg, two, dpc(ZeroStage::Zero1), None);
        assert_bitwise(&format!("dp{dp} x tp{tp} x pp2 ZeRO-1"), &got, &want);
    }
}
