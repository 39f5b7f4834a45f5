//! Cross-rank aggregation on thread ranks, against values computed directly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_monitor::{RankStats, RankSummary, StepMetrics};
use kiln_testkit::run_ranks;

/// Rank r's stats: a loss and a step time that differ per rank, rank 1 the slowest.
fn stats_of(rank: usize) -> RankStats {
    RankStats {
        loss: 2.0 + 0.125 * rank as f64 + if rank == 2 { 0.3 } else { 0.0 },
        step_time_s: [0.25, 0.41, 0.26, 0.3][rank % 4] + 0.001 * rank as f64,
        tokens: 1024 + rank as u64,
        samples: 8,
    }
}

fn check(world: usize) {
    let out = run_ranks(world, |comm| {
        let s = RankSummary::gather(&comm, &stats_of(kiln_comm::Communicator::rank(&comm)))?;
        Ok(s)
    });
    let all: Vec<RankStats> = (0..world).map(stats_of).collect();
    let mean = all.iter().map(|s| s.loss).sum::<f64>() / world as f64;
    let tmax = all.iter().map(|s| s.step_time_s).fold(f64::MIN, f64::max);
    let tmin = all.iter().map(|s| s.step_time_s).fold(f64::MAX, f64::min);
    let lmin = all.iter().map(|s| s.loss).fold(f64::MAX, f64::min);
    let lmax = all.iter().map(|s| s.loss).fold(f64::MIN, f64::max);
    let tokens: u64 = all.iter().map(|s| s.tokens).sum();
    for (r, s) in out.iter().enumerate() {
        assert_eq!(s.world_size, world);
        assert!(
            (s.loss_mean - mean).abs() < 1e-15,
            "rank {r}: {} vs {mean}",
            s.loss_mean
        );
        assert_eq!((s.loss_min, s.loss_max), (lmin, lmax));
        assert_eq!((s.step_time_min_s, s.step_time_max_s), (tmin, tmax));
        assert_eq!(s.straggler_rank, 1);
        assert_eq!(s.tokens, tokens);
        assert_eq!(s.samples, 8 * world as u64);
        assert_eq!(
            s.rank_step_time_s,
            all.iter().map(|s| s.step_time_s).collect::<Vec<_>>()
        );
        // every rank holds bitwise the same summary
        assert_eq!(s, &out[0]);
    }
    let mut m = StepMetrics::new(5);
    out[0].apply(&mut m);
    assert_eq!(m.loss, Some(out[0].loss_mean));
    assert_eq!(m.step_time_s, Some(tmax));
    assert_eq!(m.straggler_rank, Some(1));
    assert_eq!(m.tokens_per_s, Some(tokens as f64 / tmax));
    assert_eq!(m.samples_per_s, Some(8.0 * world as f64 / tmax));
}

#[test]
fn two_ranks() {
    check(2);
}

#[test]
fn four_ranks() {
    check(4);
}

#[test]
fn a_nan_loss_on_one_rank_is_not_averaged_away() {
    let out = run_ranks(3, |comm| {
        let r = kiln_comm::Communicator::rank(&comm);
        let loss = if r == 2 { f64::NAN } else { 1.0 };
        Ok(RankSummary::gather(
            &comm,
            &RankStats {
                loss,
                step_time_s: 0.1,
                tokens: 1,
                samples: 1,
            },
        )?)
    });
    for s in out {
        assert!(s.loss_mean.is_nan() && s.loss_max.is_nan() && s.loss_min.is_nan());
        assert_eq!(s.step_time_max_s, 0.1);
    }
}
