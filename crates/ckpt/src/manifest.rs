//! The JSON manifest of one checkpoint: format version, step, world layout, model config
//! hash, every rank file's size and sha256, every tensor's dtype, shape and shard, and user
//! metadata.

use crate::error::{CkptError, Result};
use crate::layout::Layout;
use crate::rankfile::FORMAT_VERSION;
use crate::state::check_part_name;
use kiln_state::check_tensor_name;
use kiln_state::Shard;
use kiln_state::{numel, DType};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The `format` field of every kiln manifest.
pub const MANIFEST_FORMAT: &str = "kiln-ckpt";

/// The file name of rank `rank`'s tensors inside a checkpoint directory.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Lowercase hex of a byte string (sha256 digests).
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

/// One tensor of a rank file, as the manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Element type.
    pub dtype: DType,
    /// Shape of the tensor in the file (the local shape of a shard).
    pub shape: Vec<usize>,
    /// Which part of a global tensor it is; absent for a whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
}

/// One rank's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// The rank that wrote it.
    pub rank: usize,
    /// File name inside the checkpoint directory ([`rank_file_name`]).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// sha256 of the whole file, lowercase hex.
    pub sha256: String,
    /// Its tensors by full name (`<part>/<name>`).
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// The manifest of one committed checkpoint (`manifest.json` in its directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Format version ([`FORMAT_VERSION`] when written by this build).
    pub version: u32,
    /// The training step saved.
    pub step: u64,
    /// The world layout of the run that saved it.
    pub layout: Layout,
    /// The caller's hash of the model configuration.
    pub model_hash: String,
    /// One entry per rank, in rank order.
    pub files: Vec<FileEntry>,
    /// Free-form metadata from the caller.
    #[serde(default)]
    pub user: BTreeMap<String, Value>,
}

impl Manifest {
    /// Pretty JSON bytes.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        let mut v = serde_json::to_vec_pretty(self).map_err(|e| CkptError::Manifest {
            path: "<encode>".to_string(),
            reason: e.to_string(),
        })?;
        v.push(b'\n');
        Ok(v)
    }

    /// Parses and validates manifest bytes. Never panics: malformed input is
    /// [`CkptError::Manifest`], a newer version [`CkptError::UnsupportedVersion`].
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        Self::parse(bytes, "<bytes>")
    }

    /// [`Manifest::from_json`] naming `path` in errors.
    pub(crate) fn parse(bytes: &[u8], path: &str) -> Result<Self> {
        let bad = |reason: String| CkptError::Manifest {
            path: path.to_string(),
            reason,
        };
        // Read the version first, so a newer format is reported as such rather than as
        // whatever field it changed.
        let value: Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let version = value
            .get("version")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("no numeric version field".to_string()))?;
        if version > u64::from(FORMAT_VERSION) {
            return Err(CkptError::UnsupportedVersion {
                path: path.to_string(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let m: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        m.validate().map_err(|e| match e {
            CkptError::Manifest { reason, .. } => bad(reason),
            other => other,
        })?;
        Ok(m)
    }

    /// Checks the invariants a manifest written by kiln satisfies: known format, a valid
    /// layout with one file per rank named by [`rank_file_name`], sha256 digests of 64 hex
    /// digits, valid tensor names, and shards that fit their tensors.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(CkptError::Manifest {
                path: "<manifest>".to_string(),
                reason,
            })
        };
        if self.format != MANIFEST_FORMAT {
            return bad(format!(
                "format is {:?}, expected {MANIFEST_FORMAT:?}",
                self.format
            ));
        }
        if self.version == 0 {
            return bad("version 0 does not exist".to_string());
        }
        if let Err(e) = self.layout.validate() {
            return bad(e.to_string());
        }
        if self.files.len() != self.layout.world() {
            return bad(format!(
                "layout {} has {} ranks but the manifest lists {} files",
                self.layout,
                self.layout.world(),
                self.files.len()
            ));
        }
        for (i, f) in self.files.iter().enumerate() {
            if f.rank != i {
                return bad(format!("file {i} is listed for rank {}", f.rank));
            }
            if f.path != rank_file_name(i) {
                return bad(format!(
                    "rank {i}'s file is {:?}, expected {:?}",
                    f.path,
                    rank_file_name(i)
                ));
            }
            if f.sha256.len() != 64
                || !f
                    .sha256
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            {
                return bad(format!(
                    "rank {i}: sha256 {:?} is not 64 lowercase hex digits",
                    f.sha256
                ));
            }
            if f.size < 8 {
                return bad(format!("rank {i}: size {} is too small", f.size));
            }
            for (name, t) in &f.tensors {
                let Some((part, tname)) = name.split_once('/') else {
                    return bad(format!("tensor {name:?} is not named <part>/<name>"));
                };
                if check_part_name(part).is_err() || check_tensor_name(tname).is_err() {
                    return bad(format!("tensor name {name:?} is invalid"));
                }
                let ok = numel(&t.shape)
                    .and_then(|n| n.checked_mul(t.dtype.size_in_bytes()))
                    .is_some_and(|b| b as u64 <= f.size);
                if !ok {
                    return bad(format!(
                        "tensor {name}: {} {:?} does not fit in {} bytes",
                        t.dtype, t.shape, f.size
                    ));
                }
                if let Some(s) = &t.shard {
                    if let Err(e) = s.validate_local(&t.shape) {
                        return bad(e.named(name).to_string());
                    }
                }
            }
        }
        Ok(())
    }

    /// The entry of rank `rank`'s file.
    pub fn file(&self, rank: usize) -> Option<&FileEntry> {
        self.files.get(rank)
    }

    /// Total bytes of all rank files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "model/w".to_string(),
            TensorEntry {
                dtype: DType::F32,
                shape: vec![2, 4],
                shard: Some(Shard::dim(&[4, 4], 0, 0, 2)),
            },
        );
        tensors.insert(
            "rng/seed".to_string(),
            TensorEntry {
                dtype: DType::I64,
                shape: vec![],
                shard: None,
            },
        );
        let files = (0..2)
            .map(|r| FileEntry {
                rank: r,
                path: rank_file_name(r),
                size: 100,
                sha256: "ab".repeat(32),
                tensors: tensors.clone(),
            })
            .collect();
        Manifest {
            format: MANIFEST_FORMAT.to_string(),
            version: FORMAT_VERSION,
            step: 10,
            layout: Layout::new(1, 2, kiln_state::ZeroStage::Replicated).unwrap(),
            model_hash: "gpt-tiny".to_string(),
            files,
            user: [("lr".to_string(), Value::from(0.001))].into(),
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let j = m.to_json().unwrap();
        assert_eq!(Manifest::from_json(&j).unwrap(), m);
        assert_eq!(m.total_bytes(), 200);
    }

    fn mutate(f: impl FnOnce(&mut Value)) -> Result<Manifest> {
        let mut v: Value = serde_json::from_slice(&sample().to_json().unwrap()).unwrap();
        f(&mut v);
        Manifest::from_json(&serde_json::to_vec(&v).unwrap())
    }

    #[test]
    fn newer_version_is_reported_as_such() {
        let e = mutate(|v| {
            v["version"] = Value::from(2);
            v["files"] = Value::from("changed in v2");
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "<bytes>: format version 2 is newer than the supported version 1"
        );
    }

    #[test]
    fn invalid_manifests_are_errors() {
        type Edit = Box<dyn FnOnce(&mut Value)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("format", Box::new(|v| v["format"] = Value::from("other"))),
            ("world", Box::new(|v| v["layout"]["tp"] = Value::from(3))),
            ("dp0", Box::new(|v| v["layout"]["dp"] = Value::from(0))),
            ("rank", Box::new(|v| v["files"][1]["rank"] = Value::from(0))),
            (
                "path",
                Box::new(|v| v["files"][0]["path"] = Value::from("../../etc/passwd")),
            ),
            (
                "sha",
                Box::new(|v| v["files"][0]["sha256"] = Value::from("XYZ")),
            ),
            (
                "shard",
                Box::new(|v| {
                    v["files"][0]["tensors"]["model/w"]["shape"] = Value::from(vec![3, 4])
                }),
            ),
            (
                "name",
                Box::new(|v| {
                    let t = v["files"][0]["tensors"]["model/w"].clone();
                    v["files"][0]["tensors"]["noslash"] = t;
                }),
            ),
            ("step", Box::new(|v| v["step"] = Value::from(-1))),
            ("version", Box::new(|v| v["version"] = Value::from("1"))),
        ];
        for (what, f) in cases {
            let e = mutate(f).unwrap_err();
            assert!(matches!(e, CkptError::Manifest { .. }), "{what}: {e}");
        }
        assert!(Manifest::from_json(b"{").is_err());
        assert!(Manifest::from_json(b"").is_err());
    }
}
