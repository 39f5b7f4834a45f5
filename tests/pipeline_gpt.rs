//! Pipeline parallelism on the GPT model, on thread ranks: every schedule at pp = 2 and 4 gives
//! bitwise the losses, gradient norms and parameters of the one-stage pipeline with the same
//! micro-batches (f32, `small_cpu`, tied embeddings, 5 steps; interleaved at pp = 4 on
//! `small_cpu` with 8 blocks, since 4 ranks of 2 chunks are 8 model stages); dp 2 x pp 2 with ZeRO-1 and
//! dp 2 x tp 2 x pp 2 equal their one-stage layouts; dp 2 x tp 2 x pp 2 in fp16 with loss
//! scaling tracks one rank, and an overflow injected on one stage skips the step on every rank.
//! The Llama architecture (untied head) equals its one-stage layout bitwise the same way.
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
        // zero-bubble: every stage computes its linear layers' dW in the weight passes, one
        // per block segment (and the head's) per micro-batch, none in the input pass
        for r in &got {
            let held = r.weight_segments;
            if kind == ScheduleKind::ZbH1 {
                assert!(
                    held > 0,
                    "{kind} pp={pp} stage {}: no dW held back",
                    r.pp_rank
                );
            } else {
                assert_eq!(held, 0, "{kind} pp={pp} stage {}", r.pp_rank);
            }
        }
        checked.push(format!("{kind} pp={pp}"));
    }
    // interleaved at pp=4 with 2 chunks per rank runs 8 model stages: small_cpu with 8 blocks
    let mut deep = GptConfig::small_cpu();
    deep.n_layers = 8;
    let deep_reference = run(
        &deep,
        base(1, ScheduleKind::OneFOneB),
        dpc(ZeroStage::Replicated),
        None,
    );
    let got = run(
        &deep,
        base(4, ScheduleKind::Interleaved),
        dpc(ZeroStage::Replicated),
        None,
    );
    assert_bitwise("interleaved pp=4 (8 blocks)", &got, &deep_reference);
    checked.push("interleaved pp=4 (8 blocks)".into());
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

/// Activation recomputation (every block, and selective) under each schedule at pp = 2 gives
/// bitwise the one-stage run without recomputation.
#[test]
fn recomputation_composes_with_every_schedule() {
    use kiln_memory::RecomputePolicy;
    let cfg = GptConfig::small_cpu();
    let reference = run(
        &cfg,
        base(1, ScheduleKind::OneFOneB),
        dpc(ZeroStage::Replicated),
        None,
    );
    for policy in [RecomputePolicy::EveryBlock, RecomputePolicy::Selective(1)] {
        for kind in ScheduleKind::ALL {
            let c = DataParallelConfig {
                recompute: policy,
                ..dpc(ZeroStage::Replicated)
            };
            let got = run(&cfg, base(2, kind), c, None);
            assert_bitwise(&format!("{kind} pp=2 {policy}"), &got, &reference);
        }
    }
}

/// dp 2 x tp 2 x pp 2 in fp16 with dynamic loss scaling against one rank with the same
/// micro-batches (8 of 2 sequences), both with an overflow injected into the embedding's
/// backward (the first stage only) at step 2: that step is skipped on every rank of both runs,
/// and every step's loss tracks one rank's within 1e-3 (relative; fp16 sums in another order
/// over tp and dp, as the dp x tp suite's fp16 case).
#[test]
fn fp16_pipeline_with_loss_scaling_tracks_one_rank() {
    let cfg = GptConfig::small_cpu();
    let split = PipeRun {
        dp: 2,
        tp: 2,
        pp: 2,
        fp16: true,
        ..base(2, ScheduleKind::OneFOneB)
    };
    let one = PipeRun {
        dp: 1,
        tp: 1,
        pp: 1,
        micro_batches: 8,
        ..split
    };
    let got = run(&cfg, split, dpc(ZeroStage::Zero1), Some((2, 0)));
    let want = run(&cfg, one, dpc(ZeroStage::Zero1), Some((2, 0)));
    for r in got.iter().chain(&want) {
        assert!(
            r.skipped.contains(&2),
            "stage {} did not skip step 2: {:?}",
            r.pp_rank,
            r.skipped
        );
    }
    for r in &got {
        assert_eq!(r.skipped, got[0].skipped, "every rank skips the same steps");
    }
    assert_eq!(
        got[0].skipped, want[0].skipped,
        "the same steps skipped as one rank"
    );
    // the loss of each applied step, relative
    let mut worst_loss = 0.0f64;
    for (a, b) in got[0].losses.iter().zip(&want[0].losses) {
        worst_loss = worst_loss.max(((a - b) / b).abs() as f64);
    }
    println!(
        "fp16 dp2 x tp2 x pp2 against one rank: skipped {:?} on every rank of both; every \
         step's loss within {worst_loss:.2e} of one rank's (relative; bound 1e-3); losses {:?}",
        got[0].skipped, got[0].losses
    );
    assert!(
        worst_loss < 1e-3,
        "losses differ by {worst_loss:e} (bound 1e-3 relative)"
    );
    assert!(
        want[0].losses[4] < want[0].losses[0],
        "the one-rank run did not train: {:?}",
        want[0].losses
    );
}

/// The Llama architecture (`llama_cpu`: RMSNorm, rotary, SwiGLU, 8 query heads sharing 2
/// key/value heads, an untied head owned by the last stage alone) through the pipeline: 1F1B
/// and ZB-H1 at pp = 2 and 4, GPipe at pp = 2, and dp 2 x tp 2 x pp 2 with ZeRO-1, each bitwise
/// its one-stage layout.
#[test]
fn a_llama_pipeline_equals_one_stage() {
    let cfg = GptConfig::llama_cpu();
    let reference = run(
        &cfg,
        base(1, ScheduleKind::OneFOneB),
        dpc(ZeroStage::Replicated),
        None,
    );
    let mut checked = Vec::new();
    for (kind, pp) in [
        (ScheduleKind::GPipe, 2),
        (ScheduleKind::OneFOneB, 2),
        (ScheduleKind::OneFOneB, 4),
        (ScheduleKind::ZbH1, 4),
    ] {
        let got = run(&cfg, base(pp, kind), dpc(ZeroStage::Replicated), None);
        assert_bitwise(&format!("llama {kind} pp={pp}"), &got, &reference);
        checked.push(format!("{kind} pp={pp}"));
    }
    let one = PipeRun {
        dp: 2,
        tp: 2,
        ..base(1, ScheduleKind::OneFOneB)
    };
    let want = run(&cfg, one, dpc(ZeroStage::Zero1), None);
    let got = run(&cfg, PipeRun { pp: 2, ..one }, dpc(ZeroStage::Zero1), None);
    assert_bitwise("llama dp2 x tp2 x pp2 ZeRO-1", &got, &want);
    checked.push("dp2 x tp2 x pp2 ZeRO-1".into());
    println!(
        "llama_cpu bitwise equal to one stage over 5 steps (losses {:?}): {}",
        reference[0].losses,
        checked.join(", ")
    );
}
