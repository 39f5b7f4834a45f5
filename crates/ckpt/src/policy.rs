//! When to save ([`SavePolicy`]) and which committed checkpoints to keep ([`Retention`]).

use crate::error::{CkptError, Result};
use std::collections::BTreeSet;
use std::time::Duration;

/// When a checkpoint is due: every `every_steps` steps, every `every` of wall time, or
/// both (whichever comes first). With neither set, never.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SavePolicy {
    /// Save at every step that is a positive multiple of this.
    pub every_steps: Option<u64>,
    /// Save once this much wall time has passed since the last save (or since the
    /// checkpointer was created).
    pub every: Option<Duration>,
}

impl SavePolicy {
    /// Save every `n` steps.
    pub fn every_steps(n: u64) -> Self {
        SavePolicy {
            every_steps: Some(n),
            every: None,
        }
    }

    /// Save every `d` of wall time (the "every 30 minutes" policy).
    pub fn every_duration(d: Duration) -> Self {
        SavePolicy {
            every_steps: None,
            every: Some(d),
        }
    }

    /// Adds a wall-time interval to a step policy.
    pub fn and_every(mut self, d: Duration) -> Self {
        self.every = Some(d);
        self
    }

    /// Rejects zero intervals.
    pub fn validate(&self) -> Result<()> {
        if self.every_steps == Some(0) {
            return Err(CkptError::Config("every_steps must be at least 1".into()));
        }
        if self.every == Some(Duration::ZERO) {
            return Err(CkptError::Config(
                "the save interval must be positive".into(),
            ));
        }
        Ok(())
    }

    /// True when a save is due at `step` with `since_last_save` elapsed since the last one.
    pub fn due(&self, step: u64, since_last_save: Duration) -> bool {
        let by_step = self
            .every_steps
            .is_some_and(|n| n > 0 && step > 0 && step % n == 0);
        let by_time = self.every.is_some_and(|d| since_last_save >= d);
        by_step || by_time
    }
}

/// Which committed checkpoints survive a new commit: the newest `keep_last`, every one whose
/// step is a multiple of `keep_every`, and always the one just committed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// Keep this many newest checkpoints (`None`: keep all).
    pub keep_last: Option<usize>,
    /// Also keep every checkpoint whose step is a multiple of this.
    pub keep_every: Option<u64>,
}

impl Retention {
    /// Keep everything.
    pub fn keep_all() -> Self {
        Retention::default()
    }

    /// Keep the newest `k`.
    pub fn keep_last(k: usize) -> Self {
        Retention {
            keep_last: Some(k),
            keep_every: None,
        }
    }

    /// Also keep multiples of `m`.
    pub fn and_every(mut self, m: u64) -> Self {
        self.keep_every = Some(m);
        self
    }

    /// Rejects `keep_last == 0` (it would delete the latest good checkpoint) and
    /// `keep_every == 0`.
    pub fn validate(&self) -> Result<()> {
        if self.keep_last == Some(0) {
            return Err(CkptError::Config(
                "keep_last must be at least 1: the latest checkpoint is always kept".into(),
            ));
        }
        if self.keep_every == Some(0) {
            return Err(CkptError::Config("keep_every must be at least 1".into()));
        }
        Ok(())
    }

    /// The steps of `committed` to delete after committing `just_committed` (which is never
    /// deleted), in increasing order.
    pub fn to_delete(&self, committed: &[u64], just_committed: u64) -> Vec<u64> {
        let Some(k) = self.keep_last else {
            return Vec::new();
        };
        let sorted: BTreeSet<u64> = committed.iter().copied().collect();
        let newest: BTreeSet<u64> = sorted.iter().rev().take(k.max(1)).copied().collect();
        sorted
            .into_iter()
            .filter(|&s| {
                s != just_committed
                    && !newest.contains(&s)
                    && !self.keep_every.is_some_and(|m| m > 0 && s % m == 0)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_and_time_policies() {
        let p = SavePolicy::every_steps(5);
        let due: Vec<u64> = (0..=20).filter(|&s| p.due(s, Duration::ZERO)).collect();
        assert_eq!(due, [5, 10, 15, 20]);

        let t = SavePolicy::every_duration(Duration::from_secs(1800));
        assert!(!t.due(3, Duration::from_secs(1799)));
        assert!(t.due(3, Duration::from_secs(1800)));

        let both = SavePolicy::every_steps(100).and_every(Duration::from_secs(60));
        assert!(both.due(100, Duration::ZERO));
        assert!(both.due(7, Duration::from_secs(61)));
        assert!(!both.due(7, Duration::from_secs(59)));
        assert!(!SavePolicy::default().due(100, Duration::from_secs(1 << 40)));
        assert!(SavePolicy::every_steps(0).validate().is_err());
        assert!(SavePolicy::every_duration(Duration::ZERO)
            .validate()
            .is_err());
    }

    /// Reference: simulate saving every 5 steps up to 100 and apply retention after each
    /// commit, then compare with the closed form (last K plus multiples of M).
    #[test]
    fn retention_keeps_last_k_and_every_m() {
        for k in 1..5 {
            for m in [None, Some(20u64), Some(15)] {
                let r = Retention {
                    keep_last: Some(k),
                    keep_every: m,
                };
                r.validate().unwrap();
                let mut dirs: Vec<u64> = Vec::new();
                for step in (5..=100).step_by(5) {
                    dirs.push(step);
                    let del = r.to_delete(&dirs, step);
                    assert!(!del.contains(&step));
                    dirs.retain(|s| !del.contains(s));
                }
                let all: Vec<u64> = (5..=100).step_by(5).collect();
                let expected: Vec<u64> = all
                    .iter()
                    .copied()
                    .filter(|&s| s > 100 - 5 * k as u64 || m.is_some_and(|m| s % m == 0))
                    .collect();
                assert_eq!(dirs, expected, "k {k} m {m:?}");
            }
        }
        assert!(Retention::keep_all().to_delete(&[1, 2, 3], 3).is_empty());
        assert!(Retention::keep_last(0).validate().is_err());
        // the just-committed step survives even when it is not among the newest
        assert_eq!(Retention::keep_last(1).to_delete(&[5, 10, 20], 10), [5]);
    }
}
