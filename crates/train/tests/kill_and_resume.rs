//! Issue 7's kill-and-resume test: train `tiny` for 20 steps with checkpoints every 5 under
//! dp=2 x tp=2, ZeRO-2 and fp16 loss scaling. A second run crashes while writing its step-10
//! checkpoint; the restarted run (`--resume`) must find step 5 as the last good checkpoint,
//! resume from it and reach step 20 with bitwise the parameters and loss sequence of the
//! uninterrupted run. Two crashes are injected by a storage wrapper:
//! - mid-write: rank 1's file of step 10 is half written when the machine dies (the save
//!   fails on every rank, `step-00000010.tmp/` is left behind, never committed);
//! - torn commit: rank 1's file reaches the disk half written although its write reported
//!   success (a lost write-back cache), step 10 is committed, and the machine dies at step 15;
//!   loading must refuse step 10 by its checksum and fall back to step 5, saying so.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_params_bitwise, test_dir, tiny_config};
use kiln_ckpt::{CkptError, LocalFs, Storage, StorageReader, StorageWriter};
use kiln_train::{run_threads_with, RunConfig, TrainError, TrainSummary, Trainer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

type Params = Vec<(String, Vec<f32>)>;

/// How the machine dies.
#[derive(Clone, Copy, PartialEq)]
enum Crash {
    /// While writing the victim file: half of it lands, then every write fails.
    MidWrite,
    /// Half of the victim lands but its write reports success; every file of a later step
    /// fails.
    TornCommit,
}

/// A [`Storage`] over the local filesystem that injects [`Crash`] at one file.
struct Faulty {
    inner: LocalFs,
    victim: String,
    crash: Crash,
    crashed: Arc<AtomicBool>,
}

struct HalfWriter {
    inner: Box<dyn StorageWriter>,
    buf: Vec<u8>,
    crash: Crash,
    crashed: Arc<AtomicBool>,
}

fn gone(path: &str) -> CkptError {
    CkptError::File {
        op: "write",
        path: path.to_string(),
        source: std::io::Error::other("injected crash: the machine is gone"),
    }
}

impl StorageWriter for HalfWriter {
    fn write(&mut self, buf: &[u8]) -> kiln_ckpt::Result<()> {
        self.buf.extend_from_slice(buf);
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> kiln_ckpt::Result<()> {
        let half = self.buf.len() / 2;
        self.inner.write(&self.buf[..half])?;
        self.inner.finish()?;
        match self.crash {
            Crash::MidWrite => {
                self.crashed.store(true, Ordering::SeqCst);
                Err(gone("the victim file"))
            }
            Crash::TornCommit => Ok(()),
        }
    }
}

impl Storage for Faulty {
    fn create(&self, path: &str) -> kiln_ckpt::Result<Box<dyn StorageWriter>> {
        let later = path.starts_with("step-")
            && path.as_bytes().get(5..13) > self.victim.as_bytes().get(5..13);
        if self.crash == Crash::TornCommit && later {
            self.crashed.store(true, Ordering::SeqCst);
        }
        if self.crashed.load(Ordering::SeqCst) {
            return Err(gone(path));
        }
        let w = self.inner.create(path)?;
        if path == self.victim {
            return Ok(Box::new(HalfWriter {
                inner: w,
                buf: Vec::new(),
                crash: self.crash,
                crashed: self.crashed.clone(),
            }));
        }
        Ok(w)
    }
    fn open(&self, path: &str) -> kiln_ckpt::Result<Box<dyn StorageReader>> {
        self.inner.open(path)
    }
    fn size(&self, path: &str) -> kiln_ckpt::Result<u64> {
        self.inner.size(path)
    }
    fn list(&self, dir: &str) -> kiln_ckpt::Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn exists(&self, path: &str) -> kiln_ckpt::Result<bool> {
        self.inner.exists(path)
    }
    fn rename(&self, from: &str, to: &str) -> kiln_ckpt::Result<()> {
        if self.crashed.load(Ordering::SeqCst) {
            return Err(gone(to));
        }
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &str) -> kiln_ckpt::Result<()> {
        self.inner.remove(path)
    }
    fn sync_dir(&self, dir: &str) -> kiln_ckpt::Result<()> {
        self.inner.sync_dir(dir)
    }
}

fn config(root: &std::path::Path, ckpt: &str) -> RunConfig {
    let mut cfg = tiny_config("kill_and_resume", root, "shakespeare_200k", 200_000);
    cfg.apply_overrides(&[
        ("dp", "2"),
        ("tp", "2"),
        ("zero", "2"),
        ("precision", "f16"),
        ("steps", "20"),
        ("ckpt_every", "5"),
        ("checkpoint.keep_last", "0"),
        ("checkpoint.async_save", "false"),
        ("metrics.tensorboard", "off"),
        ("metrics.png", "off"),
    ])
    .unwrap();
    cfg.checkpoint.dir = Some(root.join(ckpt));
    cfg.output_dir = root.join(format!("out-{ckpt}"));
    cfg
}

fn run(
    cfg: &RunConfig,
    storage: Option<Arc<dyn Storage>>,
) -> Result<(TrainSummary, Params), TrainError> {
    let mut out = run_threads_with(cfg, |ctx| {
        let mut b = Trainer::builder(ctx.config.clone());
        if let Some(s) = &storage {
            b = b.storage(s.clone());
        }
        let mut t = b.build(ctx.comm)?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        let p = t.dense_parameters()?;
        Ok((t.finish()?, p))
    })?;
    Ok(out.swap_remove(0))
}

/// Crashes a run as `crash` says, checks what it left, restarts it with `--resume` and
/// compares with the uninterrupted run.
fn crash_and_restart(root: &std::path::Path, crash: Crash, reference: &(TrainSummary, Params)) {
    let name = match crash {
        Crash::MidWrite => "mid-write",
        Crash::TornCommit => "torn-commit",
    };
    let cfg = config(root, name);
    let dir = cfg.checkpoint_dir();
    let crashed = Arc::new(AtomicBool::new(false));
    let storage: Arc<dyn Storage> = Arc::new(Faulty {
        inner: LocalFs::new(&dir).unwrap(),
        victim: "step-00000010.tmp/rank-00001.safetensors".into(),
        crash,
        crashed: crashed.clone(),
    });
    let err = run(&cfg, Some(storage)).unwrap_err().to_string();
    println!("{name}: the run failed with: {err}");
    assert!(err.contains("injected crash"), "{err}");
    assert!(crashed.load(Ordering::SeqCst));
    // rank 1's file of step 10 as the uninterrupted run wrote it
    let full = std::fs::metadata(root.join("uninterrupted/step-00000010/rank-00001.safetensors"))
        .unwrap()
        .len();
    let half = |p: &std::path::Path| {
        let n = std::fs::metadata(p).unwrap().len();
        assert_eq!(n, full / 2, "{} holds {n} of {full} bytes", p.display());
    };
    match crash {
        Crash::MidWrite => {
            assert!(!dir.join("step-00000010").exists());
            half(&dir.join("step-00000010.tmp/rank-00001.safetensors"));
        }
        Crash::TornCommit => {
            assert!(dir.join("step-00000010/manifest.json").is_file());
            half(&dir.join("step-00000010/rank-00001.safetensors"));
            assert!(!dir.join("step-00000015").exists());
        }
    }

    let mut restart = cfg.clone();
    restart.checkpoint.resume = true;
    let (resumed, params) = run(&restart, None).unwrap();
    println!(
        "{name}: restarted from step {:?} (damaged checkpoints passed over: {:?}), final loss {:?} vs {:?}",
        resumed.resumed_from, resumed.skipped_checkpoints, resumed.final_loss, reference.0.final_loss
    );
    assert_eq!(resumed.resumed_from, Some(5));
    let skipped: &[u64] = if crash == Crash::TornCommit {
        &[10]
    } else {
        &[]
    };
    assert_eq!(resumed.skipped_checkpoints, skipped);
    assert_eq!(resumed.losses.len(), 15);
    for ((sa, la), (sb, lb)) in reference.0.losses[5..].iter().zip(&resumed.losses) {
        assert_eq!(sa, sb);
        assert_eq!(la.to_bits(), lb.to_bits(), "step {sa}: {la} vs {lb}");
    }
    assert_params_bitwise(&params, &reference.1);
    // the restarted run committed a good step 10 and left no temporary directory
    assert_eq!(
        std::fs::metadata(dir.join("step-00000010/rank-00001.safetensors"))
            .unwrap()
            .len(),
        full
    );
    assert!(!dir.join("step-00000010.tmp").exists());
}

#[test]
fn crash_while_writing_step_10_resumes_from_step_5_bitwise() {
    let root = test_dir("kill_and_resume");
    let reference = run(&config(&root, "uninterrupted"), None).unwrap();
    assert_eq!(reference.0.losses.len(), 20);
    crash_and_restart(&root, Crash::MidWrite, &reference);
    crash_and_restart(&root, Crash::TornCommit, &reference);
}
