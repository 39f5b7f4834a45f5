//! Helpers the kiln-tune tests share.
#![allow(dead_code, clippy::unwrap_used)]

use candle_core::{DType, Device, Tensor};

/// A tensor's values as f32, flat.
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `b` rows of `t` deterministic token ids below `vocab` and their next tokens.
pub fn batch(b: usize, t: usize, vocab: usize, salt: usize) -> (Tensor, Tensor) {
    let tok = |i: usize| ((i * 2654435761 + salt * 7919) >> 7) % vocab;
    let x: Vec<u32> = (0..b * t).map(|i| tok(i) as u32).collect();
    let y: Vec<u32> = (0..b * t).map(|i| tok(i + 1) as u32).collect();
    (
        Tensor::from_vec(x, (b, t), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (b, t), &Device::Cpu).unwrap(),
    )
}

/// Python's `safetensors` (with numpy) reads `path`: runs `script` (which prints JSON) on it
/// and returns the parsed output, or `None` with a message where `python3` or one of the
/// modules is missing (a failure under `CI=true`, which installs them). Any other failure of
/// the script fails the test with its stderr.
pub fn python_json<T: serde::de::DeserializeOwned>(
    script: &str,
    path: &std::path::Path,
) -> Option<T> {
    let python = kiln_testkit::Python::require(
        "Python's safetensors reading a kiln file",
        &["safetensors.numpy", "numpy"],
    )?;
    let out = python.run(
        "the safetensors reader",
        [
            std::ffi::OsStr::new("-c"),
            std::ffi::OsStr::new(script),
            path.as_os_str(),
        ],
    );
    Some(serde_json::from_str(&out).unwrap())
}
