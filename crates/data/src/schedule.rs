//! A schedule of mixture weights by training step, applied to a [`DataLoader`] before each
//! batch: deterministic, and kept across resume because the loader's state holds the weights
//! history it produced.

use crate::error::{DataError, Result};
use crate::loader::DataLoader;
use serde::{Deserialize, Serialize};

/// From training step `step` on (1-based: the first step is 1), draw the sources with these
/// weights (not necessarily normalised; 0 leaves a source out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixturePoint {
    /// The first training step drawn with `weights`.
    pub step: u64,
    /// One weight per source, in the loader's source order.
    pub weights: Vec<f64>,
}

/// Piecewise-constant mixture weights over training steps: the weights of the last point whose
/// step is at most the step being drawn. Empty: the loader keeps its weights.
///
/// ```
/// use kiln_data::{MixturePoint, MixtureSchedule};
/// let s = MixtureSchedule::new(vec![
///     MixturePoint { step: 1, weights: vec![2.0, 1.0] },
///     MixturePoint { step: 100, weights: vec![1.0, 1.0] },
/// ])?;
/// s.validate(2)?;
/// assert_eq!(s.weights_at(99), Some(&[2.0, 1.0][..]));
/// assert_eq!(s.weights_at(100), Some(&[1.0, 1.0][..]));
/// # Ok::<(), kiln_data::DataError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MixtureSchedule {
    /// The points, by increasing step.
    pub points: Vec<MixturePoint>,
}

impl MixtureSchedule {
    /// A schedule of these points (checked for order; see [`MixtureSchedule::validate`] for
    /// the weights).
    pub fn new(points: Vec<MixturePoint>) -> Result<Self> {
        let s = MixtureSchedule { points };
        s.check_order()?;
        Ok(s)
    }

    /// Whether the schedule has no point.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    fn check_order(&self) -> Result<()> {
        if let Some(w) = self.points.windows(2).find(|w| w[1].step <= w[0].step) {
            return Err(DataError::config(
                "mixture schedule",
                format!(
                    "steps must increase: step {} follows step {}",
                    w[1].step, w[0].step
                ),
            ));
        }
        if self.points.first().is_some_and(|p| p.step > 1) {
            return Err(DataError::config(
                "mixture schedule",
                format!(
                    "the first point is at step {}: start at step 1 (or 0) so every step has weights",
                    self.points.first().map_or(0, |p| p.step)
                ),
            ));
        }
        Ok(())
    }

    /// Checks the order and that every point has one finite, non-negative weight per source
    /// with a positive sum; errors name the point.
    pub fn validate(&self, sources: usize) -> Result<()> {
        self.check_order()?;
        for p in &self.points {
            let bad = |why: String| {
                DataError::config(
                    "mixture schedule",
                    format!("point at step {}: {why}", p.step),
                )
            };
            if p.weights.len() != sources {
                return Err(bad(format!(
                    "{} weights for {sources} sources",
                    p.weights.len()
                )));
            }
            if let Some(w) = p.weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
                return Err(bad(format!("weight {w} is not finite and >= 0")));
            }
            if p.weights.iter().sum::<f64>() <= 0.0 {
                return Err(bad("the weights sum to 0".into()));
            }
        }
        Ok(())
    }

    /// The weights in effect at training step `step`, if any point has started.
    pub fn weights_at(&self, step: u64) -> Option<&[f64]> {
        let i = self.points.partition_point(|p| p.step <= step);
        i.checked_sub(1).map(|i| &self.points[i].weights[..])
    }

    /// Sets the loader's weights for training step `step` (call before drawing its batch)
    /// when they differ from those in effect; returns whether they changed.
    pub fn apply(&self, loader: &mut DataLoader, step: u64) -> Result<bool> {
        match self.weights_at(step) {
            Some(w) if loader.weights() != w => {
                loader.set_weights(w)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(step: u64, weights: &[f64]) -> MixturePoint {
        MixturePoint {
            step,
            weights: weights.to_vec(),
        }
    }

    #[test]
    fn lookup_and_errors() {
        let s = MixtureSchedule::new(vec![pt(0, &[1.0, 0.0]), pt(10, &[1.0, 3.0])]).unwrap();
        assert_eq!(s.weights_at(0), Some(&[1.0, 0.0][..]));
        assert_eq!(s.weights_at(9), Some(&[1.0, 0.0][..]));
        assert_eq!(s.weights_at(10), Some(&[1.0, 3.0][..]));
        assert!(s.validate(2).is_ok());
        let e = s.validate(3).unwrap_err().to_string();
        assert!(
            e.contains("point at step 0: 2 weights for 3 sources"),
            "{e}"
        );
        let e = MixtureSchedule::new(vec![pt(1, &[1.0]), pt(1, &[2.0])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("step 1 follows step 1"), "{e}");
        assert!(MixtureSchedule::new(vec![pt(5, &[1.0])]).is_err());
        let neg = MixtureSchedule::new(vec![pt(1, &[1.0, -1.0])]).unwrap();
        assert!(neg.validate(2).unwrap_err().to_string().contains("-1"));
        let zero = MixtureSchedule::new(vec![pt(1, &[0.0, 0.0])]).unwrap();
        assert!(zero
            .validate(2)
            .unwrap_err()
            .to_string()
            .contains("sum to 0"));
        assert_eq!(MixtureSchedule::default().weights_at(3), None);
    }
}
