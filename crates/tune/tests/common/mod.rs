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

/// Python's `safetensors` reads `path`: runs `script` (which prints JSON) on it and returns
/// the parsed output, or `None` with a message where python3 or the module is missing
/// (a failure under `CI=true`, which installs them).
pub fn python_json<T: serde::de::DeserializeOwned>(
    script: &str,
    path: &std::path::Path,
) -> Option<T> {
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(path)
        .output();
    match out {
        Ok(o) if o.status.success() => Some(serde_json::from_slice(&o.stdout).unwrap()),
        other => {
            let why = match other {
                Ok(o) => String::from_utf8_lossy(&o.stderr).to_string(),
                Err(e) => e.to_string(),
            };
            assert!(
                std::env::var("CI").ok().as_deref() != Some("true"),
                "python3 with safetensors is required under CI: {why}"
            );
            println!("skipped: python3 with safetensors is not installed ({why})");
            None
        }
    }
}
