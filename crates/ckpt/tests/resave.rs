//! Re-saving a committed step (after a rollback, or a resume that reaches the step again)
//! with a crash at every storage operation of the save: a fresh loader must always find the
//! step, with its old or its new content, verified, and the next commit must tidy up without
//! losing it.
//!
//! What this catches: the commit used to `remove(step-N)` and then `rename(step-N.tmp,
//! step-N)`. A crash between the two left only `step-N.tmp/`, which loading ignores and the
//! next commit deletes as a stale temporary: step N was gone, and `load_step(N)` failed with
//! "missing step-0000000N/manifest.json". Here the crash after the operation that takes the
//! old copy away from `step-N/` (now the rename aside) is one of the crash points, and
//! `crash_at_every_operation_of_a_resave_keeps_the_step` requires the step to load there.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{sample_state, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{
    replaced_dir, step_dir, tmp_dir, CheckpointConfig, Checkpointer, CkptError, Layout, LocalFs,
    RankState, Result, Retention, Storage, StorageReader, StorageWriter,
};
use kiln_comm::Communicator;
use kiln_testkit::run_ranks;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const STEP: u64 = 10;

fn config() -> CheckpointConfig {
    CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Zero1).unwrap(), "gpt-test")
}

/// The content first committed as step 10.
fn old(rank: usize) -> RankState {
    sample_state(rank, STEP)
}

/// The content a re-save commits as step 10 (what a rolled-back run holds at step 10).
fn new(rank: usize) -> RankState {
    sample_state(rank, 1000 + STEP)
}

/// A storage whose machine dies after `budget` mutating operations (create, rename, remove):
/// the operation past the budget and every later one fail, as nothing runs after a crash.
/// Every durable operation that completed stays done (a [`LocalFs`] rename is durable when it
/// returns). Logs the mutating operations it let through.
struct Crashing {
    inner: LocalFs,
    budget: Mutex<Option<usize>>,
    crashed: AtomicBool,
    log: Mutex<Vec<String>>,
}

impl Crashing {
    fn new(inner: LocalFs, budget: Option<usize>) -> Self {
        Crashing {
            inner,
            budget: Mutex::new(budget),
            crashed: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        }
    }

    fn alive(&self, what: &str) -> Result<()> {
        if self.crashed.load(Ordering::SeqCst) {
            return Err(CkptError::File {
                op: "storage",
                path: what.to_string(),
                source: std::io::Error::other("injected crash: the machine is gone"),
            });
        }
        Ok(())
    }

    /// Spends one mutating operation of the budget, crashing when there is none left.
    fn mutate(&self, what: String) -> Result<()> {
        self.alive(&what)?;
        let mut budget = self.budget.lock().unwrap();
        if let Some(b) = budget.as_mut() {
            if *b == 0 {
                self.crashed.store(true, Ordering::SeqCst);
                drop(budget);
                return self.alive(&what);
            }
            *b -= 1;
        }
        self.log.lock().unwrap().push(what);
        Ok(())
    }
}

impl Storage for Crashing {
    fn create(&self, path: &str) -> Result<Box<dyn StorageWriter>> {
        self.mutate(format!("create {path}"))?;
        self.inner.create(path)
    }
    fn open(&self, path: &str) -> Result<Box<dyn StorageReader>> {
        self.alive(path)?;
        self.inner.open(path)
    }
    fn size(&self, path: &str) -> Result<u64> {
        self.alive(path)?;
        self.inner.size(path)
    }
    fn list(&self, dir: &str) -> Result<Vec<String>> {
        self.alive(dir)?;
        self.inner.list(dir)
    }
    fn exists(&self, path: &str) -> Result<bool> {
        self.alive(path)?;
        self.inner.exists(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.mutate(format!("rename {from} {to}"))?;
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &str) -> Result<()> {
        self.mutate(format!("remove {path}"))?;
        self.inner.remove(path)
    }
    fn sync_dir(&self, dir: &str) -> Result<()> {
        self.alive(dir)?;
        self.inner.sync_dir(dir)
    }
}

/// Top-level entries of the checkpoint root.
fn entries(dir: &TempDir) -> Vec<String> {
    LocalFs::new(&dir.0).unwrap().list("").unwrap()
}

/// What a re-save through [`Crashing`] did.
struct Resave {
    dir: TempDir,
    /// Each rank's outcome: the save's warnings, or its error.
    out: Vec<std::result::Result<Vec<String>, String>>,
    /// The mutating operations that went through, in order.
    log: Vec<String>,
    /// Whether the machine died during the save.
    crashed: bool,
}

/// Steps 5 and 10 committed with their first content, then step 10 saved again with [`new`]
/// through a storage that crashes after `budget` mutating operations of that save.
fn resave_with_crash(tag: &str, budget: Option<usize>) -> Resave {
    let dir = TempDir::new(tag);
    let plain: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&plain), config())?;
        ck.save(&comm, 5, &sample_state(comm.rank(), 5))?;
        ck.save(&comm, STEP, &old(comm.rank()))?;
        Ok(())
    });
    let crashing = Arc::new(Crashing::new(LocalFs::new(&dir.0).unwrap(), budget));
    let storage: Arc<dyn Storage> = crashing.clone();
    let out = run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), config())?;
        Ok(ck
            .save(&comm, STEP, &new(comm.rank()))
            .map(|r| r.warnings)
            .map_err(|e| e.to_string()))
    });
    let log = crashing.log.lock().unwrap().clone();
    let crashed = crashing.crashed.load(Ordering::SeqCst);
    Resave {
        dir,
        out,
        log,
        crashed,
    }
}

/// Which content a fresh loader (plain storage, new checkpointers) finds at step 10, checking
/// that `load_step`, `load_latest`, `committed_steps` and the resharded load agree.
fn loaded_content(dir: &TempDir) -> &'static str {
    let storage: Arc<dyn Storage> = dir.storage();
    let found = run_ranks(2, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), config())?;
        assert_eq!(ck.committed_steps()?, [5, STEP], "{:?}", entries(dir));
        // load_step verifies the manifest's and the rank file's sha256
        let loaded = ck.load_step(&comm, STEP)?;
        let rank = comm.rank();
        let which = if loaded.state == old(rank) {
            "old"
        } else if loaded.state == new(rank) {
            "new"
        } else {
            panic!("step {STEP} holds neither content")
        };
        let latest = ck.load_latest(&comm)?;
        assert!(latest.skipped.is_empty(), "{:?}", latest.skipped);
        let latest = latest.loaded.expect("a checkpoint");
        assert_eq!(latest.step, STEP);
        assert_eq!(latest.state, loaded.state);
        assert_eq!(ck.manifest(STEP)?, loaded.manifest);
        Ok(which)
    });
    assert_eq!(found[0], found[1], "ranks loaded different copies");
    found[0]
}

#[test]
fn a_resave_sets_the_old_copy_aside_until_the_new_one_is_committed() {
    let Resave { dir, out, log, .. } = resave_with_crash("resave-ok", None);
    assert_eq!(out, [Ok(vec![]), Ok(vec![])]);
    let (d, aside, tmp) = (step_dir(STEP), replaced_dir(STEP), tmp_dir(STEP));
    // the last occurrence: a stale set-aside copy is also removed (a no-op here) before the
    // rename aside
    let at = |op: &str| {
        log.iter()
            .rposition(|l| l == op)
            .unwrap_or_else(|| panic!("no `{op}` in {log:#?}"))
    };
    // the protocol, in this order
    let aside_at = at(&format!("rename {d} {aside}"));
    let commit_at = at(&format!("rename {tmp} {d}"));
    let pointer_at = at("rename latest.tmp latest");
    let removed_at = at(&format!("remove {aside}"));
    assert!(aside_at < commit_at && commit_at < pointer_at && pointer_at < removed_at);
    // step 10 itself is never removed
    assert!(!log.contains(&format!("remove {d}")), "{log:#?}");
    assert_eq!(loaded_content(&dir), "new");
    assert_eq!(entries(&dir), ["latest", "step-00000005", "step-00000010"]);
}

#[test]
fn crash_at_every_operation_of_a_resave_keeps_the_step() {
    let (d, aside, tmp) = (step_dir(STEP), replaced_dir(STEP), tmp_dir(STEP));
    let mut seen = Vec::new();
    for budget in 0.. {
        let Resave {
            dir,
            out,
            log,
            crashed,
        } = resave_with_crash("resave-crash", Some(budget));
        if !crashed {
            // the budget outlasted the save: every crash point has been tried
            assert_eq!(out, [Ok(vec![]), Ok(vec![])]);
            assert!(budget > 8, "only {budget} operations");
            break;
        }
        let left = entries(&dir);
        let content = loaded_content(&dir);
        let last = log.last().cloned().unwrap_or_default();
        // the content follows the commit: old before the rename into place, new after
        let committed = log.contains(&format!("rename {tmp} {d}"));
        // a crash before the commit fails the save on every rank; one after it leaves the
        // save committed, with rank 0 warning about the cleanup it could not do
        if committed && log.contains(&"rename latest.tmp latest".to_string()) {
            assert!(
                matches!(&out[0], Ok(w) if !w.is_empty()) && out[1].is_ok(),
                "budget {budget}: {out:?}"
            );
        } else {
            assert!(out.iter().all(|r| r.is_err()), "budget {budget}: {out:?}");
        }
        assert_eq!(
            content,
            if committed { "new" } else { "old" },
            "budget {budget}, crashed after `{last}`, left {left:?}"
        );
        seen.push((last.clone(), left.clone()));

        // the next commit of another step tidies up without losing step 10
        let storage: Arc<dyn Storage> = dir.storage();
        run_ranks(2, |comm| {
            let mut ck = Checkpointer::new(Arc::clone(&storage), config())?;
            let rep = ck.save(&comm, 15, &sample_state(comm.rank(), 15))?;
            assert!(rep.warnings.is_empty(), "{:?}", rep.warnings);
            let back = ck.load_step(&comm, STEP)?;
            let expected = if committed {
                new(comm.rank())
            } else {
                old(comm.rank())
            };
            assert_eq!(back.state, expected);
            Ok(())
        });
        assert_eq!(
            entries(&dir),
            ["latest", "step-00000005", "step-00000010", "step-00000015"],
            "budget {budget}"
        );

        // re-saving step 10 again (a second rollback) over what the crash left
        let dir2 = resave_with_crash("resave-again", Some(budget)).dir;
        let storage: Arc<dyn Storage> = dir2.storage();
        run_ranks(2, |comm| {
            let mut ck = Checkpointer::new(Arc::clone(&storage), config())?;
            let third = sample_state(comm.rank(), 2000 + STEP);
            ck.save(&comm, STEP, &third)?;
            assert_eq!(ck.load_latest(&comm)?.loaded.unwrap().state, third);
            Ok(())
        });
        assert_eq!(
            entries(&dir2),
            ["latest", "step-00000005", "step-00000010"],
            "budget {budget}"
        );
    }
    // the three crash points of the replacement sequence were among those tried
    let after = |op: String| {
        seen.iter()
            .find(|(last, _)| *last == op)
            .map(|(_, left)| left.clone())
            .unwrap_or_else(|| panic!("no crash right after `{op}`: {seen:#?}"))
    };
    // after the rename aside: only the set-aside copy holds step 10 (the old code had
    // nothing there)
    let left = after(format!("rename {d} {aside}"));
    assert!(left.contains(&aside) && !left.contains(&d), "{left:?}");
    // after the rename into place, before the pointer: both copies
    let left = after(format!("rename {tmp} {d}"));
    assert!(left.contains(&aside) && left.contains(&d), "{left:?}");
    // after the pointer, before the old copy is removed: both copies
    let left = after("rename latest.tmp latest".to_string());
    assert!(left.contains(&aside) && left.contains(&d), "{left:?}");
}

#[test]
fn the_next_commit_renames_a_lone_set_aside_copy_back_and_retention_keeps_it() {
    // the crash right after the rename aside leaves step 10 only as step-00000010.replaced/
    let full = resave_with_crash("resave-retention", None);
    let aside_at = full
        .log
        .iter()
        .position(|l| *l == format!("rename {} {}", step_dir(STEP), replaced_dir(STEP)))
        .unwrap();
    drop(full);
    let dir = resave_with_crash("resave-retention", Some(aside_at + 1)).dir;
    assert_eq!(
        entries(&dir),
        [
            "latest",
            "step-00000005",
            "step-00000010.replaced",
            "step-00000010.tmp"
        ]
    );
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let cfg = config().with_retention(Retention::keep_last(2));
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg)?;
        // the pointer still names step 10, which loads from the set-aside copy
        assert_eq!(ck.latest_pointer()?, Some(STEP));
        assert_eq!(ck.committed_steps()?, [5, STEP]);
        // step 10 counts as committed: keeping the last two deletes step 5, not step 10
        let rep = ck.save(&comm, 15, &sample_state(comm.rank(), 15))?;
        if comm.rank() == 0 {
            assert_eq!(rep.deleted, [5]);
            assert!(rep.warnings.is_empty(), "{:?}", rep.warnings);
        }
        assert_eq!(ck.committed_steps()?, [STEP, 15]);
        assert_eq!(ck.load_step(&comm, STEP)?.state, old(comm.rank()));
        let rep = ck.save(&comm, 20, &sample_state(comm.rank(), 20))?;
        if comm.rank() == 0 {
            assert_eq!(rep.deleted, [STEP]);
        }
        Ok(())
    });
    assert_eq!(entries(&dir), ["latest", "step-00000015", "step-00000020"]);
}
