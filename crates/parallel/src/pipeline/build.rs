//! The schedules' generators: each rank's order of compute actions, then the sends and
//! receives placed around them ([`wire`]).

use super::{Action, PipelineSpec, ScheduleError, ScheduleKind};
use std::collections::HashMap;

/// A message between two ranks: its kind, micro-batch and the model stage that sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Message {
    /// The output of `stage` for `mb`, going to `stage + 1`.
    Activation { mb: usize, stage: usize },
    /// The input gradient of `stage` for `mb`, going to `stage - 1`.
    Grad { mb: usize, stage: usize },
}

impl Message {
    /// The message a send or receive on `rank` moves, with its peer; `None` for compute.
    pub(crate) fn of(spec: &PipelineSpec, rank: usize, action: &Action) -> Option<Message> {
        let stage = spec.stage_of(rank, action.chunk());
        let mb = action.mb();
        match action {
            Action::SendActivation { .. } => Some(Message::Activation { mb, stage }),
            Action::RecvActivation { .. } => Some(Message::Activation {
                mb,
                stage: stage.checked_sub(1)?,
            }),
            Action::SendGrad { .. } => Some(Message::Grad { mb, stage }),
            Action::RecvGrad { .. } => Some(Message::Grad {
                mb,
                stage: stage + 1,
            }),
            _ => None,
        }
    }
}

/// Forward of virtual micro-batch `k` on a rank (Megatron's interleaved numbering): the
/// micro-batch and chunk.
fn interleaved_id(spec: &PipelineSpec, k: usize, forward: bool) -> (usize, usize) {
    let (p, v) = (spec.stages, spec.virtual_stages);
    let in_group = k % (p * v);
    let mut chunk = in_group / p;
    if !forward {
        chunk = v - 1 - chunk;
    }
    let mb = (k / (p * v)) * p + k % p;
    (mb, chunk)
}

/// Each rank's compute actions in order, for `kind`.
pub(crate) fn compute_orders(kind: ScheduleKind, spec: &PipelineSpec) -> Vec<Vec<Action>> {
    let (p, m) = (spec.stages, spec.micro_batches);
    let f = |mb| Action::Forward { mb, chunk: 0 };
    let b = |mb| Action::Backward { mb, chunk: 0 };
    (0..p)
        .map(|rank| match kind {
            ScheduleKind::GPipe => (0..m).map(f).chain((0..m).map(b)).collect(),
            ScheduleKind::OneFOneB => one_f_one_b(p, m, rank, f, b),
            ScheduleKind::ZbH1 => zb_h1(p, m, rank),
            ScheduleKind::Interleaved => interleaved(spec, rank),
        })
        .collect()
}

/// 1F1B on `rank`: `p - rank - 1` warm-up forwards, then one forward and one backward at a
/// time, then the cool-down backwards.
fn one_f_one_b(
    p: usize,
    m: usize,
    rank: usize,
    f: impl Fn(usize) -> Action,
    b: impl Fn(usize) -> Action,
) -> Vec<Action> {
    let warmup = (p - rank - 1).min(m);
    let steady = m - warmup;
    let mut out: Vec<Action> = (0..warmup).map(&f).collect();
    for i in 0..steady {
        out.push(f(warmup + i));
        out.push(b(i));
    }
    out.extend((steady..m).map(b));
    out
}

/// ZB-H1 on `rank`: 1F1B's forwards and input gradients; the weight gradient of the oldest
/// pending micro-batch follows each input gradient except the first `rank` ones, whose weight
/// gradients run at the end, in the bubble 1F1B leaves in its cool-down (the paper's Figure 3,
/// DeepSpeed's `ZeroBubbleH1Pipeline`).
fn zb_h1(p: usize, m: usize, rank: usize) -> Vec<Action> {
    let f = |mb| Action::Forward { mb, chunk: 0 };
    let bi = |mb| Action::BackwardInput { mb, chunk: 0 };
    let mut out = Vec::with_capacity(3 * m);
    let (mut inputs, mut weights) = (0, 0);
    for a in one_f_one_b(p, m, rank, f, bi) {
        out.push(a);
        if matches!(a, Action::BackwardInput { .. }) {
            inputs += 1;
            if inputs > rank {
                out.push(Action::BackwardWeight {
                    mb: weights,
                    chunk: 0,
                });
                weights += 1;
            }
        }
    }
    out.extend((weights..m).map(|mb| Action::BackwardWeight { mb, chunk: 0 }));
    out
}

/// Megatron-LM's `forward_backward_pipelining_with_interleaving` on `rank`: `2 (p - rank - 1) +
/// (v - 1) p` warm-up forwards (all of them when `m == p`), then one forward and one backward
/// at a time, then the cool-down backwards; virtual micro-batch `k` runs chunk
/// `(k mod pv) / p` forward (reversed backward) on micro-batch `(k / pv) p + k mod p`.
fn interleaved(spec: &PipelineSpec, rank: usize) -> Vec<Action> {
    let (p, v, m) = (spec.stages, spec.virtual_stages, spec.micro_batches);
    let total = m * v;
    let warmup = if m == p {
        total
    } else {
        (2 * (p - rank - 1) + (v - 1) * p).min(total)
    };
    let fwd = |k| {
        let (mb, chunk) = interleaved_id(spec, k, true);
        Action::Forward { mb, chunk }
    };
    let bwd = |k| {
        let (mb, chunk) = interleaved_id(spec, k, false);
        Action::Backward { mb, chunk }
    };
    let steady = total - warmup;
    let mut out: Vec<Action> = (0..warmup).map(fwd).collect();
    for k in 0..steady {
        out.push(fwd(warmup + k));
        out.push(bwd(k));
    }
    out.extend((steady..total).map(bwd));
    out
}

/// Places the communication around each rank's compute order: a send right after the compute
/// that produces it (sends are eager), and each receive as late as possible: just before the
/// compute that needs it, together with every earlier message of the same peer not received
/// yet (a receive takes the next message from its peer, so a rank receives in its peer's send
/// order).
pub(crate) fn wire(
    spec: &PipelineSpec,
    compute: &[Vec<Action>],
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    let last = spec.model_stages() - 1;
    // each rank's list with its sends, and each ordered pair's messages in send order
    let mut with_sends: Vec<Vec<Action>> = Vec::with_capacity(compute.len());
    let mut sent: HashMap<(usize, usize), Vec<(Message, Action)>> = HashMap::new();
    for (rank, list) in compute.iter().enumerate() {
        let mut out = Vec::with_capacity(list.len() * 3);
        for &a in list {
            out.push(a);
            let stage = spec.stage_of(rank, a.chunk());
            let (mb, chunk) = (a.mb(), a.chunk());
            let send = match a {
                Action::Forward { .. } if stage < last => {
                    let (to, _) = spec.holder(stage + 1);
                    Some(Action::SendActivation { mb, chunk, to })
                }
                Action::Backward { .. } | Action::BackwardInput { .. } if stage > 0 => {
                    let (to, _) = spec.holder(stage - 1);
                    Some(Action::SendGrad { mb, chunk, to })
                }
                _ => None,
            };
            if let Some(s) = send {
                let to = s.send_to().unwrap_or(rank);
                let msg = Message::of(spec, rank, &s).ok_or_else(|| internal(rank, &s))?;
                // the receive the peer posts for it
                let (_, peer_chunk) = spec.holder(match msg {
                    Message::Activation { stage, .. } => stage + 1,
                    Message::Grad { stage, .. } => stage - 1,
                });
                let recv = match msg {
                    Message::Activation { mb, .. } => Action::RecvActivation {
                        mb,
                        chunk: peer_chunk,
                        from: rank,
                    },
                    Message::Grad { mb, .. } => Action::RecvGrad {
                        mb,
                        chunk: peer_chunk,
                        from: rank,
                    },
                };
                sent.entry((rank, to)).or_default().push((msg, recv));
                out.push(s);
            }
        }
        with_sends.push(out);
    }
    // receives: before each compute that needs a message, the peer's messages up to that one
    let mut received: HashMap<(usize, usize), usize> = HashMap::new();
    let mut ranks = Vec::with_capacity(with_sends.len());
    for (rank, list) in with_sends.iter().enumerate() {
        let mut out = Vec::with_capacity(list.len() * 4 / 3 + 1);
        for &a in list {
            let stage = spec.stage_of(rank, a.chunk());
            let mb = a.mb();
            let need = match a {
                Action::Forward { .. } if stage > 0 => Some((
                    spec.holder(stage - 1).0,
                    Message::Activation {
                        mb,
                        stage: stage - 1,
                    },
                )),
                Action::Backward { .. } | Action::BackwardInput { .. } if stage < last => Some((
                    spec.holder(stage + 1).0,
                    Message::Grad {
                        mb,
                        stage: stage + 1,
                    },
                )),
                _ => None,
            };
            if let Some((peer, msg)) = need {
                let queue = sent.get(&(peer, rank)).map(Vec::as_slice).unwrap_or(&[]);
                let at = queue
                    .iter()
                    .position(|(m, _)| *m == msg)
                    .ok_or_else(|| internal(rank, &a))?;
                let next = received.entry((peer, rank)).or_insert(0);
                while *next <= at {
                    out.push(queue[*next].1);
                    *next += 1;
                }
            }
            out.push(a);
        }
        ranks.push(out);
    }
    Ok(ranks)
}

fn internal(rank: usize, a: &Action) -> ScheduleError {
    ScheduleError::Invariant {
        rank,
        message: format!("the generator found no message for {a}"),
    }
}
