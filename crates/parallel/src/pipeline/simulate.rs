//! The simulator: each rank runs its list in order, compute takes its cost, a send is eager and
//! a receive waits for its message; the timeline, its bubble and the activations held.

use super::build::Message;
use super::error::Blocked;
use super::{Action, ComputeKind, PipelineSpec, Schedule, ScheduleError, ScheduleKind};
use std::collections::{HashMap, VecDeque};
use std::fmt::Write;

/// The time each action takes. A whole [`Action::Backward`] costs `backward_input +
/// backward_weight`; a send costs `p2p`; a receive costs nothing but waits for its send to
/// finish.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// A forward.
    pub forward: f64,
    /// The input gradient of a backward.
    pub backward_input: f64,
    /// The weight gradient of a backward.
    pub backward_weight: f64,
    /// A send.
    pub p2p: f64,
}

impl Default for Costs {
    /// Unit forward, input gradient and weight gradient (so a whole backward is two forwards,
    /// and F = B = W for the zero-bubble schedule), free sends.
    fn default() -> Self {
        Costs {
            forward: 1.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            p2p: 0.0,
        }
    }
}

impl Costs {
    /// Rejects a negative or non-finite cost, naming it.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        for (field, got) in [
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("p2p", self.p2p),
        ] {
            if !got.is_finite() || got < 0.0 {
                return Err(ScheduleError::InvalidCost { field, got });
            }
        }
        Ok(())
    }

    /// The time `action` takes.
    pub fn of(&self, action: &Action) -> f64 {
        match action.compute() {
            Some(ComputeKind::Forward) => self.forward,
            Some(ComputeKind::Backward) => self.backward_input + self.backward_weight,
            Some(ComputeKind::BackwardInput) => self.backward_input,
            Some(ComputeKind::BackwardWeight) => self.backward_weight,
            None if action.send_to().is_some() => self.p2p,
            None => 0.0,
        }
    }
}

/// One action as it ran: from `start` to `end` (a receive from when the rank reached it to
/// when its message was there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// When it began.
    pub start: f64,
    /// When it finished.
    pub end: f64,
    /// The action.
    pub action: Action,
}

/// A simulated step.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// The pipeline's shape.
    pub spec: PipelineSpec,
    /// Every action of every rank as it ran, in list order.
    pub spans: Vec<Vec<Span>>,
    /// When the last rank finished.
    pub makespan: f64,
    /// `1 - busy / (ranks * makespan)`, busy being the compute time of all ranks.
    pub bubble_fraction: f64,
    /// Per rank, the most micro-batches whose activations it held at once: counted from a
    /// Forward until its Backward, or, split, until its BackwardWeight (per `(micro-batch,
    /// chunk)` when interleaved, each holding one chunk's activations).
    pub peak_in_flight: Vec<usize>,
}

/// The bubble fraction theory gives with [`Costs::default`] (F = B = W, so a whole backward is
/// 2F): `(p-1)/(m+p-1)` for GPipe and 1F1B, `(p-1)/(v m+p-1)` for interleaved 1F1B and
/// `(p-1)/(3m+p-1)` for ZB-H1 (the paper's bubble `(p-1)(F+B-W)` against `m (F+B+W)` of work).
pub fn theoretical_bubble(kind: ScheduleKind, spec: PipelineSpec) -> f64 {
    theoretical_bubble_with(kind, spec, &Costs::default())
}

/// [`theoretical_bubble`] for other costs: GPipe and 1F1B idle `(p-1)(F+B+W)` per rank,
/// interleaved 1F1B `(p-1)(F+B+W)` against `v m (F+B+W)` of work (the chunks' costs), ZB-H1
/// `(p-1)(F+B-W)` (Qi et al., 2024, section 3.1); communication is taken as free.
pub fn theoretical_bubble_with(kind: ScheduleKind, spec: PipelineSpec, costs: &Costs) -> f64 {
    let (p, m) = (spec.stages as f64, spec.micro_batches as f64);
    let (f, b, w) = (costs.forward, costs.backward_input, costs.backward_weight);
    let (work, idle) = match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => (m * (f + b + w), (p - 1.0) * (f + b + w)),
        ScheduleKind::Interleaved => (
            spec.virtual_stages as f64 * m * (f + b + w),
            (p - 1.0) * (f + b + w),
        ),
        ScheduleKind::ZbH1 => (m * (f + b + w), (p - 1.0) * (f + b - w).max(0.0)),
    };
    if work + idle > 0.0 {
        idle / (work + idle)
    } else {
        0.0
    }
}

impl Schedule {
    /// Runs the lists with these costs (after [`Schedule::check`]'s static rules): the
    /// timeline, or [`ScheduleError::Deadlock`] naming each blocked rank, its position and
    /// the receive it waits on.
    pub fn simulate(&self, costs: &Costs) -> Result<Timeline, ScheduleError> {
        costs.validate()?;
        self.check_static()?;
        self.run(costs)
    }

    /// The simulation itself, on lists that passed the static rules.
    pub(crate) fn run(&self, costs: &Costs) -> Result<Timeline, ScheduleError> {
        let spec = &self.spec;
        let n = self.ranks.len();
        let mut pos = vec![0usize; n];
        let mut clock = vec![0.0f64; n];
        let mut spans: Vec<Vec<Span>> = self
            .ranks
            .iter()
            .map(|l| Vec::with_capacity(l.len()))
            .collect();
        // messages in flight per ordered pair: what, and when its send finished
        let mut wire: HashMap<(usize, usize), VecDeque<(Message, f64)>> = HashMap::new();
        loop {
            let mut progressed = false;
            for rank in 0..n {
                while let Some(a) = self.ranks[rank].get(pos[rank]) {
                    let start = clock[rank];
                    let end = if let Some(from) = a.recv_from() {
                        let queue = wire.entry((from, rank)).or_default();
                        let Some(&(msg, ready)) = queue.front() else {
                            break;
                        };
                        if Some(msg) != Message::of(spec, rank, a) {
                            return Err(ScheduleError::Invariant {
                                rank,
                                message: format!(
                                    "action {} ({a}) would take the next message from rank {from}, {msg:?}: a mismatch",
                                    pos[rank]
                                ),
                            });
                        }
                        queue.pop_front();
                        start.max(ready)
                    } else {
                        let end = start + costs.of(a);
                        if let Some(to) = a.send_to() {
                            let msg = Message::of(spec, rank, a).ok_or_else(|| {
                                ScheduleError::Invariant {
                                    rank,
                                    message: format!(
                                        "action {} ({a}) sends from the edge of the pipeline",
                                        pos[rank]
                                    ),
                                }
                            })?;
                            wire.entry((rank, to)).or_default().push_back((msg, end));
                        }
                        end
                    };
                    spans[rank].push(Span {
                        start,
                        end,
                        action: *a,
                    });
                    clock[rank] = end;
                    pos[rank] += 1;
                    progressed = true;
                }
            }
            if pos.iter().zip(&self.ranks).all(|(&p, l)| p == l.len()) {
                break;
            }
            if !progressed {
                let blocked = (0..n)
                    .filter_map(|rank| {
                        let index = pos[rank];
                        self.ranks[rank].get(index).map(|&action| Blocked {
                            rank,
                            index,
                            action,
                        })
                    })
                    .collect();
                return Err(ScheduleError::Deadlock { blocked });
            }
        }
        let makespan = clock.iter().copied().fold(0.0, f64::max);
        let busy: f64 = spans
            .iter()
            .flatten()
            .filter(|s| s.action.compute().is_some())
            .map(|s| s.end - s.start)
            .sum();
        let bubble_fraction = if makespan > 0.0 {
            1.0 - busy / (n as f64 * makespan)
        } else {
            0.0
        };
        Ok(Timeline {
            spec: *spec,
            spans,
            makespan,
            bubble_fraction,
            peak_in_flight: self.ranks.iter().map(|l| peak_in_flight(l)).collect(),
        })
    }
}

/// The most forwards whose activations a list holds at once (released by a whole Backward or
/// by a BackwardWeight).
pub fn peak_in_flight(list: &[Action]) -> usize {
    let (mut now, mut peak) = (0usize, 0usize);
    for a in list {
        match a {
            Action::Forward { .. } => {
                now += 1;
                peak = peak.max(now);
            }
            Action::Backward { .. } | Action::BackwardWeight { .. } => now = now.saturating_sub(1),
            _ => {}
        }
    }
    peak
}

impl Timeline {
    /// The compute spans of a rank (forwards and backwards, no communication).
    pub fn compute_spans(&self, rank: usize) -> impl Iterator<Item = &Span> {
        self.spans
            .get(rank)
            .into_iter()
            .flatten()
            .filter(|s| s.action.compute().is_some() && s.end > s.start)
    }

    /// One line per rank in time slots of the shortest compute span: each compute action's
    /// label ([`Action::label`]) in its first slot, `-` in the slots it goes on for, `.` where
    /// the rank idles, e.g. `rank 0: F0 F1 F2 F3 B0 -- F4 B1 --`.
    pub fn render_text(&self) -> String {
        let unit = self
            .spans
            .iter()
            .flatten()
            .filter(|s| s.action.compute().is_some() && s.end > s.start)
            .map(|s| s.end - s.start)
            .fold(f64::INFINITY, f64::min);
        let v = self.spec.virtual_stages;
        let width = (0..self.spans.len())
            .flat_map(|r| self.compute_spans(r))
            .map(|s| s.action.label(v).len())
            .max()
            .unwrap_or(1);
        let mut out = String::new();
        let digits = self.spans.len().saturating_sub(1).to_string().len();
        for rank in 0..self.spans.len() {
            let mut line = String::new();
            let mut slot = 0usize;
            if unit.is_finite() {
                for s in self.compute_spans(rank) {
                    let first = (s.start / unit).round() as usize;
                    let last = ((s.end / unit).round() as usize).max(first + 1);
                    for _ in slot..first {
                        let _ = write!(line, "{:<width$} ", ".");
                    }
                    let _ = write!(line, "{:<width$} ", s.action.label(v));
                    for _ in first + 1..last {
                        let _ = write!(line, "{} ", "-".repeat(width));
                    }
                    slot = last.max(slot);
                }
            }
            let _ = writeln!(out, "rank {rank:>digits$}: {}", line.trim_end());
        }
        out
    }
}
