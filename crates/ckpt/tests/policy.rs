//! Save policies and retention driven through a multi-rank `Checkpointer`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{sample_state, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{CheckpointConfig, Checkpointer, Layout, Retention, SavePolicy, Storage};
use kiln_comm::Communicator;
use kiln_testkit::run_ranks;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn every_n_steps_with_keep_last_and_every_m() {
    let dir = TempDir::new("retention");
    let storage: Arc<dyn Storage> = dir.storage();
    let out = run_ranks(2, |comm| {
        let cfg = CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Replicated).unwrap(), "p")
            .with_policy(SavePolicy::every_steps(5))
            .with_retention(Retention::keep_last(2).and_every(20));
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg)?;
        let mut saved = Vec::new();
        let mut deleted = Vec::new();
        for step in 1..=50u64 {
            if ck.should_save(&comm, step)? {
                let rep = if step % 10 == 0 {
                    ck.save_async(&comm, step, sample_state(comm.rank(), step))?;
                    ck.wait()?.unwrap()
                } else {
                    ck.save(&comm, step, &sample_state(comm.rank(), step))?
                };
                saved.push(step);
                deleted.extend(rep.deleted);
                // the just-committed checkpoint always survives its own retention pass
                assert!(ck.committed_steps()?.contains(&step));
            }
        }
        Ok((saved, deleted, ck.committed_steps()?))
    });
    let expected_saved: Vec<u64> = (5..=50).step_by(5).collect();
    // Reference: the last 2 plus the multiples of 20.
    let expected_kept: Vec<u64> = expected_saved
        .iter()
        .copied()
        .filter(|&s| s >= 45 || s % 20 == 0)
        .collect();
    let expected_deleted: Vec<u64> = expected_saved
        .iter()
        .copied()
        .filter(|s| !expected_kept.contains(s))
        .collect();
    for (rank, (saved, deleted, kept)) in out.into_iter().enumerate() {
        assert_eq!(saved, expected_saved);
        assert_eq!(kept, expected_kept);
        // only rank 0 deletes
        if rank == 0 {
            assert_eq!(deleted, expected_deleted);
        } else {
            assert!(deleted.is_empty());
        }
    }
    // the survivors still load
    run_ranks(2, |comm| {
        let cfg = CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Replicated).unwrap(), "p");
        let ck = Checkpointer::new(Arc::clone(&storage), cfg)?;
        for s in [20, 40, 45, 50] {
            assert_eq!(ck.load_step(&comm, s)?.state, sample_state(comm.rank(), s));
        }
        Ok(())
    });
}

#[test]
fn wall_time_policy_is_agreed_across_ranks() {
    let dir = TempDir::new("walltime");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let cfg = CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Replicated).unwrap(), "p")
            .with_policy(SavePolicy::every_duration(Duration::from_secs(30 * 60)));
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg)?;
        let now = Instant::now();
        // neither rank's clock has reached 30 minutes
        assert!(!ck.should_save_at(&comm, 7, now + Duration::from_secs(29 * 60))?);
        // rank 0's clock has, rank 1's has not: both save
        let skew = if comm.rank() == 0 { 31 } else { 29 };
        assert!(ck.should_save_at(&comm, 7, now + Duration::from_secs(skew * 60))?);
        ck.save(&comm, 7, &sample_state(comm.rank(), 7))?;
        // the interval restarts at the save
        let after = Instant::now();
        assert!(!ck.should_save_at(&comm, 8, after + Duration::from_secs(29 * 60))?);
        assert!(ck.should_save_at(&comm, 8, after + Duration::from_secs(30 * 60))?);
        Ok(())
    });
}

#[test]
fn invalid_policies_are_rejected() {
    let dir = TempDir::new("badpolicy");
    let storage: Arc<dyn Storage> = dir.storage();
    let base = CheckpointConfig::new(Layout::single(), "p");
    let e = Checkpointer::new(
        Arc::clone(&storage),
        base.clone().with_retention(Retention::keep_last(0)),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid checkpoint configuration: keep_last must be at least 1: the latest checkpoint is always kept"
    );
    assert!(Checkpointer::new(
        Arc::clone(&storage),
        base.with_policy(SavePolicy::every_steps(0))
    )
    .is_err());
    assert!(Layout::new(0, 2, ZeroStage::Replicated).is_err());
    // a fifth ZeRO stage is not a stage: refused where a manifest or a config is read
    assert!(ZeroStage::from_number(4).is_err());
    let e = serde_json::from_str::<Layout>(r#"{"dp": 1, "tp": 1, "zero_stage": 4}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("got 4"), "{e}");
    let l: Layout = serde_json::from_str(r#"{"dp": 2, "tp": 1, "zero_stage": 3}"#).unwrap();
    assert_eq!(l, Layout::new(2, 1, ZeroStage::Zero3).unwrap());
    assert_eq!(
        serde_json::to_string(&l).unwrap(),
        r#"{"dp":2,"tp":1,"zero_stage":3}"#
    );
}
