//! One rank's checkpoint file: a safetensors file whose tensors are named `<part>/<name>` and
//! whose header `__metadata__` holds each part's metadata as a JSON string, plus the kiln
//! format version under `__kiln_format__`.
//!
//! The header is written deterministically (metadata keys sorted, tensors ordered as the
//! `safetensors` crate orders them: by descending dtype alignment, then by name), so the same
//! state always gives the same bytes and the same sha256. Reading goes through
//! `safetensors::SafeTensors::read_metadata`, which validates offsets and sizes.

use crate::error::{CkptError, Result};
use crate::state::{check_part_name, RankState};
use kiln_state::{check_tensor_name, StateDict};
use kiln_state::{DType, TensorData};
use safetensors::tensor::TensorInfo;
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;

/// The safetensors dtype of a kiln dtype.
fn to_safetensors(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F64 => safetensors::Dtype::F64,
        DType::I64 => safetensors::Dtype::I64,
        DType::U32 => safetensors::Dtype::U32,
        DType::U8 => safetensors::Dtype::U8,
    }
}

/// The kiln dtype of a safetensors dtype, `None` for types kiln does not store.
fn dtype_from_safetensors(d: safetensors::Dtype) -> Option<DType> {
    Some(match d {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F64 => DType::F64,
        safetensors::Dtype::I64 => DType::I64,
        safetensors::Dtype::U32 => DType::U32,
        safetensors::Dtype::U8 => DType::U8,
        _ => return None,
    })
}

/// The newest checkpoint format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The `__metadata__` key holding the format version.
pub(crate) const FORMAT_KEY: &str = "__kiln_format__";

/// The header JSON object, serialized with `__metadata__` first and tensors in file order.
struct Header<'a> {
    meta: &'a BTreeMap<String, String>,
    tensors: &'a [(String, TensorInfo)],
}

impl Serialize for Header<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.tensors.len() + 1))?;
        if !self.meta.is_empty() {
            map.serialize_entry("__metadata__", self.meta)?;
        }
        for (name, info) in self.tensors {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}

/// The 8-byte little-endian header length followed by the header JSON padded with spaces to a
/// multiple of 8 bytes, as the safetensors crate writes it.
pub(crate) fn header_bytes(
    meta: &BTreeMap<String, String>,
    tensors: &[(String, TensorInfo)],
) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(&Header { meta, tensors }).map_err(|e| CkptError::Format {
        path: "<encode>".to_string(),
        reason: e.to_string(),
    })?;
    let n = json.len().next_multiple_of(8);
    let mut out = Vec::with_capacity(8 + n);
    out.extend_from_slice(&(n as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(8 + n, b' ');
    Ok(out)
}

/// A rank file ready to write: the header, then the tensors' bytes in order.
pub(crate) struct Encoded<'a> {
    /// Length prefix and header.
    pub header: Vec<u8>,
    /// Tensor bytes in file order.
    pub data: Vec<&'a [u8]>,
}

impl Encoded<'_> {
    /// Total file size in bytes.
    pub fn len(&self) -> usize {
        self.header.len() + self.data.iter().map(|d| d.len()).sum::<usize>()
    }

    /// The chunks to write, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(self.header.as_slice()).chain(self.data.iter().copied())
    }
}

/// Lays out a rank's state as a safetensors file without copying tensor bytes.
pub(crate) fn encode(state: &RankState) -> Result<Encoded<'_>> {
    let mut meta = BTreeMap::new();
    meta.insert(FORMAT_KEY.to_string(), FORMAT_VERSION.to_string());
    let mut entries: Vec<(String, &TensorData)> = Vec::new();
    for (part, sd) in state.parts() {
        let m = serde_json::to_string(sd.meta_map()).map_err(|e| kiln_state::StateError::Meta {
            key: part.to_string(),
            reason: e.to_string(),
        })?;
        meta.insert(part.to_string(), m);
        for (name, t) in sd.iter() {
            entries.push((format!("{part}/{name}"), t));
        }
    }
    entries.sort_by(|(ln, lt), (rn, rt)| {
        to_safetensors(rt.dtype())
            .cmp(&to_safetensors(lt.dtype()))
            .then(ln.cmp(rn))
    });
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(entries.len());
    let mut data = Vec::with_capacity(entries.len());
    for (name, t) in entries {
        let n = t.bytes().len();
        infos.push((
            name,
            TensorInfo {
                dtype: to_safetensors(t.dtype()),
                shape: t.shape().to_vec(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
        data.push(t.bytes());
    }
    Ok(Encoded {
        header: header_bytes(&meta, &infos)?,
        data,
    })
}

/// Serializes a rank's state to the bytes of a kiln safetensors file.
///
/// The same state always gives the same bytes. Python reads the file with
/// `safetensors.numpy.load_file` (numpy lacks bf16; torch reads every dtype).
pub fn encode_rank_file(state: &RankState) -> Result<Vec<u8>> {
    let enc = encode(state)?;
    let mut out = Vec::with_capacity(enc.len());
    for c in enc.chunks() {
        out.extend_from_slice(c);
    }
    Ok(out)
}

/// Parses the bytes of a kiln safetensors file back into a rank's state.
///
/// Any malformed input (truncated, bad header, offsets out of range, unsupported dtype, a
/// newer format version) is a typed error, never a panic. Shards are not stored in the file
/// (the manifest records them), so the returned tensors carry none.
pub fn decode_rank_file(bytes: &[u8]) -> Result<RankState> {
    decode(bytes, "<bytes>")
}

/// One tensor located in a rank file's bytes.
#[derive(Debug, Clone)]
pub(crate) struct IndexedTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub range: std::ops::Range<usize>,
}

/// A parsed rank file header: every part's metadata and where each tensor's bytes are.
#[derive(Debug, Clone, Default)]
pub(crate) struct FileIndex {
    pub meta: BTreeMap<String, BTreeMap<String, Value>>,
    /// By full name `<part>/<name>`.
    pub tensors: BTreeMap<String, IndexedTensor>,
}

/// The safetensors crate's limit on the header size.
const MAX_HEADER: usize = 100_000_000;

/// The header length a rank file's first 8 bytes declare, checked against the file length.
pub(crate) fn header_len(first8: &[u8], file_len: usize, path: &str) -> Result<usize> {
    let format = |reason: String| CkptError::Format {
        path: path.to_string(),
        reason,
    };
    let arr: [u8; 8] = first8
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            format(format!(
                "{file_len} bytes cannot hold the 8-byte header length"
            ))
        })?;
    let n = u64::from_le_bytes(arr);
    if n > MAX_HEADER as u64 {
        return Err(format(format!("header length {n} exceeds {MAX_HEADER}")));
    }
    let n = n as usize;
    if n + 8 > file_len {
        return Err(format(format!(
            "header of {n} bytes runs past the end of a {file_len}-byte file"
        )));
    }
    Ok(n)
}

/// Parses and validates a rank file's header (`prefix` holds at least its first
/// `8 + header length` bytes) against the file's total length. Validation is the
/// safetensors crate's (`Metadata` deserialization checks dtypes, shapes and contiguous
/// offsets); the data must end exactly at the end of the file.
pub(crate) fn parse_header(prefix: &[u8], file_len: usize, path: &str) -> Result<FileIndex> {
    let format = |reason: String| CkptError::Format {
        path: path.to_string(),
        reason,
    };
    let n = header_len(prefix, file_len, path)?;
    let header = prefix
        .get(8..8 + n)
        .ok_or_else(|| format("header is cut short".to_string()))?;
    let text = std::str::from_utf8(header).map_err(|e| format(format!("header: {e}")))?;
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_str(text).map_err(|e| format(format!("header: {e}")))?;
    let data_start = 8 + n;
    if data_start.checked_add(metadata.data_len()) != Some(file_len) {
        return Err(format(format!(
            "header describes {} data bytes but the file holds {}",
            metadata.data_len(),
            file_len - data_start
        )));
    }
    let mut out = FileIndex::default();
    if let Some(meta) = metadata.metadata() {
        if let Some(v) = meta.get(FORMAT_KEY) {
            let found: u64 = v
                .trim()
                .parse()
                .map_err(|_| format(format!("{FORMAT_KEY} {v:?} is not a number")))?;
            if found > u64::from(FORMAT_VERSION) {
                return Err(CkptError::UnsupportedVersion {
                    path: path.to_string(),
                    found,
                    supported: FORMAT_VERSION,
                });
            }
        }
        for (key, json) in meta {
            if key.starts_with("__") {
                continue;
            }
            check_part_name(key).map_err(|e| format(e.to_string()))?;
            let map: BTreeMap<String, Value> = serde_json::from_str(json)
                .map_err(|e| format(format!("metadata of part {key}: {e}")))?;
            out.meta.insert(key.clone(), map);
        }
    }
    for (full, info) in metadata.tensors() {
        let Some((part, name)) = full.split_once('/') else {
            return Err(format(format!(
                "tensor {full:?} is not named <part>/<name>"
            )));
        };
        check_part_name(part).map_err(|e| format(e.to_string()))?;
        check_tensor_name(name).map_err(|e| format(e.to_string()))?;
        let dtype = dtype_from_safetensors(info.dtype).ok_or_else(|| {
            format(format!(
                "tensor {full}: dtype {} is not supported",
                info.dtype
            ))
        })?;
        let (s, e) = info.data_offsets;
        let range = data_start
            .checked_add(s)
            .zip(data_start.checked_add(e))
            .filter(|&(a, b)| a <= b && b <= file_len)
            .map(|(a, b)| a..b)
            .ok_or_else(|| format(format!("tensor {full}: offsets {s}..{e} out of range")))?;
        out.tensors.insert(
            full.clone(),
            IndexedTensor {
                dtype,
                shape: info.shape.clone(),
                range,
            },
        );
    }
    Ok(out)
}

/// [`decode_rank_file`] naming `path` in errors.
pub(crate) fn decode(bytes: &[u8], path: &str) -> Result<RankState> {
    let idx = parse_header(bytes, bytes.len(), path)?;
    let format = |reason: String| CkptError::Format {
        path: path.to_string(),
        reason,
    };
    let mut parts: BTreeMap<String, StateDict> = BTreeMap::new();
    for (part, map) in idx.meta {
        let mut sd = StateDict::new();
        *sd.meta_map_mut() = map;
        parts.insert(part, sd);
    }
    for (full, t) in idx.tensors {
        let Some((part, name)) = full.split_once('/') else {
            continue;
        };
        let data = bytes.get(t.range.clone()).unwrap_or_default();
        let td = TensorData::new(t.dtype, t.shape, data.to_vec())
            .map_err(|e| format(e.named(&full).to_string()))?;
        parts
            .entry(part.to_string())
            .or_default()
            .insert(name, td)
            .map_err(|e| format(e.to_string()))?;
    }
    let mut state = RankState::new();
    for (part, sd) in parts {
        state.insert(&part, sd)?;
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use std::borrow::Cow;

    fn sample() -> RankState {
        let mut m = StateDict::new();
        m.put("w", &[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        m.put("b", &[3], &[f16::from_f32(0.5); 3]).unwrap();
        m.put("layers/0/g", &[2], &[bf16::from_f32(-2.0); 2])
            .unwrap();
        m.set_meta("hidden", 3).unwrap();
        let mut o = StateDict::new();
        o.put("m", &[2], &[0.25f64, -0.125]).unwrap();
        o.put("count", &[], &[5i64]).unwrap();
        o.put("mask", &[4], &[1u8, 0, 1, 1]).unwrap();
        o.put("idx", &[1], &[7u32]).unwrap();
        let mut rng = StateDict::new();
        rng.set_meta("counter", 99u64).unwrap();
        let mut s = RankState::new();
        s.insert("model", m).unwrap();
        s.insert("optim", o).unwrap();
        s.insert("rng", rng).unwrap();
        s
    }

    #[test]
    fn round_trip_is_exact_and_deterministic() {
        let s = sample();
        let a = encode_rank_file(&s).unwrap();
        let b = encode_rank_file(&s.clone()).unwrap();
        assert_eq!(a, b);
        assert_eq!(decode_rank_file(&a).unwrap(), s);
        let n = u64::from_le_bytes(a[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let expected_data: usize = s.nbytes();
        assert_eq!(a.len(), 8 + n + expected_data);
    }

    struct V<'a>(&'a TensorData);
    impl safetensors::View for V<'_> {
        fn dtype(&self) -> safetensors::Dtype {
            to_safetensors(self.0.dtype())
        }
        fn shape(&self) -> &[usize] {
            self.0.shape()
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(self.0.bytes())
        }
        fn data_len(&self) -> usize {
            self.0.bytes().len()
        }
    }

    /// With one metadata key (so the crate's hash-map order cannot differ) our writer gives
    /// exactly the bytes of `safetensors::serialize`.
    #[test]
    fn header_matches_the_safetensors_crate() {
        let s = sample();
        let enc = encode(&s).unwrap();
        let (_, parsed) =
            safetensors::SafeTensors::read_metadata(&encode_rank_file(&s).unwrap()).unwrap();
        let mut infos: Vec<(String, TensorInfo)> = parsed
            .offset_keys()
            .into_iter()
            .map(|k| {
                let i = parsed.info(&k).unwrap().clone();
                (k, i)
            })
            .collect();
        infos.sort_by_key(|(_, i)| i.data_offsets);
        let mut meta = BTreeMap::new();
        meta.insert("only".to_string(), "{\"a\":1}".to_string());
        let mut ours = header_bytes(&meta, &infos).unwrap();
        for d in &enc.data {
            ours.extend_from_slice(d);
        }
        let views: Vec<(String, V<'_>)> = s
            .parts()
            .flat_map(|(p, sd)| sd.iter().map(move |(n, t)| (format!("{p}/{n}"), V(t))))
            .collect();
        let theirs = safetensors::serialize(
            views,
            Some([("only".to_string(), "{\"a\":1}".to_string())].into()),
        )
        .unwrap();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn malformed_inputs_are_errors() {
        let good = encode_rank_file(&sample()).unwrap();
        assert!(safetensors::SafeTensors::read_metadata(&good).is_ok());
        for cut in 0..good.len() {
            let e = decode_rank_file(&good[..cut]).unwrap_err();
            assert!(matches!(e, CkptError::Format { .. }), "cut {cut}: {e}");
            // the safetensors crate's own reader agrees
            assert!(safetensors::SafeTensors::read_metadata(&good[..cut]).is_err());
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(decode_rank_file(&longer).is_err());
        // a newer version
        let mut m = BTreeMap::new();
        m.insert(FORMAT_KEY.to_string(), "2".to_string());
        let bytes = header_bytes(&m, &[]).unwrap();
        assert!(matches!(
            decode_rank_file(&bytes),
            Err(CkptError::UnsupportedVersion {
                found: 2,
                supported: 1,
                ..
            })
        ));
        // a tensor without a part prefix, and an unsupported dtype
        let info = |dtype| TensorInfo {
            dtype,
            shape: vec![1],
            data_offsets: (0, 4),
        };
        for (name, dtype) in [
            ("w", safetensors::Dtype::F32),
            ("p/w", safetensors::Dtype::I32),
        ] {
            let mut b = header_bytes(&BTreeMap::new(), &[(name.to_string(), info(dtype))]).unwrap();
            b.extend_from_slice(&[0; 4]);
            assert!(matches!(
                decode_rank_file(&b),
                Err(CkptError::Format { .. })
            ));
        }
    }
}
