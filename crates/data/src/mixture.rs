//! A weighted mixture of sources whose weights can change while training.

use crate::error::{DataError, Result};
use crate::rng::{stream_rng, Purpose};
use crate::sample::SkipSet;
use crate::sampler::{next_carry, Cursor, PlannedSample};
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// Weights are kept as integers summing to about 2^32, so a draw is exact integer arithmetic
/// and a restored state (which stores these integers) draws bitwise the same.
const WEIGHT_SCALE: f64 = 4_294_967_296.0;

/// A change of the mixture weights, in effect from global step `step` on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightChange {
    /// The first step drawn with these weights.
    pub step: u64,
    /// The weights as given (not normalised).
    pub weights: Vec<f64>,
    /// The weights as the draw uses them: integers in units of 2^-32 of the total.
    pub quantized: Vec<u64>,
}

fn quantize(weights: &[f64], sources: usize) -> Result<Vec<u64>> {
    if weights.len() != sources {
        return Err(DataError::config(
            "weights",
            format!("{} weights for {sources} sources", weights.len()),
        ));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !w.is_finite() || **w < 0.0)
    {
        return Err(DataError::config(
            "weights",
            format!("weight {i} is {w}: weights must be finite and >= 0"),
        ));
    }
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 || !sum.is_finite() {
        return Err(DataError::config(
            "weights",
            format!("weights {weights:?} sum to {sum}"),
        ));
    }
    Ok(weights
        .iter()
        .map(|&w| {
            if w == 0.0 {
                0
            } else {
                ((w / sum * WEIGHT_SCALE).round() as u64).max(1)
            }
        })
        .collect())
}

/// Several sources drawn with weights: each sample slot of a global batch picks a source at
/// random (probabilities proportional to the weights in effect at that step), then takes that
/// source's next sample in its own epoch order (a fresh permutation per source epoch, the end of
/// one epoch running into the next). Every sample of a source is seen exactly once per source
/// epoch across all ranks.
///
/// The draw of step `s` uses a ChaCha8 stream keyed by (seed, step), so the sequence of batches
/// is a pure function of (seed, weights history, skip set); the state to save is the step, the
/// per-source cursors and the history ([`Mixture::history`]). Weights set with
/// [`Mixture::set_weights`] apply from the next step drawn, for example from per-source losses.
#[derive(Debug, Clone)]
pub struct Mixture {
    seed: u64,
    sizes: Vec<u64>,
    cursors: Vec<Cursor>,
    step: u64,
    history: Vec<WeightChange>,
}

impl Mixture {
    /// A mixture of sources with `sizes` samples each, at step 0.
    pub fn new(sizes: Vec<u64>, weights: &[f64], seed: u64) -> Result<Self> {
        if let Some(i) = sizes.iter().position(|&n| n == 0) {
            return Err(DataError::Exhausted {
                source_index: i,
                samples: 0,
                available: 0,
                needed: 1,
            });
        }
        let quantized = quantize(weights, sizes.len())?;
        Ok(Mixture {
            seed,
            cursors: vec![Cursor::default(); sizes.len()],
            sizes,
            step: 0,
            history: vec![WeightChange {
                step: 0,
                weights: weights.to_vec(),
                quantized,
            }],
        })
    }

    /// Rebuilds a mixture from saved parts (see [`crate::LoaderState`]).
    pub fn from_parts(
        sizes: Vec<u64>,
        seed: u64,
        step: u64,
        cursors: Vec<Cursor>,
        history: Vec<WeightChange>,
    ) -> Result<Self> {
        if cursors.len() != sizes.len() {
            return Err(DataError::StateMismatch {
                field: "sources",
                saved: cursors.len().to_string(),
                current: sizes.len().to_string(),
            });
        }
        let Some(first) = history.first() else {
            return Err(DataError::config("weights history", "empty"));
        };
        let mut m = Mixture::new(sizes, &first.weights, seed)?;
        for h in &history {
            let q = quantize(&h.weights, m.sizes.len())?;
            if h.quantized.len() != q.len() || h.quantized.iter().all(|&x| x == 0) {
                return Err(DataError::config(
                    "weights history",
                    format!("step {}: bad quantized weights {:?}", h.step, h.quantized),
                ));
            }
        }
        m.step = step;
        m.cursors = cursors;
        m.history = history;
        Ok(m)
    }

    /// Number of sources.
    pub fn num_sources(&self) -> usize {
        self.sizes.len()
    }

    /// The next step to draw.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Per-source positions.
    pub fn cursors(&self) -> &[Cursor] {
        &self.cursors
    }

    /// Every weight change so far, the first at step 0.
    pub fn history(&self) -> &[WeightChange] {
        &self.history
    }

    /// The weights in effect now (as given).
    pub fn weights(&self) -> &[f64] {
        self.current().map_or(&[], |h| &h.weights[..])
    }

    fn current(&self) -> Option<&WeightChange> {
        self.history.last()
    }

    /// Sets new weights from the next step on (replacing a change made at the same step).
    pub fn set_weights(&mut self, weights: &[f64]) -> Result<()> {
        let quantized = quantize(weights, self.sizes.len())?;
        let change = WeightChange {
            step: self.step,
            weights: weights.to_vec(),
            quantized,
        };
        match self.history.last_mut() {
            Some(last) if last.step == self.step => *last = change,
            _ => self.history.push(change),
        }
        Ok(())
    }

    /// The quantized weights in effect at `step`.
    fn weights_at(&self, step: u64) -> &[u64] {
        let i = self.history.partition_point(|h| h.step <= step);
        self.history
            .get(i.saturating_sub(1))
            .map_or(&[], |h| &h.quantized[..])
    }

    /// The sources of the `slots` samples of step `step`: a pure function of (seed, step, the
    /// weights in effect at that step).
    pub fn draw_sources(&self, step: u64, slots: usize) -> Vec<u32> {
        let q = self.weights_at(step);
        let total: u64 = q.iter().sum();
        let mut rng = stream_rng(self.seed, Purpose::Mixture, &[step]);
        (0..slots)
            .map(|_| {
                // multiply-shift maps a uniform u64 onto 0..total (bias below 2^-32)
                let r = ((rng.next_u64() as u128 * total as u128) >> 64) as u64;
                let mut acc = 0u64;
                let mut pick = 0usize;
                for (i, &w) in q.iter().enumerate() {
                    acc += w;
                    if r < acc {
                        pick = i;
                        break;
                    }
                }
                pick as u32
            })
            .collect()
    }

    /// Draws the `slots` samples of the next global batch and advances the step.
    pub fn next_global_batch(
        &mut self,
        slots: usize,
        skip: &SkipSet,
    ) -> Result<Vec<PlannedSample>> {
        let sources = self.draw_sources(self.step, slots);
        let mut cursors = self.cursors.clone();
        let samples = sources
            .iter()
            .map(|&s| {
                let i = s as usize;
                next_carry(&mut cursors[i], self.sizes[i], self.seed, s, skip)
            })
            .collect::<Result<Vec<_>>>()?;
        self.cursors = cursors;
        self.step += 1;
        Ok(samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn same_seed_and_history_draw_the_same() {
        let run = |seed: u64| {
            let mut m = Mixture::new(vec![100, 37, 5], &[1.0, 2.0, 0.5], seed).unwrap();
            let mut out = Vec::new();
            for step in 0..40 {
                if step == 13 {
                    m.set_weights(&[0.1, 0.0, 3.0]).unwrap();
                }
                out.push(m.next_global_batch(16, &SkipSet::new()).unwrap());
            }
            (out, m.history().to_vec())
        };
        let (a, ha) = run(7);
        let (b, hb) = run(7);
        let (c, _) = run(8);
        assert_eq!(a, b);
        assert_eq!(ha, hb);
        assert_ne!(a, c);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[1].step, 13);
        // the zero-weight source is never drawn after the change
        assert!(a[13..].iter().flatten().all(|p| p.id.source != 1));
    }

    #[test]
    fn weight_change_takes_effect_in_empirical_frequencies() {
        let mut m = Mixture::new(vec![1000, 1000, 1000], &[1.0, 1.0, 2.0], 3).unwrap();
        let skip = SkipSet::new();
        let freq = |m: &mut Mixture, steps: usize| {
            let mut c = [0f64; 3];
            for _ in 0..steps {
                for p in m.next_global_batch(64, &skip).unwrap() {
                    c[p.id.source as usize] += 1.0;
                }
            }
            let n = (steps * 64) as f64;
            c.map(|x| x / n)
        };
        // 12800 draws: binomial standard deviation below 0.0045, tolerance 0.02 is > 4 sigma
        let before = freq(&mut m, 200);
        for (f, want) in before.iter().zip([0.25, 0.25, 0.5]) {
            assert!((f - want).abs() < 0.02, "{before:?}");
        }
        m.set_weights(&[8.0, 1.0, 1.0]).unwrap();
        let after = freq(&mut m, 200);
        for (f, want) in after.iter().zip([0.8, 0.1, 0.1]) {
            assert!((f - want).abs() < 0.02, "{after:?}");
        }
    }

    #[test]
    fn each_source_covers_its_samples_once_per_source_epoch() {
        let sizes = vec![30u64, 7];
        let mut m = Mixture::new(sizes.clone(), &[1.0, 1.0], 11).unwrap();
        let mut skip = SkipSet::new();
        skip.insert(crate::SampleId::new(0, 4));
        let mut per: HashMap<(u32, u64), Vec<u64>> = HashMap::new();
        for _ in 0..50 {
            for p in m.next_global_batch(6, &skip).unwrap() {
                per.entry((p.id.source, p.epoch))
                    .or_default()
                    .push(p.id.index);
            }
        }
        for ((src, epoch), mut v) in per {
            let n = sizes[src as usize];
            v.sort_unstable();
            let len = v.len();
            v.dedup();
            assert_eq!(v.len(), len, "source {src} epoch {epoch} repeats a sample");
            assert!(!(src == 0 && v.contains(&4)), "skipped sample drawn");
            // completed epochs hold every (non-skipped) sample
            if epoch < m.cursors()[src as usize].epoch {
                assert_eq!(v.len() as u64, n - u64::from(src == 0));
            }
        }
    }

    #[test]
    fn bad_weights_are_errors() {
        assert!(Mixture::new(vec![5, 5], &[1.0], 0).is_err());
        assert!(Mixture::new(vec![5, 5], &[1.0, -1.0], 0).is_err());
        assert!(Mixture::new(vec![5, 5], &[0.0, 0.0], 0).is_err());
        assert!(Mixture::new(vec![5, 5], &[f64::NAN, 1.0], 0).is_err());
        assert!(Mixture::new(vec![5, 0], &[1.0, 1.0], 0).is_err());
        let mut m = Mixture::new(vec![5, 5], &[1.0, 1.0], 0).unwrap();
        assert!(m.set_weights(&[1.0, f64::INFINITY]).is_err());
        assert_eq!(m.weights(), &[1.0, 1.0]);
    }
}
