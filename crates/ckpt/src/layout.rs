//! The world layout a checkpoint was saved with.

use crate::error::{CkptError, Result};
use kiln_state::ZeroStage;
use serde::{Deserialize, Serialize};
use std::fmt;

/// How the ranks of a run are arranged: `pp` pipeline stages, each of `dp` data-parallel
/// replicas times `tp` tensor-parallel ranks, with ZeRO stage `zero_stage` (written as its
/// number in the manifest, 0 = plain data parallel).
///
/// The world size is `dp * tp * pp`; a rank's file is named by its global rank (tp fastest,
/// then dp, then pp). Each stage's files hold its own parameters (the tied embedding in the
/// first and the last stage's); a load finds every tensor by name wherever it was saved, so a
/// checkpoint reshards to another `pp` as to another `dp` or `tp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// The ZeRO stage.
    pub zero_stage: ZeroStage,
    /// Pipeline stages (1, and left out of the manifest, without a pipeline).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pp: usize,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Layout {
    /// A validated layout: `dp` and `tp` at least 1.
    pub fn new(dp: usize, tp: usize, zero_stage: ZeroStage) -> Result<Self> {
        let l = Layout {
            dp,
            tp,
            zero_stage,
            pp: 1,
        };
        l.validate()?;
        Ok(l)
    }

    /// The same layout over `pp` pipeline stages (validated).
    pub fn with_pp(mut self, pp: usize) -> Result<Self> {
        self.pp = pp;
        self.validate()?;
        Ok(self)
    }

    /// One rank, no sharding.
    pub fn single() -> Self {
        Layout {
            dp: 1,
            tp: 1,
            zero_stage: ZeroStage::Replicated,
            pp: 1,
        }
    }

    /// Checks the degrees.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.pp == 0 {
            return Err(CkptError::Config(format!(
                "dp ({}), tp ({}) and pp ({}) must be at least 1",
                self.dp, self.tp, self.pp
            )));
        }
        if self
            .dp
            .checked_mul(self.tp)
            .and_then(|x| x.checked_mul(self.pp))
            .is_none()
        {
            return Err(CkptError::Config(format!(
                "dp ({}) * tp ({}) * pp ({}) overflows",
                self.dp, self.tp, self.pp
            )));
        }
        Ok(())
    }

    /// Number of ranks, `dp * tp * pp`.
    pub fn world(&self) -> usize {
        self.dp.saturating_mul(self.tp).saturating_mul(self.pp)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp={} tp={} zero={}",
            self.dp,
            self.tp,
            self.zero_stage.number()
        )?;
        if self.pp > 1 {
            write!(f, " pp={}", self.pp)?;
        }
        Ok(())
    }
}
