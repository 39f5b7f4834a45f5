//! The errors of building, checking and simulating a pipeline schedule.

use super::Action;
use std::fmt;

/// A rank stuck on an action when the simulation can go no further.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// The rank.
    pub rank: usize,
    /// The position of the action in the rank's list.
    pub index: usize,
    /// The receive it waits on.
    pub action: Action,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} waits at action {} on {}",
            self.rank, self.index, self.action
        )
    }
}

fn list(blocked: &[Blocked]) -> String {
    blocked
        .iter()
        .map(Blocked::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Everything building, checking or simulating a schedule can fail with. Converts into
/// [`ParallelError`](crate::ParallelError).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// A schedule name [`ScheduleKind`](super::ScheduleKind) does not know.
    #[error("unknown pipeline schedule {got:?}: expected gpipe, 1f1b, interleaved or zb_h1")]
    UnknownKind {
        /// What was given.
        got: String,
    },
    /// A pipeline shape the schedule cannot run; `rule` names the factor and the rule.
    #[error("invalid pipeline spec ({field} = {got}): {rule}")]
    InvalidSpec {
        /// The factor (`stages`, `virtual_stages`, `micro_batches`).
        field: &'static str,
        /// Its value.
        got: usize,
        /// The rule it breaks, with the numbers.
        rule: String,
    },
    /// A cost that is negative or not finite.
    #[error("invalid pipeline cost {field} = {got}: expected a finite number >= 0")]
    InvalidCost {
        /// The field of [`Costs`](super::Costs).
        field: &'static str,
        /// Its value.
        got: f64,
    },
    /// A send with no receive of the same message on the peer.
    #[error(
        "rank {rank} action {index} ({action}) is an unmatched send: rank {peer} never receives it"
    )]
    UnmatchedSend {
        /// The sending rank.
        rank: usize,
        /// The position of the send in its list.
        index: usize,
        /// The send.
        action: Action,
        /// The rank it goes to.
        peer: usize,
    },
    /// A receive with no send of the same message on the peer.
    #[error(
        "rank {rank} action {index} ({action}) is an unmatched receive: rank {peer} never sends it"
    )]
    UnmatchedRecv {
        /// The receiving rank.
        rank: usize,
        /// The position of the receive in its list.
        index: usize,
        /// The receive.
        action: Action,
        /// The rank it comes from.
        peer: usize,
    },
    /// The receives from one peer are not in the order the peer sends them (a receive takes the
    /// next message from its peer, so the engine would report a mismatch).
    #[error(
        "messages from rank {from} to rank {to} are received out of order: message {position} \
         sent is {sent} (rank {from} action {send_index}), but rank {to} receives {received} \
         there (action {recv_index})"
    )]
    OrderMismatch {
        /// The sending rank.
        from: usize,
        /// The receiving rank.
        to: usize,
        /// The position in the pair's message sequence.
        position: usize,
        /// The send at that position.
        sent: Action,
        /// Its place in the sender's list.
        send_index: usize,
        /// The receive at that position.
        received: Action,
        /// Its place in the receiver's list.
        recv_index: usize,
    },
    /// A rule of every schedule broken on one rank (a missing or repeated compute, an order).
    #[error("rank {rank}: {message}")]
    Invariant {
        /// The rank.
        rank: usize,
        /// What is wrong, naming the micro-batch, the stage and the positions.
        message: String,
    },
    /// No rank can progress and some are not done.
    #[error("deadlock: {}", list(.blocked))]
    Deadlock {
        /// Each blocked rank, the action it waits on and its position.
        blocked: Vec<Blocked>,
    },
}
