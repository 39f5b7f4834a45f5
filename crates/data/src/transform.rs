//! Per-sample augmentation applied on the loader's worker threads, deterministic per sample.

use crate::error::{DataError, Result};
use crate::rng::{stream_rng, Purpose, SampleRng};
use crate::sample::SampleId;
use rand::Rng;

/// One sample as a transform sees it: the model's inputs and its next-token targets
/// (`targets[i]` is the token after `inputs[i]` in the source).
#[derive(Debug)]
pub struct SampleView<'a> {
    /// The sample.
    pub id: SampleId,
    /// Its epoch in its source (a sample is augmented differently each epoch).
    pub epoch: u64,
    /// Input tokens (`ctx` of them).
    pub inputs: &'a mut [u32],
    /// Target tokens (`ctx` of them).
    pub targets: &'a mut [u32],
}

/// A per-sample transform. `apply` must draw all its randomness from `rng`, which the loader
/// keys by (seed, transform index, sample id, epoch): the batches are then the same whatever
/// the number of worker threads, and again after a resume.
pub trait Transform: Send + Sync {
    /// A short name for errors and logs.
    fn name(&self) -> &str;

    /// Changes the sample in place.
    fn apply(&self, sample: &mut SampleView<'_>, rng: &mut SampleRng) -> Result<()>;
}

/// The stream a loader hands to transform `index` of its chain for one sample.
pub fn transform_rng(seed: u64, index: usize, id: SampleId, epoch: u64) -> SampleRng {
    stream_rng(
        seed,
        Purpose::Transform,
        &[index as u64, id.source as u64, id.index, epoch],
    )
}

/// Applies a chain of transforms to one sample, each with its own keyed stream.
pub fn apply_transforms(
    transforms: &[std::sync::Arc<dyn Transform>],
    seed: u64,
    sample: &mut SampleView<'_>,
) -> Result<()> {
    for (i, t) in transforms.iter().enumerate() {
        let mut rng = transform_rng(seed, i, sample.id, sample.epoch);
        t.apply(sample, &mut rng)?;
    }
    Ok(())
}

/// Token dropout for denoising objectives: each input token is replaced by `replacement` (a
/// mask or unknown token) with probability `p`; the targets keep the original tokens, so the
/// model learns to predict the next token from a corrupted context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenDropout {
    p: f64,
    replacement: u32,
}

impl TokenDropout {
    /// Dropout with probability `p` in `[0, 1]`.
    pub fn new(p: f64, replacement: u32) -> Result<Self> {
        if !(0.0..=1.0).contains(&p) {
            return Err(DataError::config(
                "p",
                format!("dropout probability {p} is not in [0, 1]"),
            ));
        }
        Ok(TokenDropout { p, replacement })
    }
}

impl Transform for TokenDropout {
    fn name(&self) -> &str {
        "token_dropout"
    }

    fn apply(&self, sample: &mut SampleView<'_>, rng: &mut SampleRng) -> Result<()> {
        for t in sample.inputs.iter_mut() {
            if rng.gen_bool(self.p) {
                *t = self.replacement;
            }
        }
        Ok(())
    }
}

/// Span masking (T5/BART-style corruption without deletion): spans of input tokens, of
/// geometric length with mean `mean_span`, are replaced by `mask`, so that about `rate` of the
/// inputs are masked; targets are unchanged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpanMask {
    rate: f64,
    mean_span: f64,
    mask: u32,
}

impl SpanMask {
    /// Masks about `rate` (in `[0, 1)`) of the inputs in spans of mean length `mean_span` (>= 1).
    pub fn new(rate: f64, mean_span: f64, mask: u32) -> Result<Self> {
        if !(0.0..1.0).contains(&rate) {
            return Err(DataError::config(
                "rate",
                format!("mask rate {rate} is not in [0, 1)"),
            ));
        }
        if !(mean_span >= 1.0 && mean_span.is_finite()) {
            return Err(DataError::config(
                "mean_span",
                format!("{mean_span} is below 1"),
            ));
        }
        Ok(SpanMask {
            rate,
            mean_span,
            mask,
        })
    }
}

impl Transform for SpanMask {
    fn name(&self) -> &str {
        "span_mask"
    }

    fn apply(&self, sample: &mut SampleView<'_>, rng: &mut SampleRng) -> Result<()> {
        // A two-state chain: outside a span a span starts with probability s, inside it ends
        // with probability 1 / mean_span (spans are geometric with that mean). The stationary
        // masked fraction is s * mean / (1 + s * mean); solving for `rate` gives s below.
        let m = self.mean_span;
        let r = self.rate;
        let start = (r / (m * (1.0 - r))).min(1.0);
        let end = 1.0 / m;
        let mut inside = false;
        for t in sample.inputs.iter_mut() {
            inside = if inside {
                !rng.gen_bool(end)
            } else {
                rng.gen_bool(start)
            };
            if inside {
                *t = self.mask;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn run(t: Arc<dyn Transform>, id: u64, epoch: u64, len: usize) -> (Vec<u32>, Vec<u32>) {
        let mut inputs: Vec<u32> = (1..=len as u32).collect();
        let mut targets: Vec<u32> = (2..=len as u32 + 1).collect();
        let mut s = SampleView {
            id: SampleId::new(0, id),
            epoch,
            inputs: &mut inputs,
            targets: &mut targets,
        };
        apply_transforms(&[t], 9, &mut s).unwrap();
        (inputs, targets)
    }

    #[test]
    fn token_dropout_rate_and_determinism() {
        let t: Arc<dyn Transform> = Arc::new(TokenDropout::new(0.2, 0).unwrap());
        let (a, ta) = run(t.clone(), 5, 0, 20_000);
        let (b, _) = run(t.clone(), 5, 0, 20_000);
        let (c, _) = run(t.clone(), 5, 1, 20_000);
        assert_eq!(a, b, "same sample and epoch: same corruption");
        assert_ne!(a, c, "another epoch: another corruption");
        assert_eq!(ta, (2..=20_001).collect::<Vec<u32>>(), "targets untouched");
        let dropped = a.iter().filter(|&&x| x == 0).count() as f64 / 20_000.0;
        // binomial sd 0.0028; 0.015 is over 5 sd
        assert!((dropped - 0.2).abs() < 0.015, "{dropped}");
        assert!(a
            .iter()
            .enumerate()
            .all(|(i, &x)| x == 0 || x == i as u32 + 1));
        assert!(TokenDropout::new(1.5, 0).is_err());
    }

    #[test]
    fn span_mask_rate_and_span_length() {
        let t: Arc<dyn Transform> = Arc::new(SpanMask::new(0.15, 3.0, 0).unwrap());
        let (a, _) = run(t, 1, 0, 200_000);
        let masked = a.iter().filter(|&&x| x == 0).count();
        let rate = masked as f64 / a.len() as f64;
        let spans =
            a.windows(2).filter(|w| w[0] != 0 && w[1] == 0).count() + usize::from(a[0] == 0);
        let mean = masked as f64 / spans as f64;
        assert!((rate - 0.15).abs() < 0.01, "rate {rate}");
        assert!((mean - 3.0).abs() < 0.15, "mean span {mean}");
        assert!(SpanMask::new(1.0, 3.0, 0).is_err());
        assert!(SpanMask::new(0.1, 0.5, 0).is_err());
    }
}
