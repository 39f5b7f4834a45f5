//! Text generation: greedy and temperature / top-k sampling, deterministic for a seed.

use crate::error::{ModelError, Result};
use crate::init::keyed_rng;
use crate::model::Gpt;
use candle_core::{DType, Tensor};
use rand::Rng;

/// How [`generate`] picks the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among ties).
    Greedy,
    /// Sample from the `k` most likely tokens, with logits divided by `temperature`.
    TopK {
        /// How many candidates (capped at the vocabulary size); at least 1.
        k: usize,
        /// Softmax temperature; finite and > 0.
        temperature: f64,
    },
}

/// Continues `prompt` by `max_new` tokens and returns the whole sequence (prompt first).
/// The model sees at most its last `n_ctx` tokens. The result depends only on the model,
/// the prompt, the sampling and `seed`.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    max_new: usize,
    sampling: Sampling,
    seed: u64,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(ModelError::EmptyPrompt);
    }
    if let Sampling::TopK { k, temperature } = sampling {
        if k == 0 {
            return Err(ModelError::InvalidValue {
                field: "k",
                value: 0.0,
                expected: ">= 1",
            });
        }
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(ModelError::InvalidValue {
                field: "temperature",
                value: temperature,
                expected: "finite and > 0",
            });
        }
    }
    let n_ctx = model.config().n_ctx;
    let device = model.options().device.clone();
    let mut rng = keyed_rng(seed, "generate");
    let mut seq = prompt.to_vec();
    for _ in 0..max_new {
        let start = seq.len().saturating_sub(n_ctx);
        let ctx = &seq[start..];
        let tokens = Tensor::new(ctx, &device)?.unsqueeze(0)?;
        let logits = model.forward(&tokens)?;
        let last = logits
            .get(0)?
            .get(ctx.len() - 1)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let next = match sampling {
            Sampling::Greedy => argmax(&last),
            Sampling::TopK { k, temperature } => {
                sample_top_k(&last, k, temperature, rng.gen::<f64>())
            }
        };
        seq.push(next);
    }
    Ok(seq)
}

/// Index of the largest value, lowest index among ties; NaN never wins.
fn argmax(v: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] || v[best].is_nan() && !x.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Samples among the `k` largest logits (ties broken by lower id) with `u` uniform in [0, 1).
fn sample_top_k(logits: &[f64], k: usize, temperature: f64, u: f64) -> u32 {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let key = |i: usize| {
        if logits[i].is_nan() {
            f64::NEG_INFINITY
        } else {
            logits[i]
        }
    };
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k.min(logits.len()));
    let max = key(idx[0]);
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| ((key(i) - max) / temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut target = u * total;
    for (&i, &wi) in idx.iter().zip(&w) {
        if target < wi {
            return i as u32;
        }
        target -= wi;
    }
    idx[idx.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_distribution_matches_softmax() {
        let logits = [0.0, 2.0, 1.0, -5.0, 2.0];
        // k = 3 keeps ids 1, 4 (tie, lower id first) and 2; temperature 2
        let w = [1.0f64, 1.0, (-0.5f64).exp()];
        let total: f64 = w.iter().sum();
        let n = 20_000;
        let mut counts = [0usize; 5];
        for i in 0..n {
            let u = (i as f64 + 0.5) / n as f64;
            counts[sample_top_k(&logits, 3, 2.0, u) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[3], 0);
        for (id, wi) in [(1usize, w[0]), (4, w[1]), (2, w[2])] {
            let p = counts[id] as f64 / n as f64;
            assert!(
                (p - wi / total).abs() < 1e-3,
                "id {id}: {p} vs {}",
                wi / total
            );
        }
        assert_eq!(argmax(&logits), 1);
        assert_eq!(sample_top_k(&logits, 1, 1.0, 0.999), 1);
    }
}
