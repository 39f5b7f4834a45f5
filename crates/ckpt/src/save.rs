//! The save protocol every rank runs: write its file into `step-N.tmp/`, fsync, report size,
//! sha256 and tensors to rank 0, which writes the manifest, renames the directory to
//! `step-N/` (the commit), updates the `latest` pointer and applies retention.

use crate::digest::sha256_alongside;
use crate::error::{CkptError, Result};
use crate::gather::{all_gather_bytes, broadcast_ok};
use crate::layout::Layout;
use crate::manifest::{hex, rank_file_name, FileEntry, Manifest, TensorEntry, MANIFEST_FORMAT};
use crate::policy::Retention;
use crate::rankfile::{encode, FORMAT_VERSION};
use crate::state::RankState;
use crate::storage::Storage;
use kiln_comm::Communicator;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The manifest file inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The file holding the manifest's sha256 (hex and a newline).
pub const MANIFEST_SHA_FILE: &str = "manifest.sha256";
/// The pointer file at the storage root naming the latest committed directory.
pub const LATEST_FILE: &str = "latest";

/// Bytes hashed and written (or read) per call: large enough for throughput, small enough to hash
/// while the bytes are still in cache.
pub(crate) const WRITE_PIECE: usize = 4 << 20;

/// The directory of a committed checkpoint.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

/// The temporary directory a checkpoint is written into before its commit.
pub fn tmp_dir(step: u64) -> String {
    format!("step-{step:08}.tmp")
}

/// The step of a committed directory name, `None` for anything else (including `.tmp`).
pub(crate) fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Steps of the committed checkpoint directories, increasing.
pub(crate) fn committed_steps(storage: &dyn Storage) -> Result<Vec<u64>> {
    let mut steps: Vec<u64> = storage
        .list("")?
        .iter()
        .filter_map(|n| parse_step_dir(n))
        .collect();
    steps.sort_unstable();
    steps.dedup();
    Ok(steps)
}

/// What a save did.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// The step saved.
    pub step: u64,
    /// The committed directory.
    pub dir: String,
    /// Bytes of this rank's file.
    pub bytes: u64,
    /// Bytes of all rank files.
    pub total_bytes: u64,
    /// This rank's file sha256 (hex).
    pub sha256: String,
    /// Steps retention deleted (rank 0 only; empty elsewhere).
    pub deleted: Vec<u64>,
    /// Problems after the commit that did not undo it (retention or cleanup failures; rank 0
    /// only).
    pub warnings: Vec<String>,
}

/// What the save needs besides the state.
#[derive(Clone)]
pub(crate) struct SaveCtx {
    pub storage: Arc<dyn Storage>,
    pub layout: Layout,
    pub model_hash: String,
    pub user: BTreeMap<String, Value>,
    pub retention: Retention,
}

/// One rank's outcome of writing its file, as sent to every rank.
#[derive(Serialize, Deserialize)]
struct RankReport {
    file: Option<FileEntry>,
    error: Option<String>,
}

/// Writes the state's file and returns its manifest entry.
fn write_rank_file(
    storage: &dyn Storage,
    dir: &str,
    rank: usize,
    state: &RankState,
) -> Result<FileEntry> {
    let enc = encode(state)?;
    let name = rank_file_name(rank);
    let mut w = storage.create(&format!("{dir}/{name}"))?;
    let ((), sha256) = sha256_alongside(|sink| {
        for chunk in enc.chunks() {
            for piece in chunk.chunks(WRITE_PIECE) {
                sink.feed(piece);
                w.write(piece)?;
            }
        }
        Ok(())
    })?;
    w.finish()?;
    let mut tensors = BTreeMap::new();
    for (part, sd) in state.parts() {
        for (n, t) in sd.iter() {
            tensors.insert(
                format!("{part}/{n}"),
                TensorEntry {
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    shard: sd.shard(n).cloned(),
                },
            );
        }
    }
    Ok(FileEntry {
        rank,
        path: name,
        size: enc.len() as u64,
        sha256,
        tensors,
    })
}

/// Rank 0's commit: manifest, rename, pointer. Returns the retention outcome.
fn commit(ctx: &SaveCtx, step: u64, files: Vec<FileEntry>) -> Result<(Vec<u64>, Vec<String>)> {
    let storage = &*ctx.storage;
    let (tmp, dir) = (tmp_dir(step), step_dir(step));
    let manifest = Manifest {
        format: MANIFEST_FORMAT.to_string(),
        version: FORMAT_VERSION,
        step,
        layout: ctx.layout,
        model_hash: ctx.model_hash.clone(),
        files,
        user: ctx.user.clone(),
    };
    let json = manifest.to_json()?;
    storage.put(&format!("{tmp}/{MANIFEST_FILE}"), &json)?;
    let sha = format!("{}\n", hex(&Sha256::digest(&json)));
    storage.put(&format!("{tmp}/{MANIFEST_SHA_FILE}"), sha.as_bytes())?;
    storage.sync_dir(&tmp)?;
    // A directory of the same step can only be a checkpoint that failed verification and
    // was skipped on load: replace it.
    storage.remove(&dir)?;
    storage.rename(&tmp, &dir)?;
    // The commit is done; the pointer is a convenience for readers that cannot list.
    let ptr_tmp = format!("{LATEST_FILE}.tmp");
    storage.put(&ptr_tmp, format!("{dir}\n").as_bytes())?;
    storage.rename(&ptr_tmp, LATEST_FILE)?;

    let mut warnings = Vec::new();
    let mut deleted = Vec::new();
    match committed_steps(storage) {
        Ok(steps) => {
            for s in ctx.retention.to_delete(&steps, step) {
                match storage.remove(&step_dir(s)) {
                    Ok(()) => deleted.push(s),
                    Err(e) => warnings.push(format!("retention could not delete step {s}: {e}")),
                }
            }
        }
        Err(e) => warnings.push(format!("retention could not list checkpoints: {e}")),
    }
    // Temporary directories left by saves that crashed before their commit.
    match storage.list("") {
        Ok(names) => {
            for n in names.iter().filter(|n| n.ends_with(".tmp")) {
                if let Err(e) = storage.remove(n) {
                    warnings.push(format!("could not remove stale {n}: {e}"));
                }
            }
        }
        Err(e) => warnings.push(format!("could not list stale temporary directories: {e}")),
    }
    Ok((deleted, warnings))
}

/// The whole save protocol for one rank. Every rank calls it with the same step (checked by
/// the caller); every rank returns an error if any rank fails, and nothing is committed then.
pub(crate) fn write_checkpoint(
    ctx: &SaveCtx,
    comm: &dyn Communicator,
    step: u64,
    state: &RankState,
) -> Result<SaveReport> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if world != ctx.layout.world() {
        return Err(CkptError::WorldMismatch {
            layout: ctx.layout,
            expected: ctx.layout.world(),
            got: world,
        });
    }
    let tmp = tmp_dir(step);

    // Rank 0 clears what a crashed attempt at this step may have left; the broadcast of its
    // verdict doubles as the barrier before anyone writes.
    let prep = if rank == 0 {
        ctx.storage.remove(&tmp)
    } else {
        Ok(())
    };
    if !broadcast_ok(comm, prep.is_ok())? {
        prep?;
        return Err(CkptError::PeerFailed {
            op: "save",
            ranks: vec![0],
            reason: format!("rank 0 could not clear {tmp}"),
        });
    }

    let local = write_rank_file(&*ctx.storage, &tmp, rank, state);
    let report = match &local {
        Ok(f) => RankReport {
            file: Some(f.clone()),
            error: None,
        },
        Err(e) => RankReport {
            file: None,
            error: Some(e.to_string()),
        },
    };
    let bytes = serde_json::to_vec(&report).unwrap_or_default();
    let reports = all_gather_bytes(comm, &bytes)?;
    let mut files = Vec::with_capacity(world);
    let mut failed = Vec::new();
    let mut first_reason = String::new();
    for (r, b) in reports.iter().enumerate() {
        match serde_json::from_slice::<RankReport>(b) {
            Ok(RankReport {
                file: Some(f),
                error: None,
            }) if f.rank == r => files.push(f),
            Ok(RankReport { error, .. }) => {
                if failed.is_empty() {
                    first_reason = error.unwrap_or_else(|| "no file reported".to_string());
                }
                failed.push(r);
            }
            Err(e) => {
                if failed.is_empty() {
                    first_reason = format!("unreadable report: {e}");
                }
                failed.push(r);
            }
        }
    }
    let mine = local?;
    if !failed.is_empty() {
        return Err(CkptError::PeerFailed {
            op: "save",
            ranks: failed,
            reason: first_reason,
        });
    }
    let total_bytes = files.iter().map(|f| f.size).sum();

    let committed = if rank == 0 {
        Some(commit(ctx, step, files))
    } else {
        None
    };
    let ok = committed.as_ref().is_none_or(|c| c.is_ok());
    let all_ok = broadcast_ok(comm, ok)?;
    let (deleted, warnings) = match committed {
        Some(c) => c?,
        None if all_ok => (Vec::new(), Vec::new()),
        None => {
            return Err(CkptError::PeerFailed {
                op: "commit",
                ranks: vec![0],
                reason: format!("rank 0 could not commit {}", step_dir(step)),
            })
        }
    };
    Ok(SaveReport {
        step,
        dir: step_dir(step),
        bytes: mine.size,
        total_bytes,
        sha256: mine.sha256,
        deleted,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_names() {
        assert_eq!(step_dir(10), "step-00000010");
        assert_eq!(parse_step_dir("step-00000010"), Some(10));
        assert_eq!(parse_step_dir("step-123456789"), Some(123_456_789));
        assert_eq!(parse_step_dir("step-00000010.tmp"), None);
        assert_eq!(parse_step_dir("step-"), None);
        assert_eq!(parse_step_dir("latest"), None);
        assert_eq!(parse_step_dir("step-+1"), None);
    }
}
