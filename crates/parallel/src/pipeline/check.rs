//! The checker: the rules every schedule holds, on the action lists alone.

use super::build::Message;
use super::{Action, Schedule, ScheduleError};
use std::collections::HashMap;

/// Where the actions of one `(micro-batch, chunk)` sit in its rank's list.
#[derive(Debug, Default)]
struct Slots {
    forward: Vec<usize>,
    backward: Vec<usize>,
    input: Vec<usize>,
    weight: Vec<usize>,
    recv_act: Vec<usize>,
    send_act: Vec<usize>,
    recv_grad: Vec<usize>,
    send_grad: Vec<usize>,
}

fn broken(rank: usize, message: String) -> ScheduleError {
    ScheduleError::Invariant { rank, message }
}

/// The one position of `what`, or an error saying how many there were.
fn one(
    rank: usize,
    at: &[usize],
    what: &str,
    mb: usize,
    stage: usize,
) -> Result<usize, ScheduleError> {
    match at {
        [i] => Ok(*i),
        _ => {
            Err(broken(
                rank,
                format!(
                "micro-batch {mb} on stage {stage} has {} {what} actions, expected exactly one{}",
                at.len(),
                if at.is_empty() { String::new() } else { format!(" (at {at:?})") }
            ),
            ))
        }
    }
}

impl Schedule {
    /// The static rules (no simulation): shape, peers, message matching per ordered pair,
    /// the per-`(micro-batch, stage)` order and the ascending micro-batch order per chunk.
    pub(crate) fn check_static(&self) -> Result<(), ScheduleError> {
        let spec = &self.spec;
        spec.validate(self.kind)?;
        if self.ranks.len() != spec.stages {
            return Err(ScheduleError::InvalidSpec {
                field: "stages",
                got: spec.stages,
                rule: format!(
                    "the schedule has {} rank lists for {} stages",
                    self.ranks.len(),
                    spec.stages
                ),
            });
        }
        self.check_fields()?;
        self.check_messages()?;
        for rank in 0..spec.stages {
            self.check_rank(rank)?;
        }
        Ok(())
    }

    /// Every action names a real micro-batch and chunk, and every send and receive the rank
    /// holding the neighbouring stage.
    fn check_fields(&self) -> Result<(), ScheduleError> {
        let spec = &self.spec;
        let last = spec.model_stages() - 1;
        for (rank, list) in self.ranks.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                if a.mb() >= spec.micro_batches || a.chunk() >= spec.virtual_stages {
                    return Err(broken(
                        rank,
                        format!(
                            "action {i} ({a}) is outside micro-batches 0..{} and chunks 0..{}",
                            spec.micro_batches, spec.virtual_stages
                        ),
                    ));
                }
                let stage = spec.stage_of(rank, a.chunk());
                let expected = match a {
                    Action::SendActivation { to, .. } => {
                        Some((stage < last, stage + 1, *to, "sends an activation"))
                    }
                    Action::RecvActivation { from, .. } => Some((
                        stage > 0,
                        stage.wrapping_sub(1),
                        *from,
                        "receives an activation",
                    )),
                    Action::SendGrad { to, .. } => {
                        Some((stage > 0, stage.wrapping_sub(1), *to, "sends a gradient"))
                    }
                    Action::RecvGrad { from, .. } => {
                        Some((stage < last, stage + 1, *from, "receives a gradient"))
                    }
                    _ => None,
                };
                if let Some((exists, neighbour, peer, what)) = expected {
                    if !exists {
                        return Err(broken(
                            rank,
                            format!("action {i} ({a}): stage {stage} has no neighbour it {what} to or from"),
                        ));
                    }
                    let want = spec.holder(neighbour).0;
                    if peer != want {
                        return Err(broken(
                            rank,
                            format!("action {i} ({a}) names rank {peer}, but stage {neighbour} is on rank {want}"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Per ordered pair of ranks, the receives are the sends: the same messages (kind,
    /// micro-batch, stage), in the same order.
    fn check_messages(&self) -> Result<(), ScheduleError> {
        let spec = &self.spec;
        type Seq = Vec<(Message, usize, Action)>;
        let mut sends: HashMap<(usize, usize), Seq> = HashMap::new();
        let mut recvs: HashMap<(usize, usize), Seq> = HashMap::new();
        for (rank, list) in self.ranks.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                let Some(msg) = Message::of(spec, rank, a) else {
                    continue;
                };
                if let Some(to) = a.send_to() {
                    sends.entry((rank, to)).or_default().push((msg, i, *a));
                } else if let Some(from) = a.recv_from() {
                    recvs.entry((from, rank)).or_default().push((msg, i, *a));
                }
            }
        }
        // every message sent once is received once, and the other way round
        let count = |seq: &Seq| {
            let mut c: HashMap<Message, isize> = HashMap::new();
            for (m, _, _) in seq {
                *c.entry(*m).or_default() += 1;
            }
            c
        };
        let mut pairs: Vec<(usize, usize)> = sends.keys().chain(recvs.keys()).copied().collect();
        pairs.sort_unstable();
        pairs.dedup();
        let empty = Vec::new();
        for &(from, to) in &pairs {
            let s = sends.get(&(from, to)).unwrap_or(&empty);
            let r = recvs.get(&(from, to)).unwrap_or(&empty);
            let (mut cs, cr) = (count(s), count(r));
            for (m, n) in &cr {
                *cs.entry(*m).or_default() -= n;
            }
            if let Some((_, i, a)) = s.iter().find(|(m, _, _)| cs.get(m).is_some_and(|&d| d > 0)) {
                return Err(ScheduleError::UnmatchedSend {
                    rank: from,
                    index: *i,
                    action: *a,
                    peer: to,
                });
            }
            if let Some((_, i, a)) = r.iter().find(|(m, _, _)| cs.get(m).is_some_and(|&d| d < 0)) {
                return Err(ScheduleError::UnmatchedRecv {
                    rank: to,
                    index: *i,
                    action: *a,
                    peer: from,
                });
            }
            for (position, (x, y)) in s.iter().zip(r).enumerate() {
                if x.0 != y.0 {
                    return Err(ScheduleError::OrderMismatch {
                        from,
                        to,
                        position,
                        sent: x.2,
                        send_index: x.1,
                        received: y.2,
                        recv_index: y.1,
                    });
                }
            }
        }
        Ok(())
    }

    /// One rank's compute rules: one forward and one backward (whole, or input then weight)
    /// per `(micro-batch, chunk)`, each after the receive it needs and before the send of what
    /// it makes, and forwards and weight gradients in ascending micro-batch order per chunk.
    fn check_rank(&self, rank: usize) -> Result<(), ScheduleError> {
        let spec = &self.spec;
        let last = spec.model_stages() - 1;
        let list = &self.ranks[rank];
        let mut slots: HashMap<(usize, usize), Slots> = HashMap::new();
        for (i, a) in list.iter().enumerate() {
            let s = slots.entry((a.mb(), a.chunk())).or_default();
            match a {
                Action::Forward { .. } => s.forward.push(i),
                Action::Backward { .. } => s.backward.push(i),
                Action::BackwardInput { .. } => s.input.push(i),
                Action::BackwardWeight { .. } => s.weight.push(i),
                Action::RecvActivation { .. } => s.recv_act.push(i),
                Action::SendActivation { .. } => s.send_act.push(i),
                Action::RecvGrad { .. } => s.recv_grad.push(i),
                Action::SendGrad { .. } => s.send_grad.push(i),
            }
        }
        for chunk in 0..spec.virtual_stages {
            let stage = spec.stage_of(rank, chunk);
            for mb in 0..spec.micro_batches {
                let empty = Slots::default();
                let s = slots.get(&(mb, chunk)).unwrap_or(&empty);
                let fwd = one(rank, &s.forward, "Forward", mb, stage)?;
                // the backward that makes the input gradient, and the one that ends the weights'
                let bwd = if s.backward.is_empty() && !s.input.is_empty() {
                    let bi = one(rank, &s.input, "BackwardInput", mb, stage)?;
                    let bw = one(rank, &s.weight, "BackwardWeight", mb, stage)?;
                    if bw < bi {
                        return Err(broken(rank, format!(
                            "micro-batch {mb} on stage {stage}: BackwardWeight (action {bw}) before its BackwardInput (action {bi})"
                        )));
                    }
                    bi
                } else {
                    if !s.input.is_empty() || !s.weight.is_empty() {
                        return Err(broken(rank, format!(
                            "micro-batch {mb} on stage {stage} mixes a whole Backward with a split one (BackwardInput at {:?}, BackwardWeight at {:?})",
                            s.input, s.weight
                        )));
                    }
                    one(rank, &s.backward, "Backward or BackwardInput", mb, stage)?
                };
                let before = |what: &str, at: usize, later: &str, then: usize| {
                    if at < then {
                        Ok(())
                    } else {
                        Err(broken(rank, format!(
                            "micro-batch {mb} on stage {stage}: {what} (action {at}) must come before {later} (action {then})"
                        )))
                    }
                };
                before("the Forward", fwd, "its backward", bwd)?;
                if stage > 0 {
                    let r = one(rank, &s.recv_act, "RecvActivation", mb, stage)?;
                    before("RecvActivation", r, "its Forward", fwd)?;
                    let g = one(rank, &s.send_grad, "SendGrad", mb, stage)?;
                    before("the backward", bwd, "its SendGrad", g)?;
                }
                if stage < last {
                    let sa = one(rank, &s.send_act, "SendActivation", mb, stage)?;
                    before("the Forward", fwd, "its SendActivation", sa)?;
                    let r = one(rank, &s.recv_grad, "RecvGrad", mb, stage)?;
                    before("RecvGrad", r, "its backward", bwd)?;
                }
            }
            // forwards, and the weight gradients, in ascending micro-batch order on the chunk
            for (what, is) in [
                (
                    "forwards",
                    (|a: &Action| matches!(a, Action::Forward { .. })) as fn(&Action) -> bool,
                ),
                ("weight gradients", |a: &Action| {
                    matches!(a, Action::Backward { .. } | Action::BackwardWeight { .. })
                }),
            ] {
                let order: Vec<usize> = list
                    .iter()
                    .filter(|a| a.chunk() == chunk && is(a))
                    .map(Action::mb)
                    .collect();
                if let Some(w) = order.windows(2).find(|w| w[1] < w[0]) {
                    return Err(broken(rank, format!(
                        "the {what} of chunk {chunk} (stage {stage}) run micro-batch {} after {}: they must ascend (order {order:?})",
                        w[1], w[0]
                    )));
                }
            }
        }
        Ok(())
    }
}
