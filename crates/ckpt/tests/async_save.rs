//! Async save: same bytes as a sync save, the caller keeps training (and communicating)
//! while the background thread writes, and write errors surface on `wait` or the next save.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{sample_state, values, FailingStorage, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, CkptError, Layout, LocalFs, RankState, StateDict, Stateful,
    Storage,
};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_testkit::run_ranks;
use std::sync::{Arc, Mutex};

fn config() -> CheckpointConfig {
    CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Zero2).unwrap(), "async")
}

fn files_of(dir: &TempDir, step: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.path(step))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn async_and_sync_saves_write_identical_bytes() {
    let (a, b) = (TempDir::new("sync"), TempDir::new("async"));
    let (sa, sb): (Arc<dyn Storage>, Arc<dyn Storage>) = (a.storage(), b.storage());
    run_ranks(2, |comm| {
        let mut sync = Checkpointer::new(Arc::clone(&sa), config())?;
        let mut asy = Checkpointer::new(Arc::clone(&sb), config())?;
        sync.set_user_meta("run", "x")?;
        asy.set_user_meta("run", "x")?;
        for step in [4, 8] {
            let state = sample_state(comm.rank(), step);
            sync.save(&comm, step, &state)?;
            asy.save_async(&comm, step, state)?;
        }
        let rep = asy.wait()?.expect("a save was in flight");
        assert_eq!(rep.step, 8);
        assert!(asy.wait()?.is_none());
        Ok(())
    });
    for step in ["step-00000004", "step-00000008"] {
        let (fa, fb) = (files_of(&a, step), files_of(&b, step));
        assert_eq!(fa.len(), 4, "{fa:?}");
        assert_eq!(fa, fb, "{step}");
    }
}

/// A model whose parameters change every step.
struct Model {
    w: Vec<f32>,
}

impl Stateful for Model {
    fn state(&self) -> kiln_ckpt::Result<StateDict, kiln_ckpt::StateError> {
        let mut sd = StateDict::new();
        sd.put("w", &[self.w.len()], &self.w)?;
        Ok(sd)
    }
    fn load_state(&mut self, state: StateDict) -> kiln_ckpt::Result<(), kiln_ckpt::StateError> {
        state.read_into("w", &mut self.w)
    }
}

#[test]
fn training_continues_while_the_writer_runs() {
    let dir = TempDir::new("overlap");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config())?;
        let mut model = Model {
            w: values(comm.rank() as u64, 100_000),
        };
        let saved = model.w.clone();
        let mut state = RankState::new();
        state.capture("model", &model)?;
        ck.save_async(&comm, 1, state)?;
        // the loop goes on: parameters change and the ranks all-reduce, concurrently with
        // the writer's own collectives
        for _ in 0..20 {
            let mut g = model.w.clone();
            comm.all_reduce(&mut g, ReduceOp::Avg)?;
            for (w, g) in model.w.iter_mut().zip(&g) {
                *w -= 0.1 * g;
            }
        }
        ck.wait()?;
        let loaded = ck.load_step(&comm, 1)?;
        let mut back = Model {
            w: vec![0.0; 100_000],
        };
        loaded
            .state
            .restore_all(&mut [("model", &mut back)], Default::default())?;
        kiln_testkit::assert_bitwise_eq(&back.w, &saved);
        assert_ne!(model.w, saved);
        Ok(())
    });
}

#[test]
fn write_errors_surface_on_wait_and_on_the_next_save() {
    let dir = TempDir::new("async-fault");
    let storage = Arc::new(FailingStorage {
        inner: LocalFs::new(&dir.0).unwrap(),
        needle: Mutex::new(Some("rank-00000".to_string())),
        after: 64,
    });
    let dyn_storage: Arc<dyn Storage> = storage.clone();
    let out = run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&dyn_storage), config())?;
        // surfaced by wait()
        ck.save_async(&comm, 1, sample_state(comm.rank(), 1))?;
        let on_wait = ck.wait().unwrap_err();
        // surfaced by the next save, which does not start
        ck.save_async(&comm, 2, sample_state(comm.rank(), 2))?;
        let on_next = ck
            .save_async(&comm, 3, sample_state(comm.rank(), 3))
            .unwrap_err();
        assert_eq!(ck.saving(), None);
        // and by a sync save
        ck.save_async(&comm, 4, sample_state(comm.rank(), 4))?;
        let on_sync = ck
            .save(&comm, 5, &sample_state(comm.rank(), 5))
            .unwrap_err();
        assert!(ck.committed_steps()?.is_empty());
        Ok((on_wait, on_next, on_sync))
    });
    for (rank, (a, b, c)) in out.into_iter().enumerate() {
        for e in [a, b, c] {
            if rank == 0 {
                assert!(
                    matches!(&e, CkptError::File { path, source, .. }
                        if path.ends_with("rank-00000.safetensors") && source.to_string().contains("injected")),
                    "{e}"
                );
            } else {
                assert!(
                    matches!(&e, CkptError::PeerFailed { ranks, .. } if ranks == &[0]),
                    "{e}"
                );
            }
        }
    }
    // once the fault is gone the checkpointer works again
    *storage.needle.lock().unwrap() = None;
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&dyn_storage), config())?;
        ck.save_async(&comm, 6, sample_state(comm.rank(), 6))?;
        ck.wait()?;
        let loaded = ck.load_latest(&comm)?.loaded.unwrap();
        assert_eq!(loaded.step, 6);
        assert_eq!(loaded.state, sample_state(comm.rank(), 6));
        let total: u32 = comm.all_reduce_scalar(1u32, ReduceOp::Sum)?;
        assert_eq!(total, 2);
        Ok(())
    });
}
