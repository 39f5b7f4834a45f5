//! Multi-rank save and load, atomic commit, fallback past damaged or uncommitted
//! checkpoints, and the step agreement.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{sample_state, FailingStorage, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{
    rank_file_name, step_dir, CheckpointConfig, Checkpointer, CkptError, Layout, LocalFs, Manifest,
    Storage, MANIFEST_FILE,
};
use kiln_comm::Communicator;
use kiln_testkit::run_ranks;
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex};

fn config(dp: usize, tp: usize) -> CheckpointConfig {
    CheckpointConfig::new(Layout::new(dp, tp, ZeroStage::Zero1).unwrap(), "gpt-test")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn four_ranks_save_and_load_back_exactly() {
    let dir = TempDir::new("four");
    let storage: Arc<dyn Storage> = dir.storage();
    let out = run_ranks(4, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config(2, 2))?;
        let state = sample_state(comm.rank(), 10);
        let rep = ck.save(&comm, 10, &state)?;
        let loaded = ck.load_step(&comm, 10)?;
        assert_eq!(loaded.state, state);
        let latest = ck.load_latest(&comm)?;
        assert!(latest.skipped.is_empty());
        assert_eq!(latest.loaded.unwrap().state, state);
        Ok(rep)
    });
    // the manifest records each file's real size and sha256, computed here independently
    let m = Manifest::from_json(
        &std::fs::read(dir.path(&format!("step-00000010/{MANIFEST_FILE}"))).unwrap(),
    )
    .unwrap();
    assert_eq!(m.step, 10);
    assert_eq!(m.layout, Layout::new(2, 2, ZeroStage::Zero1).unwrap());
    assert_eq!(m.model_hash, "gpt-test");
    for (r, f) in m.files.iter().enumerate() {
        let bytes =
            std::fs::read(dir.path(&format!("step-00000010/{}", rank_file_name(r)))).unwrap();
        assert_eq!(f.size, bytes.len() as u64);
        assert_eq!(f.sha256, hex(&Sha256::digest(&bytes)));
        assert_eq!(out[r].sha256, f.sha256);
        assert_eq!(out[r].bytes, f.size);
        assert_eq!(f.tensors.len(), 7);
    }
    assert_eq!(out[0].total_bytes, m.total_bytes());
    // committed: no temporary directory left, pointer names the step
    let names: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    assert_eq!(
        std::fs::read_to_string(dir.path("latest")).unwrap(),
        "step-00000010\n"
    );
}

#[test]
fn ranks_must_agree_on_the_step() {
    let dir = TempDir::new("agree");
    let storage: Arc<dyn Storage> = dir.storage();
    let out = run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config(2, 1))?;
        let step = if comm.rank() == 0 { 20 } else { 15 };
        let e = ck
            .save(&comm, step, &sample_state(comm.rank(), step))
            .unwrap_err();
        Ok(e.to_string())
    });
    for e in out {
        assert_eq!(
            e,
            "ranks disagree on the checkpoint step: smallest 15, largest 20"
        );
    }
    assert!(dir.storage().list("").unwrap().is_empty());
}

#[test]
fn load_latest_skips_damaged_and_uncommitted_checkpoints() {
    let dir = TempDir::new("fallback");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config(2, 1))?;
        for step in [5, 10, 15] {
            ck.save(&comm, step, &sample_state(comm.rank(), step))?;
        }
        Ok(())
    });
    // step 15: a bit flipped in rank 1's file; step 10: rank 0's file missing
    let p15 = dir.path("step-00000015/rank-00001.safetensors");
    let mut b = std::fs::read(&p15).unwrap();
    let last = b.len() - 3;
    b[last] ^= 0x10;
    std::fs::write(&p15, b).unwrap();
    std::fs::remove_file(dir.path("step-00000010/rank-00000.safetensors")).unwrap();
    // step 20: a save that crashed before its commit
    let lfs = LocalFs::new(&dir.0).unwrap();
    lfs.put("step-00000020.tmp/rank-00000.safetensors", b"partial")
        .unwrap();

    let out = run_ranks(2, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), config(2, 1))?;
        let latest = ck.load_latest(&comm)?;
        let loaded = latest.loaded.expect("step 5 is good");
        assert_eq!(loaded.step, 5);
        assert_eq!(loaded.state, sample_state(comm.rank(), 5));
        Ok(latest.skipped)
    });
    for skipped in out {
        assert_eq!(skipped.len(), 2);
        assert_eq!(skipped[0].step, 15);
        assert_eq!(skipped[0].problems.len(), 1);
        assert_eq!(skipped[0].problems[0].rank, 1);
        assert!(
            skipped[0].problems[0]
                .reason
                .starts_with("checksum mismatch in step-00000015/rank-00001.safetensors"),
            "{}",
            skipped[0]
        );
        assert_eq!(skipped[1].step, 10);
        assert_eq!(skipped[1].problems[0].rank, 0);
        assert_eq!(
            skipped[1].problems[0].reason,
            "missing step-00000010/rank-00000.safetensors"
        );
    }

    // an explicit load of a damaged step fails on every rank, each naming the problem
    let out = run_ranks(2, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), config(2, 1))?;
        Ok(ck.load_step(&comm, 15).unwrap_err())
    });
    assert!(
        matches!(&out[1], CkptError::Checksum { path, .. } if path == "step-00000015/rank-00001.safetensors")
    );
    assert!(matches!(&out[0], CkptError::PeerFailed { ranks, .. } if ranks == &[1]));
}

#[test]
fn a_failed_write_commits_nothing_on_any_rank() {
    let dir = TempDir::new("crash");
    let storage = Arc::new(FailingStorage {
        inner: LocalFs::new(&dir.0).unwrap(),
        needle: Mutex::new(None),
        after: 100,
    });
    let dyn_storage: Arc<dyn Storage> = storage.clone();
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&dyn_storage), config(2, 1))?;
        ck.save(&comm, 5, &sample_state(comm.rank(), 5))?;
        Ok(())
    });
    *storage.needle.lock().unwrap() = Some("step-00000010.tmp/rank-00001".to_string());
    let errs = run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&dyn_storage), config(2, 1))?;
        Ok(ck
            .save(&comm, 10, &sample_state(comm.rank(), 10))
            .unwrap_err())
    });
    assert!(
        matches!(&errs[1], CkptError::File { path, .. } if path == "step-00000010.tmp/rank-00001.safetensors")
    );
    assert!(
        matches!(&errs[0], CkptError::PeerFailed { ranks, reason, .. }
        if ranks == &[1] && reason.contains("injected fault"))
    );
    // the partial write stays in the temporary directory, never committed
    assert!(dir
        .path("step-00000010.tmp/rank-00001.safetensors")
        .exists());
    assert!(!dir.path(&step_dir(10)).exists());
    *storage.needle.lock().unwrap() = None;
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&dyn_storage), config(2, 1))?;
        let latest = ck.load_latest(&comm)?;
        assert!(latest.skipped.is_empty());
        assert_eq!(latest.loaded.unwrap().step, 5);
        assert_eq!(ck.latest_pointer()?, Some(5));
        // the next successful save replaces the stale temporary directory
        ck.save(&comm, 10, &sample_state(comm.rank(), 10))?;
        assert_eq!(
            ck.load_latest(&comm)?.loaded.unwrap().state,
            sample_state(comm.rank(), 10)
        );
        Ok(())
    });
    assert!(!dir.path("step-00000010.tmp").exists());
}

#[test]
fn layout_world_and_model_are_checked_on_load() {
    let dir = TempDir::new("mismatch");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config(2, 1))?;
        ck.save(&comm, 3, &sample_state(comm.rank(), 3))?;
        Ok(())
    });
    let out = run_ranks(2, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), config(1, 2))?;
        Ok(ck.load_latest(&comm).unwrap_err().to_string())
    });
    assert_eq!(
        out[0],
        "checkpoint layout is dp=2 tp=1 zero=1 but this run is dp=1 tp=2 zero=1; load it with load_resharded"
    );
    let out = run_ranks(2, |comm| {
        let cfg = CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Zero1).unwrap(), "gpt-other");
        let ck = Checkpointer::new(Arc::clone(&storage), cfg)?;
        Ok(ck.load_step(&comm, 3).unwrap_err().to_string())
    });
    assert_eq!(
        out[1],
        "checkpoint is for model config \"gpt-test\", this run is \"gpt-other\""
    );
    let out = run_ranks(1, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config(2, 1))?;
        Ok(ck
            .save(&comm, 4, &sample_state(0, 4))
            .unwrap_err()
            .to_string())
    });
    assert_eq!(
        out[0],
        "layout dp=2 tp=1 zero=1 needs 2 ranks but the communicator has 1"
    );
}
