//! Seeded, order-independent parameter initialisation: every parameter draws from its own
//! random stream keyed by `(seed, name)`.

use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor, Var};
pub use kiln_state::splitmix64;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How to fill a parameter tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// All ones (LayerNorm gains).
    Ones,
    /// Normal with mean 0 and this standard deviation (embeddings).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// Xavier/Glorot uniform for a `[fan_out, fan_in]` matrix:
    /// `U(-b, b)` with `b = gain * sqrt(6 / (fan_in + fan_out))`.
    XavierUniform {
        /// Multiplies the bound; `1 / sqrt(2 * n_layers)` for scaled residual projections.
        gain: f64,
    },
}

/// A ChaCha8 stream keyed by `(seed, key)`: the key's bytes are folded into the seed with
/// [`splitmix64`], then expanded to the 256-bit ChaCha seed. Two different keys give
/// independent streams; the same pair always gives the same stream, whatever was drawn before.
pub fn keyed_rng(seed: u64, key: &str) -> ChaCha8Rng {
    let mut h = splitmix64(seed);
    for chunk in key.as_bytes().chunks(8) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        h = splitmix64(h ^ u64::from_le_bytes(b));
    }
    h = splitmix64(h ^ key.len() as u64);
    let mut bytes = [0u8; 32];
    for (i, w) in bytes.chunks_mut(8).enumerate() {
        w.copy_from_slice(&splitmix64(h.wrapping_add(i as u64)).to_le_bytes());
    }
    ChaCha8Rng::from_seed(bytes)
}

/// A uniform in `(0, 1]` with 53 random bits.
fn unit_open0(rng: &mut ChaCha8Rng) -> f64 {
    ((rng.gen::<u64>() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Creates parameters from `(seed, name)`: the values of a parameter depend only on the seed,
/// its name, its shape and its [`Init`], never on the order of creation.
#[derive(Debug, Clone)]
pub struct Initializer {
    seed: u64,
    device: Device,
    dtype: DType,
}

impl Initializer {
    /// Parameters of `dtype` (f32 or f64; values are drawn in f64 and rounded) on `device`.
    pub fn new(seed: u64, device: &Device, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::F64) {
            return Err(ModelError::Dtype {
                op: "Initializer::new",
                what: "parameter dtype",
                expected: "f32 or f64",
                got: dtype,
            });
        }
        Ok(Self {
            seed,
            device: device.clone(),
            dtype,
        })
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The device parameters are created on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The values of parameter `name` of `shape`, in f64. For [`Init::XavierUniform`] the
    /// shape is `[fan_out, fan_in]` (leading dims multiply into `fan_out`).
    pub fn values(&self, name: &str, shape: &[usize], init: Init) -> Vec<f64> {
        let n: usize = shape.iter().product();
        match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Normal { std } => {
                let mut rng = keyed_rng(self.seed, name);
                let mut out = Vec::with_capacity(n);
                while out.len() < n {
                    // Box-Muller: two normals per pair of uniforms
                    let r = (-2.0 * unit_open0(&mut rng).ln()).sqrt();
                    let theta = 2.0 * std::f64::consts::PI * unit_open0(&mut rng);
                    out.push(std * r * theta.cos());
                    if out.len() < n {
                        out.push(std * r * theta.sin());
                    }
                }
                out
            }
            Init::XavierUniform { gain } => {
                let fan_in = shape.last().copied().unwrap_or(1);
                let fan_out = n / fan_in.max(1);
                let bound = gain * (6.0 / (fan_in + fan_out).max(1) as f64).sqrt();
                let mut rng = keyed_rng(self.seed, name);
                (0..n)
                    .map(|_| (2.0 * unit_open0(&mut rng) - 1.0) * bound)
                    .collect()
            }
        }
    }

    /// A tensor with the values of parameter `name` (not trainable on its own).
    pub fn tensor(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let v = self.values(name, shape, init);
        let t = Tensor::from_vec(v, shape, &self.device)?;
        Ok(if self.dtype == DType::F64 {
            t
        } else {
            t.to_dtype(self.dtype)?
        })
    }

    /// A trainable `Var` with the values of parameter `name`.
    pub fn var(&self, name: &str, shape: &[usize], init: Init) -> Result<Var> {
        Ok(Var::from_tensor(&self.tensor(name, shape, init)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_depend_on_seed_and_name_only() {
        let init = Initializer::new(7, &Device::Cpu, DType::F32).unwrap();
        let a = init.values(
            "h.0.attn.c_attn.weight",
            &[6, 2],
            Init::XavierUniform { gain: 1.0 },
        );
        let _ = init.values("other", &[100], Init::Normal { std: 1.0 });
        let b = init.values(
            "h.0.attn.c_attn.weight",
            &[6, 2],
            Init::XavierUniform { gain: 1.0 },
        );
        assert_eq!(a, b);
        let c = init.values(
            "h.1.attn.c_attn.weight",
            &[6, 2],
            Init::XavierUniform { gain: 1.0 },
        );
        assert_ne!(a, c);
        let other_seed = Initializer::new(8, &Device::Cpu, DType::F32).unwrap();
        assert_ne!(
            a,
            other_seed.values(
                "h.0.attn.c_attn.weight",
                &[6, 2],
                Init::XavierUniform { gain: 1.0 }
            )
        );
    }

    #[test]
    fn xavier_bound_and_normal_moments() {
        let init = Initializer::new(1, &Device::Cpu, DType::F64).unwrap();
        // fan_in 300, fan_out 100: bound sqrt(6 / 400)
        let v = init.values("w", &[100, 300], Init::XavierUniform { gain: 0.5 });
        let bound = 0.5 * (6.0f64 / 400.0).sqrt();
        assert!(v.iter().all(|x| x.abs() <= bound));
        let max = v.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(max > 0.99 * bound, "{max} vs {bound}");
        // uniform variance b^2 / 3 within 3%
        let var = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
        assert!((var / (bound * bound / 3.0) - 1.0).abs() < 0.03, "{var}");

        let v = init.values("e", &[100_000], Init::Normal { std: 0.02 });
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        assert!(mean.abs() < 3.0 * 0.02 / (1e5f64).sqrt(), "{mean}");
        assert!((std / 0.02 - 1.0).abs() < 0.01, "{std}");
        assert_eq!(init.values("z", &[3], Init::Zeros), vec![0.0; 3]);
        assert_eq!(init.values("o", &[2], Init::Ones), vec![1.0; 2]);
    }

    #[test]
    fn splitmix_reference_values() {
        // first outputs of the reference SplitMix64 generator seeded with 0
        // (state advanced by the golden gamma before mixing)
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }
}
