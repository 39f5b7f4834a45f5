//! Reading committed checkpoints back: manifest and file verification, and the agreement
//! protocol that makes every rank load the same step (or fail together).

use crate::error::{CkptError, Result};
use crate::gather::{all_gather_bytes, broadcast_steps};
use crate::manifest::{hex, FileEntry, Manifest};
use crate::rankfile::decode;
use crate::save::{committed_steps, step_dir, MANIFEST_FILE, MANIFEST_SHA_FILE};
use crate::state::RankState;
use crate::storage::Storage;
use kiln_comm::Communicator;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

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

/// Reads and verifies the manifest of the checkpoint at `step`.
pub(crate) fn read_manifest(storage: &dyn Storage, step: u64) -> Result<Manifest> {
    let dir = step_dir(step);
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

/// Reads one rank file and checks its size and sha256 against the manifest.
pub(crate) fn read_verified(
    storage: &dyn Storage,
    step: u64,
    entry: &FileEntry,
) -> Result<Vec<u8>> {
    let path = format!("{}/{}", step_dir(step), entry.path);
    let bytes = storage.get(&path)?;
    if bytes.len() as u64 != entry.size {
        return Err(CkptError::SizeMismatch {
            path,
            expected: entry.size,
            got: bytes.len() as u64,
        });
    }
    let got = hex(&Sha256::digest(&bytes));
    if got != entry.sha256 {
        return Err(CkptError::Checksum {
            path,
            expected: entry.sha256.clone(),
            got,
        });
    }
    Ok(bytes)
}

/// Decodes a verified rank file and attaches the manifest's shards, checking that the file
/// holds exactly the tensors the manifest lists.
pub(crate) fn decode_with_manifest(
    bytes: &[u8],
    step: u64,
    entry: &FileEntry,
) -> Result<RankState> {
    let path = format!("{}/{}", step_dir(step), entry.path);
    let mut state = decode(bytes, &path)?;
    let mismatch = |reason: String| CkptError::Manifest {
        path: path.clone(),
        reason,
    };
    let mut seen = 0usize;
    let names: Vec<String> = state.part_names().map(str::to_string).collect();
    for part in names {
        let Some(sd) = state.part_mut(&part) else {
            continue;
        };
        let tensor_names: Vec<String> = sd.names().map(str::to_string).collect();
        for n in tensor_names {
            let full = format!("{part}/{n}");
            let Some(e) = entry.tensors.get(&full) else {
                return Err(mismatch(format!(
                    "file holds {full}, which the manifest lacks"
                )));
            };
            seen += 1;
            let Some(t) = sd.remove(&n) else { continue };
            if t.dtype() != e.dtype || t.shape() != e.shape {
                return Err(mismatch(format!(
                    "{full} is {} {:?} in the file but {} {:?} in the manifest",
                    t.dtype(),
                    t.shape(),
                    e.dtype,
                    e.shape
                )));
            }
            match &e.shard {
                Some(s) => sd.insert_sharded(&n, t, s.clone())?,
                None => sd.insert(&n, t)?,
            }
        }
    }
    if seen != entry.tensors.len() {
        return Err(mismatch(format!(
            "the manifest lists {} tensors, the file holds {seen}",
            entry.tensors.len()
        )));
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
