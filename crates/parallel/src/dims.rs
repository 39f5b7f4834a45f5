//! `ParallelDims`: the data-parallel x tensor-parallel grid, validated against the world size
//! and the model.

use crate::error::{ParallelError, Result};
use kiln_comm::Communicator;
use kiln_memory::ModelShape;

/// The degrees of parallelism: `dp` data-parallel replicas of a model split over `tp` ranks.
///
/// Ranks are laid out tensor-parallel-major, as in Megatron-LM: global rank
/// `r = dp_rank * tp + tp_rank`, so the ranks of one tensor-parallel group are neighbours.
///
/// ```
/// use kiln_memory::ModelShape;
/// use kiln_parallel::ParallelDims;
/// let shape = ModelShape { n_layers: 2, d_model: 64, n_heads: 4, ctx: 32, vocab: 256 };
/// let dims = ParallelDims::new(2, 2, 4, &shape)?;
/// assert_eq!((dims.dp_rank(3), dims.tp_rank(3)), (1, 1));
/// let err = ParallelDims::new(2, 3, 6, &shape).unwrap_err().to_string();
/// assert!(err.contains("tensor_parallel_degree (3) must divide n_heads (4)"));
/// # Ok::<(), kiln_parallel::ParallelError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParallelDims {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
}

impl ParallelDims {
    /// Validates `dp x tp` against the world size and the model: both at least 1,
    /// `dp * tp == world`, and `tp` divides the heads, the width, the MLP width and the
    /// vocabulary. Every failing factor is printed.
    pub fn new(dp: usize, tp: usize, world: usize, model: &ModelShape) -> Result<Self> {
        let mut problems = Vec::new();
        if dp == 0 {
            problems.push("data_parallel_degree must be at least 1, got 0".to_string());
        }
        if tp == 0 {
            problems.push("tensor_parallel_degree must be at least 1, got 0".to_string());
        }
        if dp * tp != world {
            problems.push(format!(
                "data_parallel_degree ({dp}) x tensor_parallel_degree ({tp}) = {} must equal the world size ({world})",
                dp * tp
            ));
        }
        if tp > 0 {
            let t = tp as u64;
            for (what, v) in [
                ("n_heads", model.n_heads),
                ("d_model", model.d_model),
                ("4 * d_model", 4 * model.d_model),
                ("vocab_size", model.vocab),
            ] {
                if v % t != 0 {
                    problems.push(format!(
                        "tensor_parallel_degree ({tp}) must divide {what} ({v})"
                    ));
                }
            }
        }
        if problems.is_empty() {
            Ok(Self { dp, tp })
        } else {
            Err(ParallelError::Config(problems.join("; ")))
        }
    }

    /// The world size `dp * tp`.
    pub fn world(&self) -> usize {
        self.dp * self.tp
    }

    /// The data-parallel index of global rank `rank`.
    pub fn dp_rank(&self, rank: usize) -> usize {
        rank / self.tp.max(1)
    }

    /// The tensor-parallel index of global rank `rank`.
    pub fn tp_rank(&self, rank: usize) -> usize {
        rank % self.tp.max(1)
    }

    /// Splits the world communicator into this rank's data-parallel group (same `tp_rank`) and
    /// tensor-parallel group (same `dp_rank`). Collective over `world`.
    pub fn build_groups(&self, world: &dyn Communicator) -> Result<Groups> {
        if world.world_size() != self.world() {
            return Err(ParallelError::Config(format!(
                "the communicator has {} ranks but dp ({}) x tp ({}) = {}",
                world.world_size(),
                self.dp,
                self.tp,
                self.world()
            )));
        }
        let r = world.rank();
        let dp = world.split(self.tp_rank(r) as u32, r as u32)?;
        let tp = world.split(self.dp_rank(r) as u32, r as u32)?;
        Ok(Groups { dp, tp })
    }
}

/// This rank's sub-communicators.
pub struct Groups {
    /// The data-parallel group: ranks holding the same tensor-parallel shard.
    pub dp: Box<dyn Communicator>,
    /// The tensor-parallel group: ranks sharing one model replica.
    pub tp: Box<dyn Communicator>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("dp", &(self.dp.rank(), self.dp.world_size()))
            .field("tp", &(self.tp.rank(), self.tp.world_size()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape {
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            ctx: 32,
            vocab: 250,
        }
    }

    #[test]
    fn every_failing_factor_is_named() {
        let e = ParallelDims::new(2, 3, 4, &shape())
            .unwrap_err()
            .to_string();
        assert!(e.contains("data_parallel_degree (2) x tensor_parallel_degree (3) = 6 must equal the world size (4)"), "{e}");
        assert!(e.contains("must divide n_heads (4)"), "{e}");
        assert!(e.contains("must divide d_model (64)"), "{e}");
        assert!(e.contains("must divide vocab_size (250)"), "{e}");
        let e = ParallelDims::new(0, 1, 1, &shape())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("data_parallel_degree must be at least 1, got 0"),
            "{e}"
        );
        let e = ParallelDims::new(1, 0, 1, &shape())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor_parallel_degree must be at least 1, got 0"),
            "{e}"
        );
        assert!(ParallelDims::new(1, 4, 4, &shape())
            .unwrap_err()
            .to_string()
            .contains("vocab_size (250)"));
        assert!(ParallelDims::new(4, 1, 4, &shape()).is_ok());
    }

    #[test]
    fn groups_follow_the_megatron_layout() {
        let s = ModelShape {
            vocab: 256,
            ..shape()
        };
        let out = kiln_testkit::run_ranks(4, |comm| {
            let dims = ParallelDims::new(2, 2, 4, &s)?;
            let g = dims.build_groups(&comm)?;
            use kiln_comm::{CommExt, ReduceOp};
            let tp_sum = g.tp.all_reduce_scalar(comm.rank() as u32, ReduceOp::Sum)?;
            let dp_sum = g.dp.all_reduce_scalar(comm.rank() as u32, ReduceOp::Sum)?;
            Ok((g.dp.rank(), g.tp.rank(), tp_sum, dp_sum))
        });
        assert_eq!(
            out,
            vec![(0, 0, 1, 2), (0, 1, 1, 4), (1, 0, 5, 2), (1, 1, 5, 4)]
        );
    }
}
