//! The world layout a checkpoint was saved with.

use crate::error::{CkptError, Result};
use kiln_state::ZeroStage;
use serde::{Deserialize, Serialize};
use std::fmt;

/// How the ranks of a run are arranged: `dp` data-parallel replicas times `tp`
/// tensor-parallel ranks, with ZeRO stage `zero_stage` (written as its number in the
/// manifest, 0 = plain data parallel).
///
/// The world size is `dp * tp`; a rank's file is named by its global rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// The ZeRO stage.
    pub zero_stage: ZeroStage,
}

impl Layout {
    /// A validated layout: `dp` and `tp` at least 1.
    pub fn new(dp: usize, tp: usize, zero_stage: ZeroStage) -> Result<Self> {
        let l = Layout { dp, tp, zero_stage };
        l.validate()?;
        Ok(l)
    }

    /// One rank, no sharding.
    pub fn single() -> Self {
        Layout {
            dp: 1,
            tp: 1,
            zero_stage: ZeroStage::Replicated,
        }
    }

    /// Checks the degrees.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 {
            return Err(CkptError::Config(format!(
                "dp ({}) and tp ({}) must be at least 1",
                self.dp, self.tp
            )));
        }
        if self.dp.checked_mul(self.tp).is_none() {
            return Err(CkptError::Config(format!(
                "dp ({}) * tp ({}) overflows",
                self.dp, self.tp
            )));
        }
        Ok(())
    }

    /// Number of ranks, `dp * tp`.
    pub fn world(&self) -> usize {
        self.dp.saturating_mul(self.tp)
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
        )
    }
}
