//! Python's `safetensors` package reads kiln's rank files: every tensor's dtype, shape and
//! bits, and every part's metadata, match what was saved; Python's hashlib agrees with the
//! manifest's sha256. Skips (with the reason printed) where `python3`, `safetensors` or `numpy`
//! is missing, except under `CI=true`, where `.ci/run` installs them and their absence fails;
//! any other failure of the Python side fails the test with its stderr.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{sample_state, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{CheckpointConfig, Checkpointer, DType, Layout, Storage};
use kiln_comm::Communicator;
use kiln_testkit::{run_ranks, Python};
use serde_json::Value;
use std::sync::Arc;

const SCRIPT: &str = r#"
import hashlib, json, struct, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

root = sys.argv[1]
man_bytes = open(f"{root}/manifest.json", "rb").read()
assert hashlib.sha256(man_bytes).hexdigest() == open(f"{root}/manifest.sha256").read().strip()
man = json.loads(man_bytes)
out = {}
bits = {"float32": np.uint32, "float16": np.uint16, "float64": np.uint64}
for f in man["files"]:
    path = f"{root}/{f['path']}"
    raw = open(path, "rb").read()
    assert hashlib.sha256(raw).hexdigest() == f["sha256"], path
    assert len(raw) == f["size"], path
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    tensors = {}
    # numpy has no bfloat16: read those from the header by hand, the rest with load_file
    plain = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] == "BF16":
            s, e = info["data_offsets"]
            u = np.frombuffer(raw[8 + n + s:8 + n + e], dtype="<u2").reshape(info["shape"])
            vals = (u.astype(np.uint32) << 16).view(np.float32)
            tensors[name] = {"dtype": "bf16", "shape": list(u.shape),
                             "bits": u.reshape(-1).tolist(), "sum": float(vals.astype(np.float64).sum())}
        else:
            plain[name] = True
    with safe_open(path, framework="numpy") as st:
        meta = st.metadata()
        if len(plain) == len(header) - 1:
            arrays = None
        else:
            arrays = {k: st.get_tensor(k) for k in plain}
    if arrays is None:
        arrays = load_file(path)
    for name, a in arrays.items():
        d = str(a.dtype)
        if d in bits:
            b = a.view(bits[d]).reshape(-1).tolist()
            s = float(a.astype(np.float64).sum())
        else:
            b = a.reshape(-1).tolist()
            s = float(a.astype(np.float64).sum())
        tensors[name] = {"dtype": d, "shape": list(a.shape), "bits": b, "sum": s}
    out[f["path"]] = {"tensors": tensors, "meta": meta, "load_file": len(plain) == len(header) - 1}
print(json.dumps(out))
"#;

/// Rank 0's state has no bf16 tensor, so Python reads its file with `load_file`; rank 1's
/// has one, read by hand from the header (numpy has no bfloat16).
fn state(rank: usize) -> kiln_ckpt::RankState {
    let mut s = sample_state(rank, 7);
    if rank == 0 {
        s.part_mut("model").unwrap().remove("layers/0/b").unwrap();
    }
    s
}

/// The Python modules both tests import.
const MODULES: [&str; 2] = ["safetensors", "numpy"];

#[test]
fn python_safetensors_reads_our_files() {
    let Some(python) = Python::require("python_safetensors_reads_our_files", &MODULES) else {
        return;
    };
    let dir = TempDir::new("python");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let cfg = CheckpointConfig::new(Layout::new(2, 1, ZeroStage::Replicated).unwrap(), "py");
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg)?;
        ck.save(&comm, 7, &state(comm.rank()))?;
        Ok(())
    });
    let out = python.run(
        "the safetensors reader",
        ["-c", SCRIPT, dir.path("step-00000007").to_str().unwrap()],
    );
    let got: Value = serde_json::from_str(&out).unwrap();

    for rank in 0..2 {
        let file = &got[format!("rank-{rank:05}.safetensors")];
        let state = state(rank);
        assert_eq!(file["load_file"], rank == 0);
        let mut count = 0;
        for (part, sd) in state.parts() {
            // metadata: a JSON string per part
            let meta: Value = serde_json::from_str(file["meta"][part].as_str().unwrap()).unwrap();
            assert_eq!(meta, serde_json::to_value(sd.meta_map()).unwrap(), "{part}");
            for (name, t) in sd.iter() {
                count += 1;
                let py = &file["tensors"][format!("{part}/{name}")];
                let shape: Vec<usize> = serde_json::from_value(py["shape"].clone()).unwrap();
                assert_eq!(shape, t.shape(), "{part}/{name}");
                let bits: Vec<u64> = serde_json::from_value(py["bits"].clone()).unwrap();
                let (dtype, expected_bits, sum): (&str, Vec<u64>, f64) = match t.dtype() {
                    DType::F32 => {
                        let v = t.to_vec::<f32>().unwrap();
                        (
                            "float32",
                            v.iter().map(|x| x.to_bits() as u64).collect(),
                            v.iter().map(|&x| x as f64).sum(),
                        )
                    }
                    DType::F16 => {
                        let v = t.to_vec::<half::f16>().unwrap();
                        (
                            "float16",
                            v.iter().map(|x| x.to_bits() as u64).collect(),
                            v.iter().map(|x| x.to_f64()).sum(),
                        )
                    }
                    DType::BF16 => {
                        let v = t.to_vec::<half::bf16>().unwrap();
                        (
                            "bf16",
                            v.iter().map(|x| x.to_bits() as u64).collect(),
                            v.iter().map(|x| x.to_f64()).sum(),
                        )
                    }
                    DType::F64 => {
                        let v = t.to_vec::<f64>().unwrap();
                        (
                            "float64",
                            v.iter().map(|x| x.to_bits()).collect(),
                            v.iter().sum(),
                        )
                    }
                    DType::I64 => {
                        let v = t.to_vec::<i64>().unwrap();
                        (
                            "int64",
                            v.iter().map(|&x| x as u64).collect(),
                            v.iter().map(|&x| x as f64).sum(),
                        )
                    }
                    DType::U32 => {
                        let v = t.to_vec::<u32>().unwrap();
                        (
                            "uint32",
                            v.iter().map(|&x| x as u64).collect(),
                            v.iter().map(|&x| x as f64).sum(),
                        )
                    }
                    DType::U8 => {
                        let v = t.to_vec::<u8>().unwrap();
                        (
                            "uint8",
                            v.iter().map(|&x| x as u64).collect(),
                            v.iter().map(|&x| x as f64).sum(),
                        )
                    }
                };
                assert_eq!(py["dtype"], dtype, "{part}/{name}");
                assert_eq!(bits, expected_bits, "{part}/{name}");
                let py_sum = py["sum"].as_f64().unwrap();
                assert!(
                    (py_sum - sum).abs() <= 1e-9 * (1.0 + sum.abs()),
                    "{part}/{name}: python sum {py_sum} vs {sum}"
                );
            }
        }
        assert_eq!(file["tensors"].as_object().unwrap().len(), count);
    }
}

/// The other direction: a file written by Python's `safetensors.numpy.save_file` (with
/// kiln's naming and metadata conventions) decodes to the values Python wrote.
#[test]
fn we_read_files_python_wrote() {
    let Some(python) = Python::require("we_read_files_python_wrote", &MODULES) else {
        return;
    };
    let dir = TempDir::new("python-writes");
    let path = dir.path("py.safetensors");
    let script = r#"
import json, sys
import numpy as np
from safetensors.numpy import save_file
t = {
    "model/w": (np.arange(6, dtype=np.float32) * 0.5 - 1.0).reshape(2, 3),
    "model/layers/0/h": np.array([0.25, -3.0], dtype=np.float16),
    "optim/m": np.array([1e-300, -2.5], dtype=np.float64),
    "optim/t": np.array(12345678901234, dtype=np.int64),
    "optim/ids": np.array([4294967295, 0], dtype=np.uint32),
    "optim/mask": np.array([0, 1, 255], dtype=np.uint8),
}
save_file(t, sys.argv[1], metadata={"__kiln_format__": "1", "model": json.dumps({"d": 3}), "rng": json.dumps({"counter": 9})})
"#;
    python.run(
        "safetensors.numpy.save_file",
        ["-c", script, path.to_str().unwrap()],
    );
    let state = kiln_ckpt::decode_rank_file(&std::fs::read(&path).unwrap()).unwrap();
    let model = state.part("model").unwrap();
    assert_eq!(
        model.get_shaped::<f32>("w", &[2, 3]).unwrap(),
        [-1.0, -0.5, 0.0, 0.5, 1.0, 1.5]
    );
    assert_eq!(
        model.get::<half::f16>("layers/0/h").unwrap(),
        [half::f16::from_f32(0.25), half::f16::from_f32(-3.0)]
    );
    assert_eq!(model.meta::<u32>("d").unwrap(), 3);
    let optim = state.part("optim").unwrap();
    assert_eq!(optim.get::<f64>("m").unwrap(), [1e-300, -2.5]);
    assert_eq!(
        optim.get_shaped::<i64>("t", &[]).unwrap(),
        [12_345_678_901_234]
    );
    assert_eq!(optim.get::<u32>("ids").unwrap(), [u32::MAX, 0]);
    assert_eq!(optim.get::<u8>("mask").unwrap(), [0, 1, 255]);
    assert_eq!(
        state.part("rng").unwrap().meta::<u64>("counter").unwrap(),
        9
    );
    assert_eq!(state.part("rng").unwrap().len(), 0);
}
