//! Helpers of the CUDA tests (`cuda_ops.rs`, `cuda_attention.rs`): the GPU or why there is
//! none, deterministic inputs, and the comparison with the CPU.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor};
use kiln_model::DeviceSpec;

/// The GPU, or `None` after printing why there is none.
pub fn gpu(test: &str) -> Option<Device> {
    match DeviceSpec::Cuda(0).device() {
        Ok(d) => Some(d),
        Err(e) => {
            println!("{test}: skipped, no CUDA device: {e}");
            None
        }
    }
}

/// Deterministic values in about [-2, 2].
pub fn values(n: usize, salt: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = kiln_model::splitmix64(i as u64 ^ (salt << 32));
            (h >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

pub fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Largest `|a - b| / (atol + |b|)`.
pub fn worst(a: &[f32], b: &[f32], atol: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x - y).abs() / (atol + y.abs());
            if d.is_nan() {
                f32::INFINITY
            } else {
                d
            }
        })
        .fold(0.0, f32::max)
}
