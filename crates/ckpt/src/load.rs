//! Reading committed checkpoints back: manifest and file verification, and the agreement
//! protocol that makes every rank load the same step (or fail together).

use crate::digest::sha256_alongside;
use crate::error::{CkptError, Result};
use crate::gather::{all_gather_bytes, broadcast_steps};
use crate::manifest::{hex, FileEntry, Manifest};
use crate::rankfile::{header_len, parse_header, IndexedTensor};
use crate::save::WRITE_PIECE;
use crate::save::{committed_dir, committed_steps, step_dir, MANIFEST_FILE, MANIFEST_SHA_FILE};
use crate::state::RankState;
use crate::storage::Storage;
use crate::storage::StorageReader;
use kiln_comm::Communicator;
use kiln_state::StateDict;
use kiln_state::TensorData;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// A checkpoint read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// Its step.
    pub step: u64,
    /// Its manifest.
    pub manifest: Manifest,
    /// This rank's state (tensors carry the shards the manifest records).
    pub state: RankState,
}

/// Why one rank could not use a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankProblem {
    /// The rank.
    pub rank: usize,
    /// Its error message.
    pub reason: String,
}

/// A checkpoint `load_latest` passed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Its step.
    pub step: u64,
    /// What each failing rank found wrong.
    pub problems: Vec<RankProblem>,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped checkpoint {}:", step_dir(self.step))?;
        for p in &self.problems {
            write!(f, " rank {}: {};", p.rank, p.reason)?;
        }
        Ok(())
    }
}

/// The outcome of a search for the newest good checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Latest<T> {
    /// The newest checkpoint every rank could load, if any.
    pub loaded: Option<T>,
    /// Newer checkpoints passed over, newest first, with the reasons (log them).
    pub skipped: Vec<Skipped>,
}

/// Reads and verifies the manifest of the committed checkpoint at `step`, wherever it lives
/// (see [`committed_dir`]).
pub(crate) fn read_manifest(storage: &dyn Storage, step: u64) -> Result<Manifest> {
    read_manifest_in(storage, &committed_dir(storage, step)?, step)
}

/// Reads and verifies the manifest of checkpoint `step` in directory `dir`.
pub(crate) fn read_manifest_in(storage: &dyn Storage, dir: &str, step: u64) -> Result<Manifest> {
    let path = format!("{dir}/{MANIFEST_FILE}");
    let bytes = storage.get(&path)?;
    let sha_path = format!("{dir}/{MANIFEST_SHA_FILE}");
    let recorded = storage.get(&sha_path)?;
    let recorded = String::from_utf8_lossy(&recorded).trim().to_string();
    let got = hex(&Sha256::digest(&bytes));
    if recorded != got {
        return Err(CkptError::Checksum {
            path,
            expected: recorded,
            got,
        });
    }
    let m = Manifest::parse(&bytes, &path)?;
    if m.step != step {
        return Err(CkptError::Manifest {
            path,
            reason: format!("records step {} but lives in {dir}", m.step),
        });
    }
    Ok(m)
}

/// A rank file read back and verified against its manifest entry.
pub(crate) struct VerifiedFile {
    /// Each part's metadata.
    pub meta: BTreeMap<String, BTreeMap<String, Value>>,
    /// Tensors by full name `<part>/<name>`.
    pub tensors: BTreeMap<String, TensorData>,
}

/// After a header that does not parse: reads the rest of the file and reports a checksum
/// mismatch if there is one (the file was damaged), else the parse error.
fn damaged(
    r: &mut dyn StorageReader,
    head: &[u8],
    size: usize,
    entry: &FileEntry,
    path: &str,
    parse_error: CkptError,
) -> CkptError {
    let mut h = Sha256::new();
    h.update(head);
    let mut left = size.saturating_sub(head.len());
    let mut buf = vec![0u8; left.min(WRITE_PIECE)];
    while left > 0 {
        let n = left.min(buf.len());
        if let Err(e) = r.read_exact(&mut buf[..n]) {
            return e;
        }
        h.update(&buf[..n]);
        left -= n;
    }
    let got = hex(&h.finalize());
    if got != entry.sha256 {
        return CkptError::Checksum {
            path: path.to_string(),
            expected: entry.sha256.clone(),
            got,
        };
    }
    parse_error
}

/// Reads rank file `entry` of the checkpoint in directory `dir` straight into one buffer per
/// tensor, hashing on a second thread as it reads, and checks size, sha256 and the manifest's
/// tensor list.
pub(crate) fn read_rank_file(
    storage: &dyn Storage,
    dir: &str,
    entry: &FileEntry,
) -> Result<VerifiedFile> {
    let path = format!("{dir}/{}", entry.path);
    let mut r = storage.open(&path)?;
    if r.size() != entry.size {
        return Err(CkptError::SizeMismatch {
            path,
            expected: entry.size,
            got: r.size(),
        });
    }
    let size = usize::try_from(entry.size).map_err(|_| CkptError::Format {
        path: path.clone(),
        reason: format!("{} bytes do not fit in memory", entry.size),
    })?;
    let mut head = vec![0u8; 8.min(size)];
    r.read_exact(&mut head)?;
    let n = match header_len(&head, size, &path) {
        Ok(n) => n,
        Err(e) => return Err(damaged(&mut *r, &head, size, entry, &path, e)),
    };
    head.resize(8 + n, 0);
    r.read_exact(&mut head[8..])?;
    let idx = match parse_header(&head, size, &path) {
        Ok(i) => i,
        Err(e) => return Err(damaged(&mut *r, &head, size, entry, &path, e)),
    };
    let mut order: Vec<(String, IndexedTensor)> = idx.tensors.into_iter().collect();
    order.sort_by_key(|(_, t)| t.range.start);
    let mut bufs: Vec<Vec<u8>> = order
        .iter()
        .map(|(_, t)| vec![0u8; t.range.len()])
        .collect();
    let head_ref = &head;
    let bufs_ref = &mut bufs;
    let ((), got) = sha256_alongside(|sink| {
        sink.feed(head_ref);
        for buf in bufs_ref {
            let slice: &mut [u8] = buf.as_mut_slice();
            for piece in slice.chunks_mut(WRITE_PIECE) {
                r.read_exact(piece)?;
                sink.feed(piece);
            }
        }
        Ok(())
    })?;
    if got != entry.sha256 {
        return Err(CkptError::Checksum {
            path,
            expected: entry.sha256.clone(),
            got,
        });
    }
    let mismatch = |reason: String| CkptError::Manifest {
        path: path.clone(),
        reason,
    };
    if order.len() != entry.tensors.len() {
        return Err(mismatch(format!(
            "the manifest lists {} tensors, the file holds {}",
            entry.tensors.len(),
            order.len()
        )));
    }
    let mut tensors = BTreeMap::new();
    for ((full, t), buf) in order.into_iter().zip(bufs) {
        let Some(e) = entry.tensors.get(&full) else {
            return Err(mismatch(format!(
                "file holds {full}, which the manifest lacks"
            )));
        };
        if t.dtype != e.dtype || t.shape != e.shape {
            return Err(mismatch(format!(
                "{full} is {} {:?} in the file but {} {:?} in the manifest",
                t.dtype, t.shape, e.dtype, e.shape
            )));
        }
        let td = TensorData::new(t.dtype, t.shape, buf).map_err(|e| e.named(&full))?;
        tensors.insert(full, td);
    }
    Ok(VerifiedFile {
        meta: idx.meta,
        tensors,
    })
}

/// This rank's state from its verified file, with the manifest's shards attached.
pub(crate) fn into_rank_state(file: VerifiedFile, entry: &FileEntry) -> Result<RankState> {
    let mut parts: BTreeMap<String, StateDict> = BTreeMap::new();
    for (part, meta) in file.meta {
        let mut sd = StateDict::new();
        *sd.meta_map_mut() = meta;
        parts.insert(part, sd);
    }
    for (full, t) in file.tensors {
        let Some((part, name)) = full.split_once('/') else {
            continue;
        };
        let sd = parts.entry(part.to_string()).or_default();
        match entry.tensors.get(&full).and_then(|e| e.shard.clone()) {
            Some(s) => sd.insert_sharded(name, t, s)?,
            None => sd.insert(name, t)?,
        }
    }
    let mut state = RankState::new();
    for (part, sd) in parts {
        state.insert(&part, sd)?;
    }
    Ok(state)
}

/// How one rank fared with one candidate, as sent to every rank.
#[derive(Serialize, Deserialize)]
struct Verdict {
    /// 0 ok, 1 damaged (skip it), 2 stop.
    code: u8,
    reason: String,
}

/// What the ranks found, all together.
enum Outcome {
    /// Every rank succeeded.
    AllOk,
    /// Some ranks found the checkpoint damaged, none hit a hard error.
    Damaged(Vec<RankProblem>),
    /// Some ranks hit an error that stops the load.
    Hard(Vec<RankProblem>),
}

/// Shares every rank's result for one candidate with every rank.
fn agree<T>(comm: &dyn Communicator, res: &Result<T>) -> Result<Outcome> {
    let mine = match res {
        Ok(_) => Verdict {
            code: 0,
            reason: String::new(),
        },
        Err(e) => Verdict {
            code: if e.is_corruption() { 1 } else { 2 },
            reason: e.to_string(),
        },
    };
    let bytes = serde_json::to_vec(&mine).unwrap_or_default();
    let all = all_gather_bytes(comm, &bytes)?;
    let mut damaged = Vec::new();
    let mut hard = Vec::new();
    for (rank, b) in all.iter().enumerate() {
        let v = serde_json::from_slice::<Verdict>(b).unwrap_or(Verdict {
            code: 2,
            reason: "unreadable verdict".to_string(),
        });
        let p = RankProblem {
            rank,
            reason: v.reason,
        };
        match v.code {
            0 => {}
            1 => damaged.push(p),
            _ => hard.push(p),
        }
    }
    Ok(if !hard.is_empty() {
        Outcome::Hard(hard)
    } else if !damaged.is_empty() {
        Outcome::Damaged(damaged)
    } else {
        Outcome::AllOk
    })
}

/// This rank's error when it has one, else a [`CkptError::PeerFailed`] naming the others.
fn own_or_peer<T>(res: Result<T>, problems: &[RankProblem]) -> CkptError {
    match res {
        Err(e) => e,
        Ok(_) => CkptError::PeerFailed {
            op: "load",
            ranks: problems.iter().map(|p| p.rank).collect(),
            reason: problems
                .first()
                .map(|p| p.reason.clone())
                .unwrap_or_default(),
        },
    }
}

/// Runs `load` at `step` on every rank; any failure anywhere fails every rank.
pub(crate) fn load_agreed<T>(
    comm: &dyn Communicator,
    step: u64,
    load: impl FnOnce(u64) -> Result<T>,
) -> Result<T> {
    let res = load(step);
    match agree(comm, &res)? {
        Outcome::AllOk => res,
        Outcome::Damaged(p) | Outcome::Hard(p) => Err(own_or_peer(res, &p)),
    }
}

/// Tries the committed checkpoints from the newest down until one loads on every rank.
/// Damaged checkpoints are skipped and reported; a hard error (i/o, version, layout, model
/// mismatch) on any rank stops the search on every rank.
pub(crate) fn latest_agreed<T>(
    storage: &dyn Storage,
    comm: &dyn Communicator,
    mut load: impl FnMut(u64) -> Result<T>,
) -> Result<Latest<T>> {
    let listed = if comm.rank() == 0 {
        Some(committed_steps(storage))
    } else {
        None
    };
    let mine = match &listed {
        Some(Ok(s)) => Ok(s.as_slice()),
        Some(Err(_)) => Err(()),
        None => Ok(&[][..]),
    };
    let Some(steps) = broadcast_steps(comm, mine)? else {
        if let Some(Err(e)) = listed {
            return Err(e);
        }
        return Err(CkptError::PeerFailed {
            op: "load",
            ranks: vec![0],
            reason: "rank 0 could not list the checkpoints".to_string(),
        });
    };
    let mut skipped = Vec::new();
    for &step in steps.iter().rev() {
        let res = load(step);
        match agree(comm, &res)? {
            Outcome::AllOk => {
                return Ok(Latest {
                    loaded: Some(res?),
                    skipped,
                })
            }
            Outcome::Damaged(problems) => skipped.push(Skipped { step, problems }),
            Outcome::Hard(p) => {
                return Err(match res {
                    Err(e) if !e.is_corruption() => e,
                    _ => own_or_peer(Ok(()), &p),
                })
            }
        }
    }
    Ok(Latest {
        loaded: None,
        skipped,
    })
}
