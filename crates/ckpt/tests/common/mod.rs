//! Helpers shared by kiln-ckpt's integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use half::{bf16, f16};
use kiln_ckpt::{
    CkptError, LocalFs, RankState, Result, StateDict, Step, Storage, StorageReader, StorageWriter,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh, empty directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "kiln-ckpt-test-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn storage(&self) -> Arc<LocalFs> {
        Arc::new(LocalFs::new(&self.0).unwrap())
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A deterministic pseudo-random f32 sequence (splitmix64), different per seed.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A rank's state with every dtype, depending on `rank` and `step`.
pub fn sample_state(rank: usize, step: u64) -> RankState {
    let seed = rank as u64 * 1000 + step;
    let mut model = StateDict::new();
    model.put("w", &[3, 5], &values(seed, 15)).unwrap();
    let h: Vec<f16> = values(seed + 1, 4)
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    model.put("h", &[4], &h).unwrap();
    let b: Vec<bf16> = values(seed + 2, 6)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    model.put("layers/0/b", &[2, 3], &b).unwrap();
    model.set_meta("d_model", 5).unwrap();
    let mut optim = StateDict::new();
    let m: Vec<f64> = values(seed + 3, 5)
        .iter()
        .map(|&v| v as f64 / 3.0)
        .collect();
    optim.put("exp_avg", &[5], &m).unwrap();
    optim.put("count", &[], &[step as i64]).unwrap();
    optim.put("ids", &[3], &[rank as u32, 7, u32::MAX]).unwrap();
    optim.put("mask", &[4], &[1u8, 0, 255, rank as u8]).unwrap();
    optim.set_meta("lr", 1e-3).unwrap();
    let mut s = RankState::new();
    s.insert("model", model).unwrap();
    s.insert("optim", optim).unwrap();
    s.capture("step", &Step(step)).unwrap();
    s
}

/// Storage that fails a write to any path containing `needle` after `after` bytes, as a disk
/// that fills up or a process killed mid-write would leave it (the partial bytes stay).
pub struct FailingStorage {
    pub inner: LocalFs,
    pub needle: Mutex<Option<String>>,
    pub after: usize,
}

struct FailingWriter {
    inner: Box<dyn StorageWriter>,
    written: usize,
    limit: Option<usize>,
    path: String,
}

impl StorageWriter for FailingWriter {
    fn write(&mut self, buf: &[u8]) -> Result<()> {
        if let Some(limit) = self.limit {
            if self.written + buf.len() > limit {
                let keep = limit - self.written;
                self.inner.write(&buf[..keep])?;
                self.written = limit;
                return Err(CkptError::File {
                    op: "write",
                    path: self.path.clone(),
                    source: std::io::Error::other("injected fault: no space left"),
                });
            }
        }
        self.written += buf.len();
        self.inner.write(buf)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.inner.finish()
    }
}

impl Storage for FailingStorage {
    fn create(&self, path: &str) -> Result<Box<dyn StorageWriter>> {
        let limit = self
            .needle
            .lock()
            .unwrap()
            .as_ref()
            .filter(|n| path.contains(n.as_str()))
            .map(|_| self.after);
        Ok(Box::new(FailingWriter {
            inner: self.inner.create(path)?,
            written: 0,
            limit,
            path: path.to_string(),
        }))
    }
    fn open(&self, path: &str) -> Result<Box<dyn StorageReader>> {
        self.inner.open(path)
    }
    fn size(&self, path: &str) -> Result<u64> {
        self.inner.size(path)
    }
    fn list(&self, dir: &str) -> Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn exists(&self, path: &str) -> Result<bool> {
        self.inner.exists(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &str) -> Result<()> {
        self.inner.remove(path)
    }
    fn sync_dir(&self, dir: &str) -> Result<()> {
        self.inner.sync_dir(dir)
    }
}
