//! Distribution-shift detection: the KL divergence between the token distribution of recent
//! batches and a reference distribution.

use crate::error::{DataError, Result};
use std::collections::VecDeque;

/// `KL(p || q) = sum p_i ln(p_i / q_i)` in nats, with `0 ln 0 = 0`; infinite where `p_i > 0 = q_i`.
/// Both are normalised first, so counts may be passed directly.
pub fn kl_divergence(p: &[f64], q: &[f64]) -> f64 {
    let sp: f64 = p.iter().sum();
    let sq: f64 = q.iter().sum();
    p.iter()
        .zip(q)
        .filter(|(&pi, _)| pi > 0.0)
        .map(|(&pi, &qi)| {
            let (pi, qi) = (pi / sp, qi / sq);
            if qi <= 0.0 {
                f64::INFINITY
            } else {
                pi * (pi / qi).ln()
            }
        })
        .sum()
}

/// What [`DriftMonitor::observe`] reports after each batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriftReport {
    /// KL(window || reference) in nats.
    pub kl: f64,
    /// Tokens in the window.
    pub window_tokens: u64,
    /// Whether the window is full and `kl` is above the threshold.
    pub alert: bool,
}

/// Watches the unigram token distribution of the last `window` batches and reports its KL
/// divergence from a reference distribution (the training corpus as prepared, say).
///
/// The reference is smoothed with add-`alpha` counts so every token has some probability; the
/// window's distribution is the plain frequency (KL(window || reference) is finite and needs no
/// smoothing of the window). The plug-in estimate is biased upward by about
/// `(distinct tokens in the window - 1) / (2 · window tokens)` nats, so windows of the same
/// source sit slightly above zero: set the threshold from held-out data of the reference source
/// ([`DriftMonitor::calibrate`]). An alert is raised only once the window is full.
#[derive(Debug, Clone)]
pub struct DriftMonitor {
    reference: Vec<f64>,
    window: usize,
    threshold: f64,
    batches: VecDeque<Vec<u32>>,
    counts: Vec<u64>,
    total: u64,
}

impl DriftMonitor {
    /// A monitor against the distribution of `reference_tokens` over `vocab` ids, smoothed by
    /// `alpha` (> 0) pseudo-counts, looking at the last `window` batches.
    pub fn new(
        reference_tokens: &[u32],
        vocab: usize,
        alpha: f64,
        window: usize,
        threshold: f64,
    ) -> Result<Self> {
        let mut counts = vec![0u64; vocab];
        for &t in reference_tokens {
            let Some(c) = counts.get_mut(t as usize) else {
                return Err(DataError::OutOfRange {
                    what: "reference token",
                    index: t as u64,
                    len: vocab as u64,
                });
            };
            *c += 1;
        }
        Self::from_counts(&counts, alpha, window, threshold)
    }

    /// A monitor against reference token counts (index = token id).
    pub fn from_counts(counts: &[u64], alpha: f64, window: usize, threshold: f64) -> Result<Self> {
        if counts.is_empty() {
            return Err(DataError::config("vocab", "0 tokens"));
        }
        if !(alpha > 0.0 && alpha.is_finite()) {
            return Err(DataError::config(
                "alpha",
                format!("{alpha} must be finite and > 0"),
            ));
        }
        if window == 0 {
            return Err(DataError::config("window", "0 batches"));
        }
        let total: f64 =
            counts.iter().map(|&c| c as f64).sum::<f64>() + alpha * counts.len() as f64;
        let reference = counts.iter().map(|&c| (c as f64 + alpha) / total).collect();
        Ok(DriftMonitor {
            reference,
            window,
            threshold,
            batches: VecDeque::with_capacity(window),
            counts: vec![0; counts.len()],
            total: 0,
        })
    }

    /// The reference distribution (sums to one).
    pub fn reference(&self) -> &[f64] {
        &self.reference
    }

    /// The alert threshold in nats.
    pub fn threshold(&self) -> f64 {
        self.threshold
    }

    /// Sets the alert threshold.
    pub fn set_threshold(&mut self, threshold: f64) {
        self.threshold = threshold;
    }

    /// Adds a batch's tokens (ids outside the vocabulary are an error and leave the window
    /// unchanged) and reports the divergence of the window.
    pub fn observe(&mut self, tokens: &[u32]) -> Result<DriftReport> {
        let v = self.counts.len();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(DataError::OutOfRange {
                what: "token",
                index: bad as u64,
                len: v as u64,
            });
        }
        if self.batches.len() == self.window {
            if let Some(old) = self.batches.pop_front() {
                for &t in &old {
                    self.counts[t as usize] -= 1;
                }
                self.total -= old.len() as u64;
            }
        }
        for &t in tokens {
            self.counts[t as usize] += 1;
        }
        self.total += tokens.len() as u64;
        self.batches.push_back(tokens.to_vec());
        let kl = self.kl();
        Ok(DriftReport {
            kl,
            window_tokens: self.total,
            alert: self.batches.len() == self.window && kl > self.threshold,
        })
    }

    /// KL(window || reference) in nats (0 for an empty window).
    pub fn kl(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let n = self.total as f64;
        self.counts
            .iter()
            .zip(&self.reference)
            .filter(|(&c, _)| c > 0)
            .map(|(&c, &q)| {
                let p = c as f64 / n;
                p * (p / q).ln()
            })
            .sum()
    }

    /// Whether the window is full and its divergence is above the threshold (what the last
    /// [`DriftMonitor::observe`] reported as `alert`).
    pub fn alerting(&self) -> bool {
        self.batches.len() == self.window && self.kl() > self.threshold
    }

    /// Batches the window holds (at most its size).
    pub fn window_len(&self) -> usize {
        self.batches.len()
    }

    /// Empties the window.
    pub fn reset(&mut self) {
        self.batches.clear();
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.total = 0;
    }

    /// Sets the threshold to `margin` times the largest KL seen over full windows of
    /// `held_out` batches from the reference source, and returns it; the window is emptied
    /// after.
    pub fn calibrate<'a>(
        &mut self,
        held_out: impl IntoIterator<Item = &'a [u32]>,
        margin: f64,
    ) -> Result<f64> {
        self.reset();
        let mut worst: Option<f64> = None;
        for b in held_out {
            self.observe(b)?;
            if self.batches.len() == self.window {
                let kl = self.kl();
                worst = Some(worst.map_or(kl, |w: f64| w.max(kl)));
            }
        }
        self.reset();
        let worst = worst.ok_or_else(|| {
            DataError::config(
                "held_out",
                format!("fewer batches than one window of {}", self.window),
            )
        })?;
        self.threshold = worst * margin;
        Ok(self.threshold)
    }
}

/// The monitor as a kiln-state component: the token ids of the batches in its window (tensor
/// `window_tokens`, u32) and their lengths, window size and threshold (metadata `drift`). The
/// reference distribution is not saved: it is rebuilt from the corpus the run is configured
/// with, and loading checks that every saved token is inside its vocabulary.
impl kiln_state::Stateful for DriftMonitor {
    fn state(&self) -> kiln_state::Result<kiln_state::StateDict> {
        let mut sd = kiln_state::StateDict::new();
        let lens: Vec<usize> = self.batches.iter().map(Vec::len).collect();
        let tokens: Vec<u32> = self.batches.iter().flatten().copied().collect();
        sd.set_meta(
            "drift",
            DriftMeta {
                window: self.window,
                threshold: self.threshold,
                lens,
            },
        )?;
        sd.put("window_tokens", &[tokens.len()], &tokens)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: kiln_state::StateDict) -> kiln_state::Result<()> {
        let meta: DriftMeta = state.meta("drift")?;
        let tokens: Vec<u32> = state.get("window_tokens")?;
        let bad = |reason: String| kiln_state::StateError::component("drift monitor", reason);
        if meta.lens.iter().sum::<usize>() != tokens.len() {
            return Err(bad(format!(
                "window lengths sum to {} but {} tokens were saved",
                meta.lens.iter().sum::<usize>(),
                tokens.len()
            )));
        }
        if meta.lens.len() > meta.window || meta.window != self.window {
            return Err(bad(format!(
                "saved window of {} batches (holding {}), this monitor's is {}",
                meta.window,
                meta.lens.len(),
                self.window
            )));
        }
        let vocab = self.counts.len();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad(format!(
                "saved token {t} is outside the vocabulary of {vocab}"
            )));
        }
        self.reset();
        self.threshold = meta.threshold;
        let mut at = 0;
        for n in meta.lens {
            let batch = tokens[at..at + n].to_vec();
            at += n;
            for &t in &batch {
                self.counts[t as usize] += 1;
            }
            self.total += batch.len() as u64;
            self.batches.push_back(batch);
        }
        Ok(())
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct DriftMeta {
    window: usize,
    threshold: f64,
    lens: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_closed_forms() {
        // two Bernoulli distributions: p ln(p/q) + (1-p) ln((1-p)/(1-q))
        let (p, q) = (0.3f64, 0.6f64);
        let want = p * (p / q).ln() + (1.0 - p) * ((1.0 - p) / (1.0 - q)).ln();
        assert!((kl_divergence(&[p, 1.0 - p], &[q, 1.0 - q]) - want).abs() < 1e-15);
        // counts are normalised; identical distributions give 0; support mismatch gives inf
        assert!((kl_divergence(&[3.0, 7.0], &[6.0, 4.0]) - want).abs() < 1e-15);
        assert_eq!(kl_divergence(&[1.0, 2.0], &[2.0, 4.0]), 0.0);
        assert_eq!(kl_divergence(&[1.0, 1.0], &[1.0, 0.0]), f64::INFINITY);
        assert_eq!(kl_divergence(&[0.0, 1.0], &[1.0, 1.0]), 2f64.ln());
    }

    #[test]
    fn window_slides_and_matches_a_direct_kl() {
        let reference: Vec<u32> = (0..100).map(|i| i % 4).collect();
        let mut m = DriftMonitor::new(&reference, 5, 0.5, 2, 0.1).unwrap();
        // smoothed reference: (25 + 0.5) / 102.5 for 0..4, 0.5 / 102.5 for 4
        assert!((m.reference()[4] - 0.5 / 102.5).abs() < 1e-15);
        let batches: [&[u32]; 3] = [&[0, 1, 2, 3], &[0, 0, 0, 0], &[4, 4, 0, 1]];
        let r0 = m.observe(batches[0]).unwrap();
        assert!(!r0.alert, "window not full yet");
        let r1 = m.observe(batches[1]).unwrap();
        let r2 = m.observe(batches[2]).unwrap();
        // window = batches 1 and 2: counts [5, 1, 0, 0, 2]
        let want = kl_divergence(&[5.0, 1.0, 0.0, 0.0, 2.0], m.reference());
        assert!((r2.kl - want).abs() < 1e-12, "{} vs {want}", r2.kl);
        assert_eq!(r2.window_tokens, 8);
        let want1 = kl_divergence(&[5.0, 1.0, 1.0, 1.0, 0.0], m.reference());
        assert!((r1.kl - want1).abs() < 1e-12);
        assert!(r1.alert && r2.alert);
        assert!(m.observe(&[7]).is_err());
        assert_eq!(
            m.kl(),
            r2.kl,
            "a rejected batch leaves the window as it was"
        );
    }

    #[test]
    fn state_round_trip_continues_identically() {
        use kiln_state::Stateful;
        let reference: Vec<u32> = (0..200).map(|i| (i * 7) % 11).collect();
        let mut a = DriftMonitor::new(&reference, 11, 0.5, 3, 0.2).unwrap();
        for b in [&[1u32, 2, 3][..], &[4, 4], &[5, 6, 7, 8], &[9]] {
            a.observe(b).unwrap();
        }
        let sd = a.state().unwrap();
        let mut b = DriftMonitor::new(&reference, 11, 0.5, 3, 0.9).unwrap();
        b.load_state(sd.clone()).unwrap();
        assert_eq!(b.threshold(), 0.2);
        for batch in [&[10u32, 10][..], &[0, 1]] {
            assert_eq!(a.observe(batch).unwrap(), b.observe(batch).unwrap());
        }
        // another window size or a token outside the vocabulary is refused
        let mut c = DriftMonitor::new(&reference, 11, 0.5, 4, 0.2).unwrap();
        assert!(c.load_state(sd.clone()).is_err());
        let small: Vec<u32> = (0..10).map(|i| i % 5).collect();
        let mut d = DriftMonitor::new(&small, 5, 0.5, 3, 0.2).unwrap();
        let err = d.load_state(sd).unwrap_err().to_string();
        assert!(err.contains("outside the vocabulary of 5"), "{err}");
    }
}
