//! `ParallelDims`: the data-parallel x tensor-parallel x pipeline-parallel grid, validated
//! against the world size and the model, and the groups it splits the world into.

use crate::error::{ParallelError, Result};
use kiln_comm::Communicator;
use kiln_memory::ModelShape;

fn one() -> usize {
    1
}

/// The degrees of parallelism: `pp` pipeline stages, each held by `dp` data-parallel replicas of
/// the stage split over `tp` ranks.
///
/// Ranks are laid out as in Megatron-LM, tensor-parallel fastest, then data-parallel, then
/// pipeline: global rank `r = (pp_rank * dp + dp_rank) * tp + tp_rank`. The ranks of one
/// tensor-parallel group are neighbours, and with `pp == 1` the layout is the dp x tp grid.
///
/// ```
/// use kiln_memory::ModelShape;
/// use kiln_parallel::ParallelDims;
/// let shape = ModelShape::gpt(2, 64, 4, 32, 256);
/// let dims = ParallelDims::new(2, 2, 4, &shape)?;
/// assert_eq!((dims.dp_rank(3), dims.tp_rank(3)), (1, 1));
/// let dims = ParallelDims::with_pipeline(2, 2, 2, 8, &shape)?;
/// assert_eq!((dims.pp_rank(5), dims.dp_rank(5), dims.tp_rank(5)), (1, 0, 1));
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
    /// Pipeline-parallel degree (stages).
    #[serde(default = "one")]
    pub pp: usize,
}

impl ParallelDims {
    /// Validates `dp x tp` (one pipeline stage) against the world size and the model: both at
    /// least 1, `dp * tp == world`, `tp` divides the heads, the width, the MLP width and the
    /// vocabulary, and divides the key/value heads or is a multiple of them (kiln-model then
    /// replicates them). Every failing factor is printed.
    pub fn new(dp: usize, tp: usize, world: usize, model: &ModelShape) -> Result<Self> {
        Self::with_pipeline(dp, tp, 1, world, model)
    }

    /// Validates `dp x tp x pp` against the world size and the model: every degree at least 1,
    /// `dp * tp * pp == world`, `tp` divides the heads, the width, the MLP width and the
    /// vocabulary and divides the key/value heads or is a multiple of them, and the model has
    /// at least one block per stage. Every failing factor is printed.
    pub fn with_pipeline(
        dp: usize,
        tp: usize,
        pp: usize,
        world: usize,
        model: &ModelShape,
    ) -> Result<Self> {
        let mut problems = Vec::new();
        for (what, v) in [
            ("data_parallel_degree", dp),
            ("tensor_parallel_degree", tp),
            ("pipeline_parallel_degree", pp),
        ] {
            if v == 0 {
                problems.push(format!("{what} must be at least 1, got 0"));
            }
        }
        if dp * tp * pp != world {
            if pp == 1 {
                problems.push(format!(
                    "data_parallel_degree ({dp}) x tensor_parallel_degree ({tp}) = {} must equal the world size ({world})",
                    dp * tp
                ));
            } else {
                problems.push(format!(
                    "data_parallel_degree ({dp}) x tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp}) = {} must equal the world size ({world})",
                    dp * tp * pp
                ));
            }
        }
        if tp > 0 {
            let t = tp as u64;
            let mlp = match model.ffn_hidden_size {
                Some(_) => "ffn_hidden_size",
                None => "4 * d_model",
            };
            for (what, v) in [
                ("n_heads", model.n_heads),
                ("d_model", model.d_model),
                (mlp, model.d_ff()),
                ("vocab_size", model.vocab),
            ] {
                if v % t != 0 {
                    problems.push(format!(
                        "tensor_parallel_degree ({tp}) must divide {what} ({v})"
                    ));
                }
            }
            // kiln-model splits the key/value heads or replicates them (kv_replicated)
            let kv = model.kv_heads();
            if kv != model.n_heads && kv % t != 0 && t % kv.max(1) != 0 {
                problems.push(format!(
                    "tensor_parallel_degree ({tp}) must divide n_kv_heads ({kv}) or be a \
                     multiple of it (each key/value head replicated over tp / n_kv_heads ranks)"
                ));
            }
        }
        if pp as u64 > model.n_layers.max(1) {
            problems.push(format!(
                "pipeline_parallel_degree ({pp}) must not exceed n_layers ({}): every stage holds at least one block",
                model.n_layers
            ));
        }
        if problems.is_empty() {
            Ok(Self { dp, tp, pp })
        } else {
            Err(ParallelError::Config(problems.join("; ")))
        }
    }

    /// The world size `dp * tp * pp`.
    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp.max(1)
    }

    /// The ranks of one pipeline stage, `dp * tp`.
    pub fn stage_world(&self) -> usize {
        self.dp * self.tp
    }

    /// The data-parallel index of global rank `rank`.
    pub fn dp_rank(&self, rank: usize) -> usize {
        (rank / self.tp.max(1)) % self.dp.max(1)
    }

    /// The tensor-parallel index of global rank `rank`.
    pub fn tp_rank(&self, rank: usize) -> usize {
        rank % self.tp.max(1)
    }

    /// The pipeline stage of global rank `rank`.
    pub fn pp_rank(&self, rank: usize) -> usize {
        rank / self.stage_world().max(1)
    }

    /// The global rank at (`pp_rank`, `dp_rank`, `tp_rank`).
    pub fn rank_of(&self, pp_rank: usize, dp_rank: usize, tp_rank: usize) -> usize {
        (pp_rank * self.dp + dp_rank) * self.tp + tp_rank
    }

    /// Splits the world communicator into this rank's data-parallel group (same stage and
    /// `tp_rank`), tensor-parallel group (same stage and `dp_rank`), pipeline group (same
    /// `dp_rank` and `tp_rank`, ordered by stage) and, for the first and the last stage, the
    /// embedding group that sums the tied embedding's gradients. Collective over `world`.
    pub fn build_groups(&self, world: &dyn Communicator) -> Result<Groups> {
        if world.world_size() != self.world() {
            let pp = if self.pp > 1 {
                format!(" x pp ({})", self.pp)
            } else {
                String::new()
            };
            return Err(ParallelError::Config(format!(
                "the communicator has {} ranks but dp ({}) x tp ({}){pp} = {}",
                world.world_size(),
                self.dp,
                self.tp,
                self.world()
            )));
        }
        let r = world.rank();
        let (p, d, t) = (self.pp_rank(r), self.dp_rank(r), self.tp_rank(r));
        let dp = world.split((p * self.tp + t) as u32, r as u32)?;
        let tp = world.split((p * self.dp + d) as u32, r as u32)?;
        let pp = world.split((d * self.tp + t) as u32, r as u32)?;
        // the first and the last stage of each pipeline; every other rank alone
        let ends = p == 0 || p + 1 == self.pp;
        let colour = if ends {
            (d * self.tp + t) as u32
        } else {
            (self.stage_world() + r) as u32
        };
        let embedding = world.split(colour, r as u32)?;
        let embedding = (ends && self.pp > 1).then_some(embedding);
        Ok(Groups {
            dp,
            tp,
            pp,
            embedding,
        })
    }
}

/// This rank's sub-communicators.
pub struct Groups {
    /// The data-parallel group: ranks of the same stage holding the same tensor-parallel shard.
    pub dp: Box<dyn Communicator>,
    /// The tensor-parallel group: ranks sharing one stage of one model replica.
    pub tp: Box<dyn Communicator>,
    /// The pipeline group: the stages of one model replica, group rank = stage.
    pub pp: Box<dyn Communicator>,
    /// On the first and the last stage when `pp > 1`: the two ranks holding the tied
    /// embedding (the first stage's and the last stage's copy), group rank 0 the first stage.
    pub embedding: Option<Box<dyn Communicator>>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("dp", &(self.dp.rank(), self.dp.world_size()))
            .field("tp", &(self.tp.rank(), self.tp.world_size()))
            .field("pp", &(self.pp.rank(), self.pp.world_size()))
            .field(
                "embedding",
                &self.embedding.as_ref().map(|e| (e.rank(), e.world_size())),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape::gpt(2, 64, 4, 32, 250)
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
    fn key_value_heads_are_split_or_replicated() {
        // llama_cpu: 8 query heads sharing 2 key/value heads, SwiGLU hidden 704
        let s = ModelShape::llama(4, 256, 8, 2, 704, 128, 8192);
        for tp in [1, 2, 4, 8] {
            assert!(ParallelDims::new(1, tp, tp, &s).is_ok(), "tp {tp}");
        }
        let e = ParallelDims::new(1, 5, 5, &s).unwrap_err().to_string();
        assert!(e.contains("must divide ffn_hidden_size (704)"), "{e}");
        // 12 query heads sharing 4: 6 divides the query heads but not the 4, nor is a multiple
        let s = ModelShape::llama(2, 384, 12, 4, 1152, 32, 240);
        let e = ParallelDims::new(1, 6, 6, &s).unwrap_err().to_string();
        assert!(
            e.contains("tensor_parallel_degree (6) must divide n_kv_heads (4) or be a multiple"),
            "{e}"
        );
        assert!(!e.contains("n_heads (12)"), "{e}");
        assert!(ParallelDims::new(1, 4, 4, &s).is_ok());
        assert!(ParallelDims::new(1, 12, 12, &s).is_ok());
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

    #[test]
    fn pipeline_factors_are_named() {
        let e = ParallelDims::with_pipeline(2, 2, 3, 8, &shape())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("data_parallel_degree (2) x tensor_parallel_degree (2) x pipeline_parallel_degree (3) = 12 must equal the world size (8)"),
            "{e}"
        );
        assert!(
            e.contains("pipeline_parallel_degree (3) must not exceed n_layers (2)"),
            "{e}"
        );
        let e = ParallelDims::with_pipeline(1, 1, 0, 1, &shape())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pipeline_parallel_degree must be at least 1, got 0"),
            "{e}"
        );
        let d = ParallelDims::with_pipeline(2, 2, 2, 8, &shape()).unwrap();
        for r in 0..8 {
            assert_eq!(d.rank_of(d.pp_rank(r), d.dp_rank(r), d.tp_rank(r)), r);
        }
        assert_eq!(
            (0..8).map(|r| d.pp_rank(r)).collect::<Vec<_>>(),
            [0, 0, 0, 0, 1, 1, 1, 1]
        );
        assert_eq!(
            (0..8).map(|r| d.dp_rank(r)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 0, 0, 1, 1]
        );
        // pp = 1 is the dp x tp grid
        let flat = ParallelDims::new(2, 2, 4, &shape()).unwrap();
        assert_eq!(flat.pp, 1);
        assert_eq!(
            (flat.dp_rank(3), flat.tp_rank(3), flat.pp_rank(3)),
            (1, 1, 0)
        );
    }

    #[test]
    fn pipeline_groups_follow_the_megatron_layout() {
        let s = ModelShape {
            vocab: 256,
            n_layers: 4,
            ..shape()
        };
        // dp 2 x tp 2 x pp 2 and dp 1 x tp 1 x pp 4: each group's members, seen through the sum
        // of their global ranks, and the embedding group on the first and last stage only
        for (dp, tp, pp) in [(2usize, 2usize, 2usize), (1, 1, 4), (2, 1, 3)] {
            let world = dp * tp * pp;
            let out = kiln_testkit::run_ranks(world, |comm| {
                let dims = ParallelDims::with_pipeline(dp, tp, pp, world, &s)?;
                let g = dims.build_groups(&comm)?;
                use kiln_comm::{CommExt, ReduceOp};
                let r = comm.rank() as u32;
                let sums = (
                    g.dp.all_reduce_scalar(r, ReduceOp::Sum)?,
                    g.tp.all_reduce_scalar(r, ReduceOp::Sum)?,
                    g.pp.all_reduce_scalar(r, ReduceOp::Sum)?,
                );
                let emb = match &g.embedding {
                    Some(e) => Some((e.rank(), e.all_reduce_scalar(r, ReduceOp::Sum)?)),
                    None => None,
                };
                Ok((g.pp.rank(), g.pp.world_size(), sums, emb))
            });
            let dims = ParallelDims::with_pipeline(dp, tp, pp, world, &s).unwrap();
            for (r, (pp_rank, pp_size, (dps, tps, pps), emb)) in out.into_iter().enumerate() {
                let (p, d, t) = (dims.pp_rank(r), dims.dp_rank(r), dims.tp_rank(r));
                assert_eq!((pp_rank, pp_size), (p, pp), "rank {r}");
                let sum = |it: &mut dyn Iterator<Item = usize>| it.map(|x| x as u32).sum::<u32>();
                assert_eq!(
                    dps,
                    sum(&mut (0..dp).map(|x| dims.rank_of(p, x, t))),
                    "dp of {r}"
                );
                assert_eq!(
                    tps,
                    sum(&mut (0..tp).map(|x| dims.rank_of(p, d, x))),
                    "tp of {r}"
                );
                assert_eq!(
                    pps,
                    sum(&mut (0..pp).map(|x| dims.rank_of(x, d, t))),
                    "pp of {r}"
                );
                let first = dims.rank_of(0, d, t) as u32;
                let last = dims.rank_of(pp - 1, d, t) as u32;
                let expected = (p == 0 || p + 1 == pp).then(|| (usize::from(p != 0), first + last));
                assert_eq!(emb, expected, "embedding group of {r}");
            }
        }
    }
}
