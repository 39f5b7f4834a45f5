//! Every way a checkpoint can be wrong gives a typed error naming what is wrong, never a
//! panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{sample_state, values, TempDir};
use kiln_ckpt::{
    decode_rank_file, CheckpointConfig, Checkpointer, CkptError, Layout, LoadOptions, Manifest,
    RankState, StateDict, Storage,
};
use kiln_testkit::run_ranks;
use sha2::{Digest, Sha256};
use std::sync::Arc;

fn cfg() -> CheckpointConfig {
    CheckpointConfig::new(Layout::single(), "m")
}

fn saved(tag: &str, state: &RankState) -> (TempDir, Arc<dyn Storage>) {
    let dir = TempDir::new(tag);
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(1, |comm| {
        Checkpointer::new(Arc::clone(&storage), cfg())?.save(&comm, 1, state)?;
        Ok(())
    });
    (dir, storage)
}

fn load_err(storage: &Arc<dyn Storage>) -> CkptError {
    run_ranks(1, |comm| {
        Ok(Checkpointer::new(Arc::clone(storage), cfg())?
            .load_step(&comm, 1)
            .unwrap_err())
    })
    .remove(0)
}

fn big_state() -> RankState {
    let mut s = sample_state(0, 1);
    s.part_mut("model")
        .unwrap()
        .put("big", &[4000], &values(5, 4000))
        .unwrap();
    s
}

#[test]
fn truncation_at_every_header_offset_and_through_the_data() {
    let state = big_state();
    let (dir, storage) = saved("trunc", &state);
    let file = dir.path("step-00000001/rank-00000.safetensors");
    let good = std::fs::read(&file).unwrap();
    let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let cuts: Vec<usize> = (0..=header_end)
        .chain((header_end..good.len()).step_by(97))
        .chain([good.len() - 1])
        .collect();
    assert!(header_end >= 512, "header of {header_end} bytes");
    let ck = Checkpointer::new(Arc::clone(&storage), cfg()).unwrap();
    run_ranks(1, |comm| {
        for &cut in &cuts {
            std::fs::write(&file, &good[..cut]).unwrap();
            // through the checkpointer: the size check names the file
            match ck.load_step(&comm, 1) {
                Err(CkptError::SizeMismatch {
                    path,
                    expected,
                    got,
                }) => {
                    assert_eq!(path, "step-00000001/rank-00000.safetensors");
                    assert_eq!((expected, got), (good.len() as u64, cut as u64));
                }
                other => panic!("cut {cut}: {other:?}"),
            }
            // the parser alone: a format error
            assert!(
                matches!(
                    decode_rank_file(&good[..cut]),
                    Err(CkptError::Format { .. })
                ),
                "cut {cut}"
            );
        }
        std::fs::write(&file, &good).unwrap();
        assert_eq!(ck.load_step(&comm, 1)?.state, state);
        Ok(())
    });
}

#[test]
fn flipped_bits_are_checksum_errors_naming_the_file() {
    let (dir, storage) = saved("flip", &big_state());
    let file = dir.path("step-00000001/rank-00000.safetensors");
    let good = std::fs::read(&file).unwrap();
    for at in [0, 9, good.len() / 2, good.len() - 1] {
        let mut bad = good.clone();
        bad[at] ^= 0x04;
        std::fs::write(&file, &bad).unwrap();
        let e = load_err(&storage);
        assert!(
            matches!(&e, CkptError::Checksum { path, .. } if path == "step-00000001/rank-00000.safetensors"),
            "{e}"
        );
        assert!(e.to_string().starts_with(
            "checksum mismatch in step-00000001/rank-00000.safetensors: manifest says sha256 "
        ));
    }
    std::fs::write(&file, &good).unwrap();
    // a flipped bit in the manifest is caught by manifest.sha256
    let mpath = dir.path("step-00000001/manifest.json");
    let mut m = std::fs::read(&mpath).unwrap();
    let i = m.iter().position(|&b| b == b'"').unwrap() + 1;
    m[i] ^= 0x01;
    std::fs::write(&mpath, &m).unwrap();
    let e = load_err(&storage);
    assert!(
        matches!(&e, CkptError::Checksum { path, .. } if path == "step-00000001/manifest.json"),
        "{e}"
    );
}

#[test]
fn missing_files_are_named() {
    for victim in ["rank-00000.safetensors", "manifest.json", "manifest.sha256"] {
        let (dir, storage) = saved("missing", &sample_state(0, 1));
        std::fs::remove_file(dir.path(&format!("step-00000001/{victim}"))).unwrap();
        let e = load_err(&storage);
        assert_eq!(e.to_string(), format!("missing step-00000001/{victim}"));
        assert!(e.is_corruption());
    }
}

fn rewrite_manifest(dir: &TempDir, edit: impl FnOnce(&mut serde_json::Value)) {
    let mpath = dir.path("step-00000001/manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    edit(&mut v);
    let bytes = serde_json::to_vec_pretty(&v).unwrap();
    std::fs::write(&mpath, &bytes).unwrap();
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::write(
        dir.path("step-00000001/manifest.sha256"),
        format!("{sha}\n"),
    )
    .unwrap();
}

#[test]
fn a_newer_format_version_stops_the_load() {
    let (dir, storage) = saved("version", &sample_state(0, 1));
    rewrite_manifest(&dir, |v| v["version"] = serde_json::Value::from(7));
    let e = load_err(&storage);
    assert_eq!(
        e.to_string(),
        "step-00000001/manifest.json: format version 7 is newer than the supported version 1"
    );
    // load_latest does not fall back past it: that would silently lose progress
    let e = run_ranks(1, |comm| {
        Ok(Checkpointer::new(Arc::clone(&storage), cfg())?
            .load_latest(&comm)
            .unwrap_err())
    });
    assert!(matches!(
        e[0],
        CkptError::UnsupportedVersion {
            found: 7,
            supported: 1,
            ..
        }
    ));
}

#[test]
fn a_manifest_that_disagrees_with_its_file_is_an_error() {
    let (dir, storage) = saved("disagree", &sample_state(0, 1));
    rewrite_manifest(&dir, |v| {
        v["files"][0]["tensors"]["model/w"]["shape"] = serde_json::json!([5, 3]);
    });
    let e = load_err(&storage);
    assert_eq!(
        e.to_string(),
        "step-00000001/rank-00000.safetensors: invalid manifest: model/w is f32 [3, 5] in the file but f32 [5, 3] in the manifest"
    );
}

#[test]
fn a_checkpoint_of_another_model_names_tensor_and_shapes() {
    let (_dir, storage) = saved("othermodel", &sample_state(0, 1));
    let out = run_ranks(1, |comm| {
        let loaded = Checkpointer::new(Arc::clone(&storage), cfg())?.load_step(&comm, 1)?;
        // a target model whose w is [5, 3] instead of [3, 5]
        let mut target = loaded.state.part("model").unwrap().clone();
        target.put("w", &[5, 3], &[0.0f32; 15])?;
        let e = loaded
            .state
            .clone()
            .restore("model", &mut target, LoadOptions::default())
            .unwrap_err();
        // strict keys: a target without `h`, and one with an extra tensor
        let mut fewer = loaded.state.part("model").unwrap().clone();
        fewer.remove("h");
        let unexpected = loaded
            .state
            .clone()
            .restore("model", &mut fewer, LoadOptions::default())
            .unwrap_err();
        let mut more = loaded.state.part("model").unwrap().clone();
        more.put("extra", &[1], &[0.0f32])?;
        let missing = loaded
            .state
            .clone()
            .restore("model", &mut more, LoadOptions::default())
            .unwrap_err();
        let lenient = loaded
            .state
            .clone()
            .restore("model", &mut more, LoadOptions::lenient())?;
        assert_eq!(lenient.missing, ["extra"]);
        Ok((e.to_string(), unexpected.to_string(), missing.to_string()))
    });
    let (shape, unexpected, missing) = &out[0];
    assert_eq!(shape, "tensor model/w: expected shape [5, 3], got [3, 5]");
    assert_eq!(
        unexpected,
        "part model: checkpoint has unexpected tensors [\"h\"]"
    );
    assert_eq!(missing, "part model: checkpoint lacks tensors [\"extra\"]");
}

#[test]
fn wrong_dtype_on_restore_is_named() {
    let mut s = RankState::new();
    let mut m = StateDict::new();
    m.put("w", &[2], &[1.0f32, 2.0]).unwrap();
    s.insert("model", m).unwrap();
    let mut target = StateDict::new();
    target.put("w", &[2], &[half::f16::ZERO; 2]).unwrap();
    let e = s
        .restore("model", &mut target, LoadOptions::lenient())
        .unwrap_err();
    assert_eq!(e.to_string(), "tensor model/w: expected dtype f16, got f32");
}

#[test]
fn manifest_parser_rejects_garbage_without_panicking() {
    let good = {
        let (dir, _s) = saved("garbage", &sample_state(0, 1));
        std::fs::read(dir.path("step-00000001/manifest.json")).unwrap()
    };
    assert!(Manifest::from_json(&good).is_ok());
    for cut in 0..good.trim_ascii_end().len() {
        let r = Manifest::from_json(&good[..cut]);
        assert!(
            matches!(r, Err(CkptError::Manifest { .. })),
            "cut {cut}: {r:?}"
        );
    }
}
