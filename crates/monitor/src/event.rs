//! Events: alerts and circuit-breaker actions, logged by every sink beside the step records.

use crate::breaker::Action;
use crate::detect::Verdict;
use crate::jsonfloat;
use crate::metrics::unix_now;
use serde::{Deserialize, Serialize};
use std::fmt;

/// What an [`Event`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EventKind {
    /// A detector fired.
    Alert,
    /// The breaker skipped the batch: no update.
    SkipBatch,
    /// The breaker asked for a rollback to a checkpoint.
    Rollback,
    /// The breaker lowered the learning rate for a while.
    CoolDown,
    /// A cool-down ended; the learning rate is back to its schedule.
    CoolDownEnded,
    /// The breaker halted the run.
    Halt,
    /// The watchdog saw no step complete in time.
    Hang,
    /// Anything else worth a line in the log.
    Info,
}

impl EventKind {
    /// The snake-case name, as in the JSONL `"event"` key.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Alert => "alert",
            EventKind::SkipBatch => "skip_batch",
            EventKind::Rollback => "rollback",
            EventKind::CoolDown => "cool_down",
            EventKind::CoolDownEnded => "cool_down_ended",
            EventKind::Halt => "halt",
            EventKind::Hang => "hang",
            EventKind::Info => "info",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One alert or action. In JSONL it is a line with an `"event"` key (step records have none):
///
/// ```
/// use kiln_monitor::{Event, EventKind};
/// let mut e = Event::new(EventKind::Info, 12, "eval started");
/// e.time = None;
/// assert_eq!(
///     serde_json::to_string(&e)?,
///     r#"{"event":"info","step":12,"message":"eval started"}"#
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// What happened.
    #[serde(rename = "event")]
    pub kind: EventKind,
    /// The step it happened at.
    pub step: u64,
    /// Wall-clock time, seconds since the Unix epoch.
    #[serde(
        default,
        with = "jsonfloat::opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub time: Option<f64>,
    /// Human-readable description.
    pub message: String,
    /// The detector verdict behind it, for alerts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
    /// The breaker action, for actions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
}

impl Event {
    /// An event stamped with the current time.
    pub fn new(kind: EventKind, step: u64, message: impl Into<String>) -> Self {
        Event {
            kind,
            step,
            time: Some(unix_now()),
            message: message.into(),
            verdict: None,
            action: None,
        }
    }

    /// An alert for a detector verdict.
    pub fn alert(step: u64, verdict: &Verdict) -> Self {
        Event {
            verdict: Some(verdict.clone()),
            ..Event::new(EventKind::Alert, step, verdict.to_string())
        }
    }

    /// The event for a breaker action (`None` for [`Action::Continue`]).
    pub fn for_action(step: u64, action: &Action) -> Option<Self> {
        let (kind, message) = match action {
            Action::Continue => return None,
            Action::SkipBatch => (
                EventKind::SkipBatch,
                format!("skipping the batch of step {step}: no update"),
            ),
            Action::Rollback {
                to_step,
                skip_samples,
            } => (
                EventKind::Rollback,
                format!(
                    "rolling back to step {to_step} and skipping {} samples",
                    skip_samples.len()
                ),
            ),
            Action::CoolDown { lr_factor, steps } => (
                EventKind::CoolDown,
                format!("learning rate x{lr_factor} for {steps} steps"),
            ),
            Action::Halt(reason) => (EventKind::Halt, reason.to_string()),
        };
        Some(Event {
            action: Some(action.clone()),
            ..Event::new(kind, step, message)
        })
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] step {}: {}", self.kind, self.step, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::HaltReason;
    use crate::detect::Metric;

    #[test]
    fn action_events_have_the_documented_json_shape() {
        let spike = Verdict::Spike {
            metric: Metric::Loss,
            value: 9.0,
            median: 3.0,
            robust_sd: 0.5,
            threshold: 4.5,
        };
        let cases = [
            (Action::SkipBatch, r#"{"action":"skip_batch"}"#),
            (
                Action::Rollback {
                    to_step: 25,
                    skip_samples: vec![120, 121],
                },
                r#"{"action":"rollback","to_step":25,"skip_samples":[120,121]}"#,
            ),
            (
                Action::CoolDown {
                    lr_factor: 0.5,
                    steps: 100,
                },
                r#"{"action":"cool_down","lr_factor":0.5,"steps":100}"#,
            ),
            (
                Action::Halt(HaltReason {
                    step: 40,
                    events: 5,
                    within_steps: 1000,
                    last: vec![Verdict::NonFinite {
                        metric: Metric::GradNorm,
                        value: f64::INFINITY,
                    }],
                }),
                r#"{"action":"halt","step":40,"events":5,"within_steps":1000,"last":[{"kind":"non_finite","metric":"grad_norm","value":"Infinity"}]}"#,
            ),
        ];
        for (action, json) in cases {
            let mut e = Event::for_action(7, &action).unwrap();
            e.time = None;
            let line = serde_json::to_string(&e).unwrap();
            assert!(
                line.starts_with(&format!(r#"{{"event":"{}","step":7,"#, e.kind)),
                "{line}"
            );
            assert!(line.ends_with(&format!(r#""action":{json}}}"#)), "{line}");
            let back: Event = serde_json::from_str(&line).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), line);
        }
        assert!(Event::for_action(7, &Action::Continue).is_none());
        let mut a = Event::alert(3, &spike);
        a.time = None;
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#"{"event":"alert","step":3,"message":"loss spike: 9.000000 above threshold 4.500000 (median 3.000000, robust sd 0.500000)","verdict":{"kind":"spike","metric":"loss","value":9.0,"median":3.0,"robust_sd":0.5,"threshold":4.5}}"#
        );
    }
}
