//! The circuit breaker: a pure state machine that turns detector verdicts into actions.
//!
//! The trainer does the I/O: it skips the update, loads the checkpoint, lowers the learning
//! rate or stops, as the [`Action`] says. The breaker's [`BreakerState`] is serialisable so a
//! checkpoint carries it, in particular the sample windows skipped after a rollback, which a
//! resumed run must skip too.
//!
//! On [`Action::Rollback`] the trainer restores every part of the checkpoint **except the
//! breaker** (whose state already records the new skip window), calls
//! [`crate::DetectorSet::rollback`], and filters [`BreakerState::skipped_sample_ids`] out of the
//! data from then on. The skip reaches the disk with the next checkpoint; a trainer that must
//! survive a crash in between saves one right after resuming.

use crate::detect::{Metric, Verdict};
use crate::event::Event;
use crate::{MonitorError, Result};
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};
use std::fmt;

/// What the trainer must do about the step it just computed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Action {
    /// Apply the update and go on.
    Continue,
    /// Discard this step's gradients: no optimizer update.
    SkipBatch,
    /// Discard this step, restore the checkpoint of `to_step` (everything except the breaker's
    /// own state, which already records the skip), and never train on `skip_samples` again.
    Rollback {
        /// Step of the last good checkpoint, supplied by the caller.
        to_step: u64,
        /// Sample ids of the batch (or batches) that produced the spike.
        skip_samples: Vec<u64>,
    },
    /// Apply the update, then multiply the learning rate by `lr_factor` for the next `steps`
    /// steps ([`CircuitBreaker::lr_factor`] tells the factor at any step).
    CoolDown {
        /// Factor applied to the scheduled learning rate.
        lr_factor: f64,
        /// Number of steps it lasts.
        steps: u64,
    },
    /// Stop the run with an error ([`MonitorError::Halted`]).
    Halt(HaltReason),
}

impl Action {
    fn severity(&self) -> u8 {
        match self {
            Action::Continue => 0,
            Action::CoolDown { .. } => 1,
            Action::SkipBatch => 2,
            Action::Rollback { .. } => 3,
            Action::Halt(_) => 4,
        }
    }

    /// True for [`Action::Continue`] and [`Action::CoolDown`]: this step's update is applied.
    pub fn applies_update(&self) -> bool {
        matches!(self, Action::Continue | Action::CoolDown { .. })
    }
}

/// Why the breaker halted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HaltReason {
    /// The step of the last event.
    pub step: u64,
    /// Number of events in the window.
    pub events: usize,
    /// Length of the window, in observed steps.
    pub within_steps: u64,
    /// The verdicts of the last event.
    pub last: Vec<Verdict>,
}

impl fmt::Display for HaltReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "circuit breaker halted the run at step {}: {} events within {} steps",
            self.step, self.events, self.within_steps
        )?;
        for v in &self.last {
            write!(f, "; {v}")?;
        }
        Ok(())
    }
}

/// How the breaker answers one kind of verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Response {
    /// Log an alert only; does not count towards the halt rule.
    Alert,
    /// [`Action::SkipBatch`].
    SkipBatch,
    /// [`Action::Rollback`] (or [`Action::SkipBatch`] when no checkpoint precedes the step).
    Rollback,
    /// [`Action::CoolDown`] with the policy's factor and length.
    CoolDown,
}

/// The breaker's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerPolicy {
    /// Answer to a non-finite loss or gradient norm (default skip the batch).
    pub on_non_finite: Response,
    /// Answer to a loss spike (default roll back).
    pub on_loss_spike: Response,
    /// Answer to a gradient-norm spike (default skip the batch).
    pub on_grad_spike: Response,
    /// Answer to a straggler (default alert).
    pub on_straggler: Response,
    /// Learning-rate factor of a cool-down (default 0.5).
    pub cooldown_lr_factor: f64,
    /// Length of a cool-down in steps (default 100).
    pub cooldown_steps: u64,
    /// Start a cool-down from the checkpoint step after every rollback (default true).
    pub cooldown_after_rollback: bool,
    /// Batches before the spike's own batch, since the checkpoint, to skip as well on a
    /// rollback (default 0: only the batch that produced the spike).
    pub skip_preceding_batches: usize,
    /// Halt after this many events (N) ... (default 5)
    pub halt_after_events: usize,
    /// ... within this many observed steps (M; default 1000). Observed steps count every call
    /// to [`CircuitBreaker::decide`], including steps replayed after a rollback.
    pub halt_window_steps: u64,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy {
            on_non_finite: Response::SkipBatch,
            on_loss_spike: Response::Rollback,
            on_grad_spike: Response::SkipBatch,
            on_straggler: Response::Alert,
            cooldown_lr_factor: 0.5,
            cooldown_steps: 100,
            cooldown_after_rollback: true,
            skip_preceding_batches: 0,
            halt_after_events: 5,
            halt_window_steps: 1000,
        }
    }
}

impl BreakerPolicy {
    fn validate(&self) -> Result<()> {
        if !(self.cooldown_lr_factor.is_finite() && self.cooldown_lr_factor > 0.0) {
            return Err(MonitorError::config(
                "cooldown_lr_factor",
                "a finite value > 0",
                self.cooldown_lr_factor,
            ));
        }
        if self.halt_after_events == 0 {
            return Err(MonitorError::config("halt_after_events", "at least 1", 0));
        }
        if self.halt_window_steps == 0 {
            return Err(MonitorError::config("halt_window_steps", "at least 1", 0));
        }
        Ok(())
    }

    /// The answer to a verdict.
    pub fn response(&self, v: &Verdict) -> Response {
        match v {
            Verdict::NonFinite { .. } => self.on_non_finite,
            Verdict::Spike {
                metric: Metric::Loss,
                ..
            } => self.on_loss_spike,
            Verdict::Spike { .. } => self.on_grad_spike,
            Verdict::Straggler { .. } => self.on_straggler,
        }
    }
}

/// Why a sample window is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum SkipCause {
    /// The batch was skipped in place ([`Action::SkipBatch`]).
    SkipBatch,
    /// The batch led to a rollback ([`Action::Rollback`]).
    Rollback,
}

/// Samples the data loader must not serve again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedWindow {
    /// The step whose batch produced the event.
    pub step: u64,
    /// Why.
    pub cause: SkipCause,
    /// The sample ids.
    pub sample_ids: Vec<u64>,
}

/// An active learning-rate cool-down: steps `from..until` train at `lr_factor` times the
/// schedule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CoolDownState {
    /// First step of the cool-down.
    pub from: u64,
    /// First step after it.
    pub until: u64,
    /// The factor.
    pub lr_factor: f64,
}

/// Everything the breaker remembers; serialise it into checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BreakerState {
    /// Steps observed so far, replays included.
    pub observed: u64,
    /// Observation counts (`observed` values) of the recent events, for the halt rule.
    pub event_marks: VecDeque<u64>,
    /// The cool-down in force, if any.
    pub cooldown: Option<CoolDownState>,
    /// Every skipped sample window, oldest first.
    pub skipped: Vec<SkippedWindow>,
    /// Number of rollbacks asked for.
    pub rollbacks: u64,
    /// Number of batches skipped in place.
    pub skipped_batches: u64,
    /// Set once the breaker halted; every later decision halts too.
    pub halted: Option<HaltReason>,
    /// The last batches' sample ids since the last checkpoint or rollback, newest last (kept
    /// only when `skip_preceding_batches > 0`).
    pub recent_batches: VecDeque<(u64, Vec<u64>)>,
}

impl BreakerState {
    /// Every sample id in a skipped window, for the data loader to filter.
    pub fn skipped_sample_ids(&self) -> HashSet<u64> {
        self.skipped
            .iter()
            .flat_map(|w| w.sample_ids.iter().copied())
            .collect()
    }
}

/// What the breaker learns about the step's batch from the trainer.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchInfo<'a> {
    /// The ids of the samples in this step's batch (all ranks, or this rank's: the trainer
    /// chooses, and must skip accordingly).
    pub sample_ids: &'a [u64],
    /// Step of the newest committed checkpoint that predates this step, if any.
    pub last_checkpoint_step: Option<u64>,
}

/// The breaker's answer for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Events to hand to every sink: one alert per verdict, then the action (if not continue)
    /// and a cool-down end, if one ended.
    pub events: Vec<Event>,
}

impl Decision {
    /// `Err(MonitorError::Halted)` for a halt, `Ok(action)` otherwise.
    pub fn into_result(self) -> Result<Action> {
        match self.action {
            Action::Halt(reason) => Err(MonitorError::Halted(Box::new(reason))),
            a => Ok(a),
        }
    }
}

/// Maps verdicts to actions (continue, skip the batch, roll back and skip the window, cool down,
/// halt after N events in M steps), remembering what it did.
///
/// ```
/// use kiln_monitor::{Action, BatchInfo, BreakerPolicy, CircuitBreaker, Metric, Verdict};
///
/// let mut breaker = CircuitBreaker::new(BreakerPolicy::default())?;
/// let spike = Verdict::Spike { metric: Metric::Loss, value: 9.0, median: 3.0, robust_sd: 0.1, threshold: 3.45 };
/// let ids = [300, 301, 302, 303];
/// let d = breaker.decide(30, &[spike], &BatchInfo { sample_ids: &ids, last_checkpoint_step: Some(25) });
/// assert_eq!(d.action, Action::Rollback { to_step: 25, skip_samples: ids.to_vec() });
/// assert!(breaker.breaker_state().skipped_sample_ids().contains(&302));
/// assert_eq!(breaker.lr_factor(26), 0.5); // cool-down after the rollback
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CircuitBreaker {
    policy: BreakerPolicy,
    state: BreakerState,
}

impl CircuitBreaker {
    /// A breaker with a validated policy and a fresh state.
    pub fn new(policy: BreakerPolicy) -> Result<Self> {
        Self::with_state(policy, BreakerState::default())
    }

    /// A breaker resuming from a saved state.
    pub fn with_state(policy: BreakerPolicy, state: BreakerState) -> Result<Self> {
        policy.validate()?;
        Ok(CircuitBreaker { policy, state })
    }

    /// The policy.
    pub fn policy(&self) -> &BreakerPolicy {
        &self.policy
    }

    /// The state, for checkpoints.
    pub fn breaker_state(&self) -> &BreakerState {
        &self.state
    }

    /// Replaces the state (loading a checkpoint).
    pub fn load_breaker_state(&mut self, state: BreakerState) {
        self.state = state;
    }

    /// Learning-rate factor at `step`: the cool-down's factor inside it, 1 outside.
    pub fn lr_factor(&self, step: u64) -> f64 {
        match self.state.cooldown {
            Some(c) if (c.from..c.until).contains(&step) => c.lr_factor,
            _ => 1.0,
        }
    }

    /// Tells the breaker a checkpoint of `step` was committed: batches before it are no longer
    /// candidates for a rollback window.
    pub fn checkpoint_saved(&mut self, step: u64) {
        self.state.recent_batches.retain(|(s, _)| *s > step);
    }

    /// Decides what to do about step `step` given the detectors' verdicts on it.
    ///
    /// Several verdicts on one step yield the most severe action (halt > rollback > skip >
    /// cool-down > continue) and count as one event for the halt rule; alert-only verdicts
    /// don't count. A rollback needs `batch.last_checkpoint_step` before `step`; without one it
    /// degrades to a skip.
    pub fn decide(&mut self, step: u64, verdicts: &[Verdict], batch: &BatchInfo<'_>) -> Decision {
        let st = &mut self.state;
        let p = &self.policy;
        st.observed += 1;
        let mut events: Vec<Event> = verdicts.iter().map(|v| Event::alert(step, v)).collect();

        if let Some(c) = st.cooldown {
            if step >= c.until {
                st.cooldown = None;
                events.push(Event::new(
                    crate::EventKind::CoolDownEnded,
                    step,
                    format!(
                        "cool-down over: learning rate back to x1 (was x{})",
                        c.lr_factor
                    ),
                ));
            }
        }
        if p.skip_preceding_batches > 0 {
            st.recent_batches
                .push_back((step, batch.sample_ids.to_vec()));
            while st.recent_batches.len() > p.skip_preceding_batches + 1 {
                st.recent_batches.pop_front();
            }
        }

        if let Some(reason) = &st.halted {
            let action = Action::Halt(reason.clone());
            events.extend(Event::for_action(step, &action));
            return Decision { action, events };
        }

        let response = verdicts
            .iter()
            .map(|v| p.response(v))
            .filter(|r| *r != Response::Alert)
            .max_by_key(|r| match r {
                Response::Alert => 0,
                Response::CoolDown => 1,
                Response::SkipBatch => 2,
                Response::Rollback => 3,
            });
        let Some(response) = response else {
            return Decision {
                action: Action::Continue,
                events,
            };
        };

        // the halt rule: N events within the last M observed steps
        st.event_marks.push_back(st.observed);
        while st
            .event_marks
            .front()
            .is_some_and(|&m| m + p.halt_window_steps <= st.observed)
        {
            st.event_marks.pop_front();
        }
        let action = if st.event_marks.len() >= p.halt_after_events {
            let reason = HaltReason {
                step,
                events: st.event_marks.len(),
                within_steps: p.halt_window_steps,
                last: verdicts.to_vec(),
            };
            st.halted = Some(reason.clone());
            Action::Halt(reason)
        } else {
            match response {
                Response::Rollback => match batch.last_checkpoint_step.filter(|&c| c < step) {
                    Some(to_step) => {
                        let mut skip_samples = Vec::new();
                        if p.skip_preceding_batches > 0 {
                            for (s, ids) in &st.recent_batches {
                                if *s > to_step {
                                    skip_samples.extend_from_slice(ids);
                                }
                            }
                            st.recent_batches.clear();
                        } else {
                            skip_samples.extend_from_slice(batch.sample_ids);
                        }
                        st.skipped.push(SkippedWindow {
                            step,
                            cause: SkipCause::Rollback,
                            sample_ids: skip_samples.clone(),
                        });
                        st.rollbacks += 1;
                        if p.cooldown_after_rollback && p.cooldown_steps > 0 {
                            st.cooldown = Some(CoolDownState {
                                from: to_step,
                                until: to_step + p.cooldown_steps,
                                lr_factor: p.cooldown_lr_factor,
                            });
                        }
                        Action::Rollback {
                            to_step,
                            skip_samples,
                        }
                    }
                    None => {
                        events.push(Event::new(
                            crate::EventKind::Info,
                            step,
                            format!(
                                "no checkpoint before step {step} to roll back to: skipping the \
                                 batch instead"
                            ),
                        ));
                        skip_batch(st, step, batch)
                    }
                },
                Response::SkipBatch => skip_batch(st, step, batch),
                Response::CoolDown => {
                    st.cooldown = Some(CoolDownState {
                        from: step + 1,
                        until: step + 1 + p.cooldown_steps,
                        lr_factor: p.cooldown_lr_factor,
                    });
                    Action::CoolDown {
                        lr_factor: p.cooldown_lr_factor,
                        steps: p.cooldown_steps,
                    }
                }
                Response::Alert => Action::Continue,
            }
        };
        debug_assert!(action.severity() > 0);
        events.extend(Event::for_action(step, &action));
        Decision { action, events }
    }
}

fn skip_batch(st: &mut BreakerState, step: u64, batch: &BatchInfo<'_>) -> Action {
    st.skipped_batches += 1;
    if let Some((s, _)) = st.recent_batches.back() {
        if *s == step {
            st.recent_batches.pop_back();
        }
    }
    if !batch.sample_ids.is_empty() {
        st.skipped.push(SkippedWindow {
            step,
            cause: SkipCause::SkipBatch,
            sample_ids: batch.sample_ids.to_vec(),
        });
    }
    Action::SkipBatch
}
/// The breaker as a kiln-state component: its [`BreakerState`] (skipped sample windows,
/// rollbacks, cool-down) as the metadata entry `breaker`.
impl kiln_state::Stateful for CircuitBreaker {
    fn state(&self) -> kiln_state::Result<kiln_state::StateDict> {
        let mut sd = kiln_state::StateDict::new();
        sd.set_meta("breaker", self.breaker_state())?;
        Ok(sd)
    }

    fn load_state(&mut self, state: kiln_state::StateDict) -> kiln_state::Result<()> {
        self.load_breaker_state(state.meta("breaker")?);
        Ok(())
    }
}
