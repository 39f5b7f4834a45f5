//! What a pipeline schedule is made of: the schedule kinds, the pipeline's shape and the
//! actions a rank runs.

use super::ScheduleError;
use std::fmt;
use std::str::FromStr;

/// Which schedule. [`FromStr`] and [`Display`](fmt::Display) use `gpipe`, `1f1b`,
/// `interleaved` and `zb_h1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// GPipe: every forward in micro-batch order, then every backward in micro-batch order.
    GPipe,
    /// 1F1B (PipeDream-Flush, Megatron-LM's non-interleaved schedule).
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B over `virtual_stages` model chunks per rank.
    Interleaved,
    /// Zero-bubble ZB-H1 (Qi et al., 2024): 1F1B's memory, the backward split into the input
    /// gradient and the weight gradient, weight gradients deferred into the cool-down.
    ZbH1,
}

impl ScheduleKind {
    /// Every kind, in the order the documentation lists them.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
    ];

    /// The name [`FromStr`] takes.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb_h1",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| ScheduleError::UnknownKind { got: s.to_string() })
    }
}

/// The pipeline's shape: `stages` ranks (pp), `virtual_stages` model chunks per rank (1 unless
/// interleaved) and the micro-batches of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PipelineSpec {
    /// Pipeline ranks (pp).
    pub stages: usize,
    /// Model chunks per rank (v): 1 unless the schedule is interleaved.
    pub virtual_stages: usize,
    /// Micro-batches per step (m).
    pub micro_batches: usize,
}

impl PipelineSpec {
    /// Model stages in all: `stages * virtual_stages`.
    pub fn model_stages(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// The model stage a rank's chunk holds: `chunk * stages + rank` (Megatron's interleaved
    /// assignment; with one chunk the stage is the rank).
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// The rank and chunk holding a model stage.
    pub fn holder(&self, stage: usize) -> (usize, usize) {
        (stage % self.stages, stage / self.stages)
    }

    /// Checks the shape against what `kind` needs; the error names the factor and the rule.
    pub fn validate(&self, kind: ScheduleKind) -> Result<(), ScheduleError> {
        let bad = |field: &'static str, got: usize, rule: String| {
            Err(ScheduleError::InvalidSpec { field, got, rule })
        };
        if self.stages == 0 {
            return bad("stages", 0, "a pipeline needs at least one stage".into());
        }
        if self.micro_batches == 0 {
            return bad(
                "micro_batches",
                0,
                "a step needs at least one micro-batch".into(),
            );
        }
        if self.virtual_stages == 0 {
            return bad(
                "virtual_stages",
                0,
                "every rank holds at least one model chunk (virtual_stages >= 1)".into(),
            );
        }
        let (p, v, m) = (self.stages, self.virtual_stages, self.micro_batches);
        if kind == ScheduleKind::Interleaved {
            if v < 2 {
                return bad(
                    "virtual_stages",
                    v,
                    format!("the interleaved schedule needs virtual_stages >= 2, got {v}"),
                );
            }
            if p < 2 {
                return bad(
                    "stages",
                    p,
                    format!(
                        "the interleaved schedule needs stages >= 2 (one rank has no neighbour to \
                         interleave with), got stages = {p}"
                    ),
                );
            }
            if m < p {
                return bad(
                    "micro_batches",
                    m,
                    format!(
                        "the interleaved schedule needs micro_batches >= stages, got \
                         micro_batches = {m} < stages = {p}"
                    ),
                );
            }
            if m % p != 0 {
                return bad(
                    "micro_batches",
                    m,
                    format!(
                        "the interleaved schedule needs micro_batches divisible by stages \
                         (Megatron-LM's rule), got micro_batches = {m}, stages = {p}"
                    ),
                );
            }
        } else if v != 1 {
            return bad(
                "virtual_stages",
                v,
                format!(
                    "virtual stages need the interleaved schedule; {kind} got virtual_stages = {v}"
                ),
            );
        }
        Ok(())
    }
}

/// One step of a rank's list. `chunk` is the rank's local model chunk `0..v`; the model stage
/// it holds is `chunk * stages + rank` ([`PipelineSpec::stage_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// The forward of micro-batch `mb` through the chunk.
    Forward {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk.
        chunk: usize,
    },
    /// The backward: input and weight gradient together.
    Backward {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk.
        chunk: usize,
    },
    /// Zero-bubble: the input gradient only (its [`Action::BackwardWeight`] comes later).
    BackwardInput {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk.
        chunk: usize,
    },
    /// Zero-bubble: the weight gradient only.
    BackwardWeight {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk.
        chunk: usize,
    },
    /// The output of `(mb, stage of chunk)` to the rank holding the next stage.
    SendActivation {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk (of the sender).
        chunk: usize,
        /// The rank holding the next stage.
        to: usize,
    },
    /// The input of `(mb, stage of chunk)` from the rank holding the previous stage.
    RecvActivation {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk (of the receiver).
        chunk: usize,
        /// The rank holding the previous stage.
        from: usize,
    },
    /// The input gradient of `(mb, stage of chunk)` to the previous stage's rank.
    SendGrad {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk (of the sender).
        chunk: usize,
        /// The rank holding the previous stage.
        to: usize,
    },
    /// The output gradient of `(mb, stage of chunk)` from the next stage's rank.
    RecvGrad {
        /// Micro-batch.
        mb: usize,
        /// Local model chunk (of the receiver).
        chunk: usize,
        /// The rank holding the next stage.
        from: usize,
    },
}

/// What a compute action does, for drawing and accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ComputeKind {
    /// [`Action::Forward`].
    Forward,
    /// [`Action::Backward`].
    Backward,
    /// [`Action::BackwardInput`].
    BackwardInput,
    /// [`Action::BackwardWeight`].
    BackwardWeight,
}

impl Action {
    /// The micro-batch.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. }
            | Action::SendActivation { mb, .. }
            | Action::RecvActivation { mb, .. }
            | Action::SendGrad { mb, .. }
            | Action::RecvGrad { mb, .. } => mb,
        }
    }

    /// The local model chunk.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. }
            | Action::SendActivation { chunk, .. }
            | Action::RecvActivation { chunk, .. }
            | Action::SendGrad { chunk, .. }
            | Action::RecvGrad { chunk, .. } => chunk,
        }
    }

    /// The compute kind, `None` for communication.
    pub fn compute(&self) -> Option<ComputeKind> {
        match self {
            Action::Forward { .. } => Some(ComputeKind::Forward),
            Action::Backward { .. } => Some(ComputeKind::Backward),
            Action::BackwardInput { .. } => Some(ComputeKind::BackwardInput),
            Action::BackwardWeight { .. } => Some(ComputeKind::BackwardWeight),
            _ => None,
        }
    }

    /// The peer of a send, `None` otherwise.
    pub fn send_to(&self) -> Option<usize> {
        match *self {
            Action::SendActivation { to, .. } | Action::SendGrad { to, .. } => Some(to),
            _ => None,
        }
    }

    /// The peer of a receive, `None` otherwise.
    pub fn recv_from(&self) -> Option<usize> {
        match *self {
            Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => Some(from),
            _ => None,
        }
    }

    /// A short label: `F3`, `B3` (a whole backward, or the input gradient of a split one),
    /// `W3`, with a dot and the chunk when the schedule has several (`F3.1`); communication as
    /// `sA3`, `rA3`, `sG3`, `rG3`.
    pub fn label(&self, virtual_stages: usize) -> String {
        let head = match self {
            Action::Forward { .. } => "F",
            Action::Backward { .. } | Action::BackwardInput { .. } => "B",
            Action::BackwardWeight { .. } => "W",
            Action::SendActivation { .. } => "sA",
            Action::RecvActivation { .. } => "rA",
            Action::SendGrad { .. } => "sG",
            Action::RecvGrad { .. } => "rG",
        };
        if virtual_stages > 1 {
            format!("{head}{}.{}", self.mb(), self.chunk())
        } else {
            format!("{head}{}", self.mb())
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { mb, chunk } => write!(f, "Forward(mb {mb}, chunk {chunk})"),
            Action::Backward { mb, chunk } => write!(f, "Backward(mb {mb}, chunk {chunk})"),
            Action::BackwardInput { mb, chunk } => {
                write!(f, "BackwardInput(mb {mb}, chunk {chunk})")
            }
            Action::BackwardWeight { mb, chunk } => {
                write!(f, "BackwardWeight(mb {mb}, chunk {chunk})")
            }
            Action::SendActivation { mb, chunk, to } => {
                write!(f, "SendActivation(mb {mb}, chunk {chunk}, to rank {to})")
            }
            Action::RecvActivation { mb, chunk, from } => {
                write!(
                    f,
                    "RecvActivation(mb {mb}, chunk {chunk}, from rank {from})"
                )
            }
            Action::SendGrad { mb, chunk, to } => {
                write!(f, "SendGrad(mb {mb}, chunk {chunk}, to rank {to})")
            }
            Action::RecvGrad { mb, chunk, from } => {
                write!(f, "RecvGrad(mb {mb}, chunk {chunk}, from rank {from})")
            }
        }
    }
}

impl serde::Serialize for ScheduleKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for ScheduleKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
