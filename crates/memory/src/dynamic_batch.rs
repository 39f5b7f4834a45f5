//! Picks the largest micro-batch that fits a memory budget, and adapts it, keeping the global
//! batch constant through gradient accumulation.

use crate::error::{MemoryError, Result};
use crate::estimate::MemoryPlan;
#[cfg(test)]
use crate::segment::RecomputePolicy;

/// Micro-batch size chosen from a memory estimate.
///
/// The global batch (sequences per optimizer step over the data-parallel group) stays fixed: the
/// micro-batch is always a divisor of the per-rank batch `global / dp`, and
/// [`DynamicBatch::accumulation_steps`] micro-batches make one step. After an out-of-memory
/// report it moves to the next smaller divisor; when told of headroom it moves up if the next
/// larger divisor's estimate fits.
///
/// ```
/// use kiln_memory::{
///     RecomputePolicy, DynamicBatch, MemPrecision, MemoryPlan, ModelShape, ZeroStage,
/// };
/// let plan = MemoryPlan {
///     shape: ModelShape::gpt(4, 256, 4, 128, 8192),
///     precision: MemPrecision::F32, stage: ZeroStage::Replicated,
///     dp: 2, tp: 1, micro_batch: 1, recompute: RecomputePolicy::None, bucket_bytes: 25 << 20,
///     sequence_parallel: false,
/// };
/// let need8 = MemoryPlan { micro_batch: 8, ..plan }.estimate()?.total();
/// let db = DynamicBatch::new(plan, 32, need8)?; // 16 sequences per rank per step
/// assert_eq!(db.micro_batch(), 8);
/// assert_eq!(db.accumulation_steps(), 2);
/// # Ok::<(), kiln_memory::MemoryError>(())
/// ```
#[derive(Debug, Clone)]
pub struct DynamicBatch {
    plan: MemoryPlan,
    per_rank: u64,
    candidates: Vec<u64>,
    current: usize,
    budget: u64,
}

impl DynamicBatch {
    /// Chooses the largest micro-batch (a divisor of `global_batch / plan.dp`) whose estimate fits
    /// `budget_bytes`.
    pub fn new(plan: MemoryPlan, global_batch: u64, budget_bytes: u64) -> Result<Self> {
        plan.validate()?;
        if global_batch == 0 || global_batch % plan.dp != 0 {
            return Err(MemoryError::Config {
                field: "global_batch",
                message: format!(
                    "global batch ({global_batch}) must be a positive multiple of the data-parallel degree ({})",
                    plan.dp
                ),
            });
        }
        let per_rank = global_batch / plan.dp;
        let candidates: Vec<u64> = (1..=per_rank).filter(|d| per_rank % d == 0).collect();
        let mut db = Self {
            plan,
            per_rank,
            candidates,
            current: 0,
            budget: budget_bytes,
        };
        let need1 = db.need(1)?;
        if need1 > budget_bytes {
            return Err(MemoryError::DoesNotFit {
                budget: budget_bytes,
                needed: need1,
            });
        }
        while db.current + 1 < db.candidates.len()
            && db.need(db.candidates[db.current + 1])? <= budget_bytes
        {
            db.current += 1;
        }
        Ok(db)
    }

    fn need(&self, micro_batch: u64) -> Result<u64> {
        Ok(MemoryPlan {
            micro_batch,
            ..self.plan
        }
        .estimate()?
        .total())
    }

    /// The micro-batch size now.
    pub fn micro_batch(&self) -> u64 {
        self.candidates.get(self.current).copied().unwrap_or(1)
    }

    /// Micro-batches per optimizer step on each rank.
    pub fn accumulation_steps(&self) -> u64 {
        self.per_rank / self.micro_batch()
    }

    /// The memory budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// An out-of-memory happened at the current size: step down to the next smaller divisor and
    /// lower the budget to what that size is estimated to need. Fails at micro-batch 1.
    pub fn on_oom(&mut self) -> Result<u64> {
        if self.current == 0 {
            return Err(MemoryError::DoesNotFit {
                budget: self.budget,
                needed: self.need(1)?,
            });
        }
        self.current -= 1;
        self.budget = self.need(self.micro_batch())?;
        Ok(self.micro_batch())
    }

    /// `free_bytes` are unused at the current size: grow while the next larger divisor's extra
    /// need fits in them.
    pub fn on_headroom(&mut self, free_bytes: u64) -> Result<u64> {
        let base = self.need(self.micro_batch())?;
        let limit = base.saturating_add(free_bytes);
        while self.current + 1 < self.candidates.len()
            && self.need(self.candidates[self.current + 1])? <= limit
        {
            self.current += 1;
        }
        self.budget = self.budget.max(self.need(self.micro_batch())?);
        Ok(self.micro_batch())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::{MemPrecision, ModelShape};
    use kiln_state::ZeroStage;

    fn plan() -> MemoryPlan {
        MemoryPlan {
            shape: ModelShape::gpt(4, 256, 4, 128, 8192),
            precision: MemPrecision::F32,
            stage: ZeroStage::Replicated,
            dp: 2,
            tp: 1,
            micro_batch: 1,
            recompute: RecomputePolicy::None,
            bucket_bytes: 25 << 20,
            sequence_parallel: false,
        }
    }

    fn need(b: u64) -> u64 {
        MemoryPlan {
            micro_batch: b,
            ..plan()
        }
        .estimate()
        .unwrap()
        .total()
    }

    #[test]
    fn picks_the_largest_divisor_that_fits_and_keeps_the_global_batch() {
        // per rank 24: divisors 1 2 3 4 6 8 12 24
        let db = DynamicBatch::new(plan(), 48, need(7)).unwrap();
        assert_eq!(db.micro_batch(), 6);
        assert_eq!(db.micro_batch() * db.accumulation_steps() * 2, 48);
        let db = DynamicBatch::new(plan(), 48, u64::MAX).unwrap();
        assert_eq!(db.micro_batch(), 24);
        assert_eq!(db.accumulation_steps(), 1);
    }

    #[test]
    fn adapts_on_oom_and_headroom() {
        let mut db = DynamicBatch::new(plan(), 48, need(12)).unwrap();
        assert_eq!(db.micro_batch(), 12);
        assert_eq!(db.on_oom().unwrap(), 8);
        assert_eq!(db.accumulation_steps(), 3);
        assert_eq!(db.on_oom().unwrap(), 6);
        assert_eq!(db.on_headroom(need(12) - need(6)).unwrap(), 12);
        assert_eq!(db.on_headroom(0).unwrap(), 12);
        for _ in 0..7 {
            let _ = db.on_oom();
        }
        assert_eq!(db.micro_batch(), 1);
        assert!(matches!(db.on_oom(), Err(MemoryError::DoesNotFit { .. })));
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(matches!(
            DynamicBatch::new(plan(), 47, u64::MAX),
            Err(MemoryError::Config {
                field: "global_batch",
                ..
            })
        ));
        assert!(matches!(
            DynamicBatch::new(plan(), 48, 1000),
            Err(MemoryError::DoesNotFit { .. })
        ));
    }
}
