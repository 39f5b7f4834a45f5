//! Async saves whose copy runs on the writer thread (`Snapshot::defer` of a `Guarded`
//! component): the checkpoint holds the values at `defer`, never an update made after it,
//! its bytes are a sync save's, and a failed copy fails the save on every rank.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{values, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, CkptError, Guarded, Layout, RankState, Snapshot, StateDict,
    StateError, Stateful, Step, Storage,
};
use kiln_comm::Communicator;
use kiln_testkit::run_ranks;
use std::sync::Arc;

fn config() -> CheckpointConfig {
    CheckpointConfig::new(
        Layout::new(2, 1, ZeroStage::Replicated).unwrap(),
        "deferred",
    )
}

/// A model whose parameters change every step.
struct Model {
    w: Vec<f32>,
}

impl Stateful for Model {
    fn state(&self) -> kiln_ckpt::Result<StateDict, StateError> {
        let mut sd = StateDict::new();
        sd.put("w", &[self.w.len()], &self.w)?;
        Ok(sd)
    }
    fn load_state(&mut self, state: StateDict) -> kiln_ckpt::Result<(), StateError> {
        state.read_into("w", &mut self.w)
    }
}

fn files_of(dir: &TempDir, step: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.path(step))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn updates_after_defer_never_reach_the_checkpoint() {
    let (a, b) = (
        TempDir::new("deferred-sync"),
        TempDir::new("deferred-async"),
    );
    let (sa, sb): (Arc<dyn Storage>, Arc<dyn Storage>) = (a.storage(), b.storage());
    const N: usize = 300_000;
    run_ranks(2, |comm| {
        let mut sync = Checkpointer::new(Arc::clone(&sa), config())?;
        let mut asy = Checkpointer::new(Arc::clone(&sb), config())?;
        let model = Guarded::new(Model {
            w: values(comm.rank() as u64, N),
        });
        let mut expected = Vec::new();
        for step in [1u64, 2, 3] {
            let before = model.read().w.clone();
            // the reference: a sync save of the same values
            let mut st = RankState::new();
            st.capture("model", &*model.read())?;
            st.capture("step", &Step(step))?;
            sync.save(&comm, step, &st)?;

            let mut snap = Snapshot::new();
            snap.defer("model", &model)?;
            snap.capture("step", &Step(step))?;
            asy.save_async_snapshot(&comm, step, snap)?;
            // the next step's update, right away: it waits for the copy, so it cannot leak
            let mut w = model.write();
            for x in w.w.iter_mut() {
                *x += 1.0;
            }
            drop(w);
            assert_ne!(model.read().w, before);
            expected.push((step, before));
        }
        asy.wait()?;
        for (step, before) in expected {
            for ck in [&sync, &asy] {
                let loaded = ck.load_step(&comm, step)?;
                let mut back = Model { w: vec![0.0; N] };
                let mut s = Step(0);
                loaded.state.restore_all(
                    &mut [("model", &mut back), ("step", &mut s)],
                    Default::default(),
                )?;
                kiln_testkit::assert_bitwise_eq(&back.w, &before);
                assert_eq!(s, Step(step));
            }
        }
        assert_eq!(model.pending_copies(), 0);
        Ok(())
    });
    for step in ["step-00000001", "step-00000002", "step-00000003"] {
        let (fa, fb) = (files_of(&a, step), files_of(&b, step));
        assert_eq!(fa.len(), 4, "{fa:?}");
        assert_eq!(fa, fb, "{step}");
    }
}

/// A component whose copy fails on one rank.
struct Faulty {
    fail: bool,
}

impl Stateful for Faulty {
    fn state(&self) -> kiln_ckpt::Result<StateDict, StateError> {
        if self.fail {
            return Err(StateError::MissingTensor {
                name: "faulty".to_string(),
            });
        }
        Ok(StateDict::new())
    }
    fn load_state(&mut self, _: StateDict) -> kiln_ckpt::Result<(), StateError> {
        Ok(())
    }
}

#[test]
fn a_failed_deferred_copy_fails_the_save_on_every_rank() {
    let dir = TempDir::new("deferred-fault");
    let storage: Arc<dyn Storage> = dir.storage();
    let out = run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config())?;
        let part = Guarded::new(Faulty {
            fail: comm.rank() == 1,
        });
        let mut snap = Snapshot::new();
        snap.defer("faulty", &part)?;
        ck.save_async_snapshot(&comm, 7, snap)?;
        let e = ck.wait().unwrap_err();
        // the lease was released: writes go through
        part.write().fail = false;
        assert!(ck.committed_steps()?.is_empty());
        Ok(e)
    });
    assert!(matches!(out[1], CkptError::State(_)), "{}", out[1]);
    assert!(
        matches!(&out[0], CkptError::PeerFailed { op: "save", ranks, .. } if ranks == &[1]),
        "{}",
        out[0]
    );
}

/// A built part: the sum of every rank's `mine` over the writer's communicator, and its size.
fn summed(
    mine: f64,
) -> impl FnOnce(&dyn Communicator) -> kiln_ckpt::Result<StateDict> + Send + 'static {
    move |c| {
        use kiln_comm::{CommExt, ReduceOp};
        let total = c.all_reduce_scalar(mine, ReduceOp::Sum)?;
        let mut sd = StateDict::new();
        sd.set_meta("total", total)?;
        sd.set_meta("writer_world", c.world_size())?;
        Ok(sd)
    }
}

/// A part built on the writer thread (`Snapshot::build_later`) gets the writer's own
/// communicator, the ranks of the save's, so its collectives run beside the loop's: here an
/// all-reduce of the ranks' values, which the checkpoint then holds. A build that fails on
/// one rank fails the save on every rank (the other builds still run), and a snapshot with a
/// built part cannot be turned into state without a communicator.
#[test]
fn parts_built_on_the_writer_thread_use_its_communicator() {
    use kiln_comm::{CommExt, ReduceOp};
    let dir = TempDir::new("built-part");
    let storage: Arc<dyn Storage> = dir.storage();
    let out = run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config())?;
        let mine = 10.0 * (comm.rank() as f64 + 1.0);
        let mut snap = Snapshot::new();
        snap.capture("step", &Step(3))?;
        snap.build_later("sum", summed(mine))?;
        assert!(matches!(
            snap.build_later("sum", |_| Ok(StateDict::new())),
            Err(CkptError::Config(_))
        ));
        // the loop's own collective, while the writer thread runs its build
        let loop_sum = comm.all_reduce_scalar(1u32, ReduceOp::Sum)?;
        ck.save_async_snapshot(&comm, 3, snap)?;
        assert_eq!(loop_sum, 2);
        ck.wait()?;
        let loaded = ck.load_step(&comm, 3)?;
        let part = loaded.state.part("sum").expect("the built part");
        assert_eq!(part.meta::<f64>("total")?, 30.0);
        assert_eq!(part.meta::<usize>("writer_world")?, 2);

        // a build failing on rank 1: every rank's save fails, rank 0's build still ran
        let fail = comm.rank() == 1;
        let mut snap = Snapshot::new();
        snap.build_later("bad", move |_| {
            if fail {
                return Err(CkptError::Config("the build failed".into()));
            }
            Ok(StateDict::new())
        })?;
        snap.build_later("sum", summed(mine))?;
        ck.save_async_snapshot(&comm, 4, snap)?;
        let e = ck.wait().unwrap_err();
        assert_eq!(ck.committed_steps()?, vec![3]);

        let mut snap = Snapshot::new();
        snap.build_later("x", |_| Ok(StateDict::new()))?;
        let no_comm = snap.into_state().unwrap_err().to_string();
        assert!(no_comm.contains("into_state_with"), "{no_comm}");
        Ok(e)
    });
    assert!(
        matches!(&out[1], CkptError::Config(m) if m.contains("the build failed")),
        "{}",
        out[1]
    );
    assert!(
        matches!(&out[0], CkptError::PeerFailed { op: "save", ranks, .. } if ranks == &[1]),
        "{}",
        out[0]
    );
}
