//! Memory of one pipeline rank: the parameters of its stage's blocks (plus the embedding on the
//! first stage and the head or the tied copy on the last) under ZeRO inside the stage's data-parallel
//! group, and the activations of the micro-batches its schedule holds at once.
//!
//! (The accounting is documented on [`PipelinePlan`].)

use super::{MemoryEstimate, MemoryPlan, ModelShape};
use crate::error::{MemoryError, Result};
use std::fmt;
use std::str::FromStr;

/// A pipeline schedule, as far as memory is concerned. [`FromStr`] and
/// [`Display`](fmt::Display) use `gpipe`, `1f1b`, `interleaved` and `zb_h1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum PipelineSchedule {
    /// GPipe: all forwards, then all backwards (`m` micro-batches in flight).
    #[serde(rename = "gpipe")]
    GPipe,
    /// 1F1B (PipeDream-Flush): at most `p - rank` in flight.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B over `virtual_stages` chunks per rank.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1: 1F1B with the weight gradients deferred, at most `p` in flight.
    #[serde(rename = "zb_h1")]
    ZbH1,
}

impl PipelineSchedule {
    /// Every schedule.
    pub const ALL: [PipelineSchedule; 4] = [
        PipelineSchedule::GPipe,
        PipelineSchedule::OneFOneB,
        PipelineSchedule::Interleaved,
        PipelineSchedule::ZbH1,
    ];

    /// The name [`FromStr`] takes.
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::GPipe => "gpipe",
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::Interleaved => "interleaved",
            PipelineSchedule::ZbH1 => "zb_h1",
        }
    }
}

impl fmt::Display for PipelineSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PipelineSchedule {
    type Err = MemoryError;

    /// `gpipe`, `1f1b`, `interleaved` or `zb_h1`; case and surrounding spaces do not matter.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| MemoryError::Config {
                field: "pipeline schedule",
                message: format!("expected gpipe, 1f1b, interleaved or zb_h1, got {s:?}"),
            })
    }
}

/// The pipeline a [`MemoryPlan`] runs in: `pp` ranks, `virtual_stages` model chunks per rank,
/// `micro_batches` per step and the schedule, and optionally the blocks of each model stage.
///
/// The rank layout is Megatron-LM's: a rank holds model stages `chunk * pp + rank` for its
/// `virtual_stages` chunks (one chunk unless the schedule is interleaved), so model stage 0
/// (the embedding) is on rank 0 and the last model stage (the final norm, the head and the
/// loss) on rank `pp - 1`. With `pp > 1` the last stage holds a copy of the tied word embedding
/// (Megatron's way), so the stages together hold the one-stage model's parameters plus
/// `vocab * d_model / tp`; an untied head (Llama) is the last stage's own, and the stages
/// together hold the model once.
///
/// Activations in flight on rank `r` of `p` with `m` micro-batches, counted in micro-batches of
/// one model chunk:
/// - GPipe: every forward before any backward, `m`;
/// - 1F1B (PipeDream-Flush): `p - r - 1` warm-up forwards plus the one in flight,
///   `min(p - r, m)`;
/// - ZB-H1 (Qi et al., 2024): 1F1B's order, but rank `r` defers its first `r` weight gradients
///   (which release a micro-batch's activations) into the cool-down, so every rank reaches
///   `min(p, m)`, 1F1B's peak (rank 0's) on every rank, as the paper states;
/// - interleaved 1F1B (Megatron-LM's `forward_backward_pipelining_with_interleaving`): `w =
///   2 (p - r - 1) + (v - 1) p` warm-up forwards (all `m v` of them when `m == p`), then one
///   forward before each backward: `min(w + 1, m v)` chunk micro-batches, for rank 0
///   `p v + p - 1`, i.e. Korthikanti et al.'s (2022) `L (1 + (p - 1) / (p v))` layers' worth.
///   Which chunks they belong to follows Megatron's order (virtual micro-batch `k` runs chunk
///   `(k mod p v) / p` forward, the chunks reversed backward), and the peak is taken over that
///   order, so an uneven split and the embedding and logits are counted where they are.
///
/// Each in-flight micro-batch keeps, per block, what [`MemoryPlan::activation_bytes`] counts for
/// it under the recomputation policy (which picks blocks by their index in the whole model, as
/// the executor does); the first stage keeps the embedding output and the last the logits. One
/// recomputed block's whole activations (while it runs again) and the logits' gradient exist once
/// per rank. ZB-H1's weight gradient needs less than a whole backward; the count keeps a
/// micro-batch's activations until its weight gradient, an upper bound. Communication adds the
/// point-to-point buffers of one activation and one gradient sent and received
/// (`4 s b h / rep` elements) to the data-parallel buckets.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PipelinePlan {
    /// Pipeline ranks (stages of the rank layout).
    pub pp: u64,
    /// Model chunks per rank (`v`): 1 unless the schedule is interleaved.
    pub virtual_stages: u64,
    /// Micro-batches per step (`m`).
    pub micro_batches: u64,
    /// The schedule.
    pub schedule: PipelineSchedule,
    /// Blocks of each of the `pp * virtual_stages` model stages, first to last (the split
    /// kiln-parallel's `stage_segments` chose, say). `None`: the even split, `n_layers / (pp v)`
    /// blocks each, with the remainder `r` given one each to the `r` stages just before the
    /// last: never to the head's stage, and to the embedding's (which holds the most
    /// activations) only when `r = pp v - 1`.
    #[serde(default)]
    pub stage_blocks: Option<Vec<u64>>,
}

impl PipelinePlan {
    /// A pipeline with the even split.
    pub fn new(
        pp: u64,
        virtual_stages: u64,
        micro_batches: u64,
        schedule: PipelineSchedule,
    ) -> Self {
        PipelinePlan {
            pp,
            virtual_stages,
            micro_batches,
            schedule,
            stage_blocks: None,
        }
    }

    /// Model stages in all: `pp * virtual_stages`.
    pub fn model_stages(&self) -> u64 {
        self.pp * self.virtual_stages
    }

    /// Checks the degrees against the schedule and the model (the rules kiln-parallel's
    /// schedules enforce); the error names the factor and the rule.
    pub fn validate(&self, shape: &ModelShape) -> Result<()> {
        let bad =
            |field: &'static str, message: String| Err(MemoryError::Config { field, message });
        for (field, v) in [
            ("pp", self.pp),
            ("virtual_stages", self.virtual_stages),
            ("micro_batches", self.micro_batches),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1, got 0".into());
            }
        }
        let (p, v, m) = (self.pp, self.virtual_stages, self.micro_batches);
        if self.schedule == PipelineSchedule::Interleaved {
            if v < 2 {
                return bad(
                    "virtual_stages",
                    format!("the interleaved schedule needs virtual_stages >= 2, got {v}"),
                );
            }
            if p < 2 {
                return bad(
                    "pp",
                    format!("the interleaved schedule needs pp >= 2, got pp = {p}"),
                );
            }
            if m < p || m % p != 0 {
                return bad(
                    "micro_batches",
                    format!(
                        "the interleaved schedule needs micro_batches to be a multiple of pp, got \
                         micro_batches = {m}, pp = {p}"
                    ),
                );
            }
        } else if v != 1 {
            return bad(
                "virtual_stages",
                format!(
                    "virtual stages need the interleaved schedule; {} got virtual_stages = {v}",
                    self.schedule
                ),
            );
        }
        self.blocks(shape.n_layers).map(|_| ())
    }

    /// Blocks of each model stage (see [`PipelinePlan::stage_blocks`]).
    pub fn blocks(&self, n_layers: u64) -> Result<Vec<u64>> {
        let stages = self.model_stages();
        if let Some(b) = &self.stage_blocks {
            let sum: u64 = b.iter().sum();
            if b.len() as u64 != stages || b.contains(&0) || sum != n_layers {
                return Err(MemoryError::Config {
                    field: "stage_blocks",
                    message: format!(
                        "expected {stages} stages (pp x virtual_stages) of at least one block \
                         each, {n_layers} blocks in all, got {b:?}"
                    ),
                });
            }
            return Ok(b.clone());
        }
        if n_layers < stages {
            return Err(MemoryError::Config {
                field: "pp",
                message: format!(
                    "pp ({}) x virtual_stages ({}) = {stages} stages need at least one block \
                     each, the model has n_layers = {n_layers}",
                    self.pp, self.virtual_stages
                ),
            });
        }
        let (q, r) = (n_layers / stages, n_layers % stages);
        Ok((0..stages)
            .map(|k| q + u64::from(k + 1 < stages && k + 1 + r >= stages))
            .collect())
    }

    /// Megatron-LM's interleaved warm-up on `rank`: `2 (p - rank - 1) + (v - 1) p` forwards,
    /// every one of the `m v` when `m == p`.
    fn interleaved_warmup(&self, rank: u64) -> u64 {
        let (p, v, m) = (self.pp, self.virtual_stages, self.micro_batches);
        if m == p {
            m * v
        } else {
            (2 * (p - rank - 1) + (v - 1) * p).min(m * v)
        }
    }

    /// The most micro-batches (of one model chunk each) whose activations `rank` holds at once
    /// (see [`PipelinePlan`] for each schedule's count).
    pub fn in_flight(&self, rank: u64) -> u64 {
        let (p, m) = (self.pp, self.micro_batches);
        match self.schedule {
            PipelineSchedule::GPipe => m,
            PipelineSchedule::OneFOneB => p.saturating_sub(rank).min(m),
            PipelineSchedule::ZbH1 => p.min(m),
            PipelineSchedule::Interleaved => {
                (self.interleaved_warmup(rank) + 1).min(m * self.virtual_stages)
            }
        }
    }

    /// The peak of the activation bytes `rank` holds, where one micro-batch of its chunk `c`
    /// keeps `chunk_bytes[c]`: for the interleaved schedule over Megatron's order of virtual
    /// micro-batches, otherwise [`PipelinePlan::in_flight`] times the (one) chunk's bytes.
    pub fn peak_bytes(&self, rank: u64, chunk_bytes: &[u64]) -> u64 {
        if self.schedule != PipelineSchedule::Interleaved {
            return self.in_flight(rank) * chunk_bytes.iter().copied().max().unwrap_or(0);
        }
        let (p, v) = (self.pp, self.virtual_stages);
        let total = self.micro_batches * v;
        let bytes = |k: u64, forward: bool| {
            let chunk = (k % (p * v)) / p;
            let chunk = if forward { chunk } else { v - 1 - chunk };
            chunk_bytes.get(chunk as usize).copied().unwrap_or(0)
        };
        let warmup = self.interleaved_warmup(rank);
        let mut now: u64 = (0..warmup).map(|k| bytes(k, true)).sum();
        let mut peak = now;
        for k in 0..total - warmup {
            now += bytes(warmup + k, true);
            peak = peak.max(now);
            now = now.saturating_sub(bytes(k, false));
        }
        peak
    }
}

/// The memory of one pipeline rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageEstimate {
    /// The pipeline rank (`0..pp`).
    pub rank: u64,
    /// Transformer blocks the rank holds (over its chunks).
    pub blocks: u64,
    /// Whether it holds the embedding (model stage 0).
    pub first: bool,
    /// Whether it holds the head and the loss (the last model stage).
    pub last: bool,
    /// The most chunk micro-batches in flight ([`PipelinePlan::in_flight`]).
    pub in_flight: u64,
    /// Bytes by category; `activations` at the schedule's peak.
    pub memory: MemoryEstimate,
}

impl StageEstimate {
    /// Everything.
    pub fn total(&self) -> u64 {
        self.memory.total()
    }
}

impl MemoryPlan {
    /// The memory of pipeline rank `stage` (`0..pipeline.pp`) under `pipeline`: its stage's
    /// parameters under this plan's ZeRO stage over `dp`, and the activations its schedule holds
    /// at the peak (see [`PipelinePlan`] for the accounting). With `pp = 1` and 1F1B (or
    /// one micro-batch) this is [`MemoryPlan::estimate`].
    pub fn estimate_stage(&self, pipeline: &PipelinePlan, stage: usize) -> Result<StageEstimate> {
        self.validate()?;
        pipeline.validate(&self.shape)?;
        let rank = stage as u64;
        let (p, v) = (pipeline.pp, pipeline.virtual_stages);
        if rank >= p {
            return Err(MemoryError::Config {
                field: "stage",
                message: format!("a pipeline of pp = {p} has ranks 0..{p}, got {stage}"),
            });
        }
        let s = &self.shape;
        let (h, t) = (s.d_model, self.tp);
        let blocks = pipeline.blocks(s.n_layers)?;
        let last_stage = p * v - 1;
        // the first block of each model stage
        let starts: Vec<u64> = blocks
            .iter()
            .scan(0, |acc, &b| {
                let start = *acc;
                *acc += b;
                Some(start)
            })
            .collect();
        let a = self.activation_terms();
        let n_segments = s.n_layers as usize + 2;
        let mut psi = 0;
        let mut chunk_bytes = Vec::with_capacity(v as usize);
        let mut any_recomputed = false;
        let mut held = 0;
        for chunk in 0..v {
            let k = chunk * p + rank;
            let (start, count) = (starts[k as usize], blocks[k as usize]);
            held += count;
            psi += count * self.block_params_per_rank();
            let mut bytes = 0;
            for block in start..start + count {
                let segment = block as usize + 1;
                bytes += if self.recompute.selects(segment, n_segments) {
                    a.selective_kept
                } else if self.recompute.recomputes(segment, n_segments) {
                    any_recomputed = true;
                    a.layer_input
                } else {
                    a.per_layer
                };
            }
            if k == 0 {
                // the word embedding (vocab-parallel) and the learned positions
                let positions = if s.learned_positions { s.ctx * h } else { 0 };
                psi += s.vocab * h / t + positions;
                bytes += a.embedding_output;
            }
            if k == last_stage {
                // the final norm, and an untied head or the tied embedding's copy on another
                // rank (vocab-parallel)
                let head = !s.tied_embeddings || p > 1;
                psi += s.norm_params() + if head { s.vocab * h / t } else { 0 };
                bytes += a.logits;
            }
            chunk_bytes.push(bytes);
        }
        let first = rank == 0;
        let last = rank == p - 1;
        let mut activations = pipeline.peak_bytes(rank, &chunk_bytes);
        if any_recomputed {
            activations += a.per_layer;
        }
        if last {
            activations += a.logits_pair - a.logits;
        }
        let (weights, grads, optimizer) =
            Self::model_state_split(psi, self.precision, self.stage, self.dp);
        let p2p = if p > 1 { 4 * a.embedding_output } else { 0 };
        Ok(StageEstimate {
            rank,
            blocks: held,
            first,
            last,
            in_flight: pipeline.in_flight(rank),
            memory: MemoryEstimate {
                params_per_rank: psi,
                weights,
                grads,
                optimizer,
                activations,
                comm_buffers: self.comm_buffer_bytes() + p2p,
            },
        })
    }

    /// [`MemoryPlan::estimate_stage`] of every pipeline rank, first to last.
    pub fn estimate_pipeline(&self, pipeline: &PipelinePlan) -> Result<Vec<StageEstimate>> {
        (0..pipeline.pp as usize)
            .map(|r| self.estimate_stage(pipeline, r))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemPrecision, RecomputePolicy, ZeroStage};

    fn gpt3() -> ModelShape {
        ModelShape::gpt(96, 12288, 96, 2048, 50257)
    }

    fn plan(stage: ZeroStage, dp: u64, tp: u64) -> MemoryPlan {
        MemoryPlan {
            shape: gpt3(),
            precision: MemPrecision::Mixed16,
            stage,
            dp,
            tp,
            micro_batch: 1,
            recompute: RecomputePolicy::EveryBlock,
            bucket_bytes: 25 << 20,
            sequence_parallel: false,
        }
    }

    #[test]
    fn one_stage_is_the_plain_estimate() {
        for stage in ZeroStage::ALL {
            for policy in [
                RecomputePolicy::None,
                RecomputePolicy::EveryBlock,
                RecomputePolicy::EveryKth(5),
                RecomputePolicy::Selective(1),
                RecomputePolicy::Selective(3),
            ] {
                for (tp, sp) in [(1, false), (8, false), (8, true)] {
                    let mut p = plan(stage, 16, tp);
                    p.recompute = policy;
                    p.sequence_parallel = sp;
                    for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::ZbH1] {
                        let one = PipelinePlan::new(1, 1, 8, schedule);
                        let e = p.estimate_stage(&one, 0).unwrap();
                        assert_eq!(e.memory, p.estimate().unwrap(), "{stage:?} {policy:?}");
                        assert_eq!(
                            (e.in_flight, e.blocks, e.first, e.last),
                            (1, 96, true, true)
                        );
                    }
                    // GPipe holds all 8 micro-batches even on one stage
                    let gpipe = PipelinePlan::new(1, 1, 8, PipelineSchedule::GPipe);
                    let g = p.estimate_stage(&gpipe, 0).unwrap();
                    assert_eq!(g.in_flight, 8);
                    assert!(g.memory.activations > p.activation_bytes());
                }
            }
        }
    }

    #[test]
    fn an_untied_head_is_the_last_stages_own() {
        // Llama 3 70B: the stages hold the model once, the head on the last
        let s = ModelShape::llama(80, 8192, 64, 8, 28_672, 8192, 128_256);
        for tp in [1, 8, 16] {
            let p = MemoryPlan {
                shape: s,
                ..plan(ZeroStage::Zero1, 8, tp)
            };
            for (pp, v) in [(1, 1), (4, 1), (8, 2)] {
                let schedule = if v > 1 {
                    PipelineSchedule::Interleaved
                } else {
                    PipelineSchedule::OneFOneB
                };
                let stages = p
                    .estimate_pipeline(&PipelinePlan::new(pp, v, 2 * pp, schedule))
                    .unwrap();
                let psi: u64 = stages.iter().map(|e| e.memory.params_per_rank).sum();
                assert_eq!(psi, s.params_per_tp_rank(tp), "pp {pp} v {v} tp {tp}");
            }
        }
    }

    #[test]
    fn stages_hold_the_model_once_plus_the_tied_copy() {
        let s = gpt3();
        for (pp, v, schedule) in [
            (2, 1, PipelineSchedule::OneFOneB),
            (16, 1, PipelineSchedule::GPipe),
            (7, 1, PipelineSchedule::ZbH1), // 96 = 7 * 13 + 5: an uneven split
            (4, 3, PipelineSchedule::Interleaved),
            (8, 2, PipelineSchedule::Interleaved),
        ] {
            let pipe = PipelinePlan::new(pp, v, 2 * pp, schedule);
            for tp in [1, 8] {
                let tied = s.vocab * s.d_model / tp;
                let whole = s.params_per_tp_rank(tp);
                for stage in ZeroStage::ALL {
                    for dp in [1, 12, 64] {
                        let p = plan(stage, dp, tp);
                        let stages = p.estimate_pipeline(&pipe).unwrap();
                        let psi: u64 = stages.iter().map(|e| e.memory.params_per_rank).sum();
                        assert_eq!(psi, whole + tied, "pp {pp} v {v} tp {tp}");
                        let blocks: u64 = stages.iter().map(|e| e.blocks).sum();
                        assert_eq!(blocks, s.n_layers);
                        let states: u64 = stages.iter().map(|e| e.memory.model_states()).sum();
                        let want =
                            MemoryPlan::model_state_bytes_for(whole + tied, p.precision, stage, dp);
                        if stage == ZeroStage::Replicated || dp == 1 {
                            assert_eq!(states, want, "{stage:?} dp {dp}");
                        } else {
                            // each stage's shard rounds up on its own: at most one byte per
                            // category and stage
                            assert!(
                                states >= want && states - want <= 3 * pp,
                                "{stage:?} dp {dp}: {states} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        // the even split with a remainder: 96 = 7 * 13 + 5 over the five stages before the last
        let pipe = PipelinePlan::new(7, 1, 7, PipelineSchedule::OneFOneB);
        assert_eq!(pipe.blocks(96).unwrap(), vec![13, 14, 14, 14, 14, 14, 13]);
        let pipe = PipelinePlan::new(4, 1, 4, PipelineSchedule::OneFOneB);
        assert_eq!(pipe.blocks(7).unwrap(), vec![2, 2, 2, 1]);
    }

    #[test]
    fn in_flight_follows_each_schedule() {
        let (p, m) = (4, 8);
        let count = |schedule, v, m| {
            let pipe = PipelinePlan::new(p, v, m, schedule);
            (0..p).map(|r| pipe.in_flight(r)).collect::<Vec<_>>()
        };
        assert_eq!(count(PipelineSchedule::GPipe, 1, m), vec![8, 8, 8, 8]);
        assert_eq!(count(PipelineSchedule::OneFOneB, 1, m), vec![4, 3, 2, 1]);
        assert_eq!(count(PipelineSchedule::OneFOneB, 1, 2), vec![2, 2, 2, 1]);
        assert_eq!(count(PipelineSchedule::ZbH1, 1, m), vec![4, 4, 4, 4]);
        assert_eq!(count(PipelineSchedule::ZbH1, 1, 3), vec![3, 3, 3, 3]);
        // Megatron's warm-up 2 (p - r - 1) + (v - 1) p, plus the forward in flight; rank 0:
        // p v + p - 1 chunks
        assert_eq!(
            count(PipelineSchedule::Interleaved, 2, m),
            vec![11, 9, 7, 5]
        );
        assert_eq!(
            count(PipelineSchedule::Interleaved, 3, 16)[0],
            4 * 3 + 4 - 1
        );
        // m == p: every forward first
        assert_eq!(count(PipelineSchedule::Interleaved, 2, 4), vec![8, 8, 8, 8]);
    }

    #[test]
    fn activations_follow_korthikanti_et_al() {
        // Korthikanti et al. (2022): a block keeps 34 s b h + 5 a s² b bytes in 16-bit with
        // tensor and sequence parallelism each divided by t; kiln's block has no dropout, whose
        // masks are 2 s b h (after attention and after the MLP) and a s² b of it: 32 and 4
        let s = gpt3();
        let (sq, b, h, a, l) = (s.ctx, 1, s.d_model, s.n_heads, s.n_layers);
        let (t, p) = (8, 16);
        let mut plan = plan(ZeroStage::Zero1, 12, t);
        plan.sequence_parallel = true;
        plan.recompute = RecomputePolicy::None;
        let block = (32 * sq * b * h + 4 * a * sq * sq * b) / t;
        let logits = 2 * sq * b * s.vocab / t;
        let embedding = 2 * sq * b * h / t;
        let one_f_one_b = PipelinePlan::new(p, 1, 64, PipelineSchedule::OneFOneB);
        // the first stage keeps p micro-batches of its L / p blocks: L blocks' worth
        let first = plan.estimate_stage(&one_f_one_b, 0).unwrap();
        assert_eq!(first.memory.activations, l * block + p * embedding);
        // the last stage one micro-batch, with its logits and their gradient
        let last = plan.estimate_stage(&one_f_one_b, p as usize - 1).unwrap();
        assert_eq!(last.memory.activations, l / p * block + 2 * logits);
        // interleaved: L (1 + (p - 1) / (p v)) blocks' worth on the first stage
        let v = 3;
        let inter = PipelinePlan::new(p, v, 64, PipelineSchedule::Interleaved);
        let first = plan.estimate_stage(&inter, 0).unwrap();
        let blocks_worth = l * (p * v + p - 1) / (p * v);
        assert_eq!(first.in_flight, p * v + p - 1);
        // the embedding's chunk (chunk 0) holds 2 p micro-batches at the second steady forward
        // (virtual micro-batches 0..p and p v..p v + p), when p v + p - 1 are in flight
        assert_eq!(
            first.memory.activations,
            blocks_worth * block + 2 * p * embedding
        );
        // full recomputation keeps each block's input: 2 s b h L on the first stage (the
        // paper's figure), plus one block whole while it runs again
        plan.sequence_parallel = false;
        plan.recompute = RecomputePolicy::EveryBlock;
        let first = plan.estimate_stage(&one_f_one_b, 0).unwrap();
        let whole_block = 2 * (4 * sq * b * h + 12 * sq * b * h / t + 2 * a * sq * sq * b / t);
        assert_eq!(
            first.memory.activations,
            2 * sq * b * h * l + whole_block + p * 2 * sq * b * h
        );
    }

    #[test]
    fn bad_pipelines_name_the_factor() {
        let p = plan(ZeroStage::Zero1, 8, 8);
        let err = |pipe: PipelinePlan, stage: usize| {
            p.estimate_stage(&pipe, stage).unwrap_err().to_string()
        };
        let e = err(PipelinePlan::new(4, 2, 8, PipelineSchedule::GPipe), 0);
        assert!(e.contains("virtual_stages") && e.contains("gpipe"), "{e}");
        let e = err(PipelinePlan::new(4, 2, 6, PipelineSchedule::Interleaved), 0);
        assert!(
            e.contains("micro_batches = 6") && e.contains("pp = 4"),
            "{e}"
        );
        let e = err(PipelinePlan::new(4, 1, 8, PipelineSchedule::OneFOneB), 4);
        assert!(e.contains("stage") && e.contains("got 4"), "{e}");
        let e = err(
            PipelinePlan::new(64, 2, 64, PipelineSchedule::Interleaved),
            0,
        );
        assert!(
            e.contains("128 stages") && e.contains("n_layers = 96"),
            "{e}"
        );
        let mut pipe = PipelinePlan::new(2, 1, 2, PipelineSchedule::OneFOneB);
        pipe.stage_blocks = Some(vec![96, 0]);
        assert!(err(pipe.clone(), 0).contains("stage_blocks"));
        pipe.stage_blocks = Some(vec![40, 56]);
        let e = p.estimate_stage(&pipe, 1).unwrap();
        assert_eq!(e.blocks, 56);
        let e = "ZB_H1".parse::<PipelineSchedule>().unwrap();
        assert_eq!(e, PipelineSchedule::ZbH1);
        for k in PipelineSchedule::ALL {
            assert_eq!(k.to_string().parse::<PipelineSchedule>().unwrap(), k);
        }
        let e = "pipedream"
            .parse::<PipelineSchedule>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("1f1b") && e.contains("pipedream"), "{e}");
    }
}
