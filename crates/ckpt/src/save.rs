//! The save protocol every rank runs: write its file into `step-N.tmp/`, fsync, report size,
//! sha256 and tensors to rank 0, which writes the manifest, renames the directory to
//! `step-N/` (the commit), updates the `latest` pointer and applies retention.
//!
//! Re-saving a step that is already committed (after a rollback, or a resume that reaches the
//! same step again) never deletes the committed copy before its replacement is committed.
//! Rank 0 runs, each step durable before the next:
//!
//! 1. rename `step-N/` aside to `step-N.replaced/` (a stale `step-N.replaced/` beside a
//!    `step-N/` is removed first: `step-N/` is the newer commit);
//! 2. rename `step-N.tmp/` to `step-N/`: the commit;
//! 3. write the `latest` pointer;
//! 4. remove `step-N.replaced/`.
//!
//! A crash anywhere in between leaves step N committed: after 1, only as `step-N.replaced/`
//! (the old content), which loading and listing treat as step N whenever `step-N/` is absent;
//! after 2 or 3, as `step-N/` (the new content) with a leftover set-aside copy that loading
//! ignores. The next commit of any step finishes the job (`recover_replaced`): a set-aside
//! copy whose `step-N/` exists is removed, one without is renamed back to `step-N/`. Stale
//! temporary cleanup only ever removes `.tmp` names, never a set-aside copy.

use crate::digest::sha256_beside;
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

/// Bytes written or read per call (and hashed per piece on load): large enough for
/// throughput, small enough to hash a piece just read while it is still in cache.
pub(crate) const WRITE_PIECE: usize = 4 << 20;

/// The directory of a committed checkpoint.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

/// The temporary directory a checkpoint is written into before its commit.
pub fn tmp_dir(step: u64) -> String {
    format!("step-{step:08}.tmp")
}

/// Where a committed checkpoint is set aside while a re-save of its step commits; loading
/// treats it as the committed step `step` when [`step_dir`] is absent (see the module docs of
/// the save protocol).
pub fn replaced_dir(step: u64) -> String {
    format!("step-{step:08}{REPLACED_SUFFIX}")
}

/// The suffix of [`replaced_dir`].
const REPLACED_SUFFIX: &str = ".replaced";

/// The step of a committed directory name, `None` for anything else (including `.tmp` and
/// `.replaced`).
pub(crate) fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The step of a set-aside directory name ([`replaced_dir`]), `None` for anything else.
fn parse_replaced_dir(name: &str) -> Option<u64> {
    parse_step_dir(name.strip_suffix(REPLACED_SUFFIX)?)
}

/// Steps of the committed checkpoints, increasing: every `step-N/`, and every
/// `step-N.replaced/` (a committed copy set aside by a re-save that crashed before removing
/// it; without its `step-N/` it is the only copy of step N).
pub(crate) fn committed_steps(storage: &dyn Storage) -> Result<Vec<u64>> {
    let mut steps: Vec<u64> = storage
        .list("")?
        .iter()
        .filter_map(|n| parse_step_dir(n).or_else(|| parse_replaced_dir(n)))
        .collect();
    steps.sort_unstable();
    steps.dedup();
    Ok(steps)
}

/// The directory holding committed checkpoint `step`: `step-N/`, else `step-N.replaced/` when
/// a re-save crashed after setting the old copy aside and before committing the new one, else
/// `step-N/` (whose files are then missing, which loading reports as [`CkptError::NotFound`]).
pub(crate) fn committed_dir(storage: &dyn Storage, step: u64) -> Result<String> {
    let dir = step_dir(step);
    if storage.exists(&dir)? {
        return Ok(dir);
    }
    let aside = replaced_dir(step);
    if storage.exists(&aside)? {
        return Ok(aside);
    }
    Ok(dir)
}

/// Finishes re-saves that a crash interrupted: each `step-N.replaced/` is removed when
/// `step-N/` (its committed replacement) exists, and renamed back to `step-N/` otherwise.
/// Returns what it could not do, as warnings (nothing is lost then: loading still finds the
/// step).
pub(crate) fn recover_replaced(storage: &dyn Storage) -> Vec<String> {
    let names = match storage.list("") {
        Ok(n) => n,
        Err(e) => return vec![format!("could not list set-aside checkpoints: {e}")],
    };
    let mut warnings = Vec::new();
    for (name, step) in names
        .iter()
        .filter_map(|n| Some((n, parse_replaced_dir(n)?)))
    {
        let dir = step_dir(step);
        let res = match storage.exists(&dir) {
            Ok(true) => storage.remove(name),
            Ok(false) => storage.rename(name, &dir),
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            warnings.push(format!("could not recover set-aside {name}: {e}"));
        }
    }
    warnings
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
    let chunks: Vec<&[u8]> = enc.chunks().collect();
    // The write and its fsync run while another thread hashes the same bytes.
    let ((), sha256) = sha256_beside(&chunks, || {
        for chunk in &chunks {
            for piece in chunk.chunks(WRITE_PIECE) {
                w.write(piece)?;
            }
        }
        w.finish()
    })?;
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

/// Rank 0's commit: manifest, rename (setting a committed copy of the same step aside first,
/// as the module docs describe), pointer. Returns the retention outcome.
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
    // Step N may be committed already (a rollback or a resume re-saving it). Its committed
    // copy is only renamed aside here, and removed once the replacement is committed: at
    // every instant one of the two is there for a loader to find.
    let aside = replaced_dir(step);
    let set_aside = storage.exists(&dir)?;
    if set_aside {
        // `step-N/` is newer than any set-aside copy of step N, which is then stale.
        storage.remove(&aside)?;
        storage.rename(&dir, &aside)?;
    }
    // Without a `step-N/`, a `step-N.replaced/` left by a crashed re-save is the committed
    // step N: it stays until the new copy is committed.
    if let Err(e) = storage.rename(&tmp, &dir) {
        // Put the old copy back where the rename did not happen (best effort: loading finds
        // the set-aside copy anyway, and the next commit renames it back).
        if set_aside && matches!(storage.exists(&dir), Ok(false)) {
            let _ = storage.rename(&aside, &dir);
        }
        return Err(e);
    }
    // The commit is done; the pointer is a convenience for readers that cannot list.
    let ptr_tmp = format!("{LATEST_FILE}.tmp");
    storage.put(&ptr_tmp, format!("{dir}\n").as_bytes())?;
    storage.rename(&ptr_tmp, LATEST_FILE)?;

    let mut warnings = Vec::new();
    if let Err(e) = storage.remove(&aside) {
        warnings.push(format!("could not remove the replaced copy {aside}: {e}"));
    }
    // Set-aside copies of re-saves that crashed (of any step) are removed or renamed back.
    warnings.extend(recover_replaced(storage));
    let mut deleted = Vec::new();
    match committed_steps(storage) {
        Ok(steps) => {
            for s in ctx.retention.to_delete(&steps, step) {
                // A set-aside copy is step `s` too: retention deletes both.
                match storage
                    .remove(&replaced_dir(s))
                    .and_then(|()| storage.remove(&step_dir(s)))
                {
                    Ok(()) => deleted.push(s),
                    Err(e) => warnings.push(format!("retention could not delete step {s}: {e}")),
                }
            }
        }
        Err(e) => warnings.push(format!("retention could not list checkpoints: {e}")),
    }
    // Temporary directories left by saves that crashed before their commit (only `.tmp`
    // names: a `.replaced` copy is a committed checkpoint, never a stale temporary).
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
/// A `state` that could not be produced (an `Err`) fails the save on every rank, as a write
/// error would.
pub(crate) fn write_checkpoint(
    ctx: &SaveCtx,
    comm: &dyn Communicator,
    step: u64,
    state: Result<&RankState>,
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

    let local = state.and_then(|st| write_rank_file(&*ctx.storage, &tmp, rank, st));
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
        assert_eq!(replaced_dir(10), "step-00000010.replaced");
        assert_eq!(parse_step_dir("step-00000010.replaced"), None);
        assert_eq!(parse_replaced_dir("step-00000010.replaced"), Some(10));
        assert_eq!(parse_replaced_dir("step-00000010.tmp"), None);
        assert_eq!(parse_replaced_dir("step-.replaced"), None);
        assert_eq!(parse_replaced_dir("step-00000010"), None);
    }
}
