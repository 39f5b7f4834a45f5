//! Helpers of the CUDA tests (`ops.rs`, `attention.rs`): the GPU or why there is none,
//! deterministic inputs, and the comparison with the CPU.

use candle_core::{DType, Device, Tensor};

/// The GPU, or `None` after printing why there is none.
pub fn gpu(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("{test}: skipped, no CUDA device: {e}");
            None
        }
    }
}

/// The tolerance of a dtype: f32 differs from the CPU only in summation order and exp; the
/// half types in where the inputs of the roundings differ by that much.
pub fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        _ => 5e-2,
    }
}

/// Deterministic values in about [-2, 2].
pub fn values(n: usize, salt: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = kiln_state::splitmix64(i as u64 ^ (salt << 32));
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
