//! Circuit-breaker transitions: rollback windows, skips, cool-downs, the halt rule (against a
//! straightforward reference), and state that survives serialisation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_monitor::{
    Action, BatchInfo, BreakerPolicy, BreakerState, CircuitBreaker, EventKind, Metric,
    MonitorError, Response, SkipCause, Verdict,
};
use rand::{Rng, SeedableRng};

fn spike() -> Verdict {
    Verdict::Spike {
        metric: Metric::Loss,
        value: 9.0,
        median: 3.0,
        robust_sd: 0.1,
        threshold: 3.45,
    }
}

fn nan() -> Verdict {
    Verdict::NonFinite {
        metric: Metric::Loss,
        value: f64::NAN,
    }
}

fn straggler() -> Verdict {
    Verdict::Straggler {
        rank: 1,
        step_time_s: 2.0,
        median_s: 1.0,
        ratio: 2.0,
    }
}

fn ids(step: u64) -> Vec<u64> {
    (step * 4..step * 4 + 4).collect()
}

fn batch(ids: &[u64], ckpt: Option<u64>) -> BatchInfo<'_> {
    BatchInfo {
        sample_ids: ids,
        last_checkpoint_step: ckpt,
    }
}

#[test]
fn loss_spike_rolls_back_to_the_checkpoint_and_skips_the_batch() {
    let mut b = CircuitBreaker::new(BreakerPolicy::default()).unwrap();
    for s in 26..30 {
        assert_eq!(
            b.decide(s, &[], &batch(&ids(s), Some(25))).action,
            Action::Continue
        );
    }
    let d = b.decide(30, &[spike()], &batch(&ids(30), Some(25)));
    assert_eq!(
        d.action,
        Action::Rollback {
            to_step: 25,
            skip_samples: vec![120, 121, 122, 123]
        }
    );
    let kinds: Vec<EventKind> = d.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [EventKind::Alert, EventKind::Rollback]);
    assert_eq!(d.events[1].action.as_ref(), Some(&d.action));
    let st = b.breaker_state();
    assert_eq!(st.rollbacks, 1);
    assert_eq!(st.skipped.len(), 1);
    assert_eq!(st.skipped[0].step, 30);
    assert_eq!(st.skipped[0].cause, SkipCause::Rollback);
    assert_eq!(st.skipped_sample_ids(), [120, 121, 122, 123].into());
    // the cool-down starts at the checkpoint step the run resumes from
    assert_eq!(b.lr_factor(24), 1.0);
    assert_eq!(b.lr_factor(25), 0.5);
    assert_eq!(b.lr_factor(124), 0.5);
    assert_eq!(b.lr_factor(125), 1.0);
    assert!(!d.action.applies_update());
}

#[test]
fn rollback_can_skip_the_batches_since_the_checkpoint() {
    let policy = BreakerPolicy {
        skip_preceding_batches: 2,
        ..BreakerPolicy::default()
    };
    let mut b = CircuitBreaker::new(policy).unwrap();
    for s in 21..=25 {
        b.decide(s, &[], &batch(&ids(s), Some(20)));
    }
    b.checkpoint_saved(25);
    b.decide(26, &[], &batch(&ids(26), Some(25)));
    let d = b.decide(27, &[spike()], &batch(&ids(27), Some(25)));
    // two preceding batches allowed, but only step 26 is after the checkpoint
    let mut want = ids(26);
    want.extend(ids(27));
    assert_eq!(
        d.action,
        Action::Rollback {
            to_step: 25,
            skip_samples: want
        }
    );

    // after the rollback the replay starts afresh: 26, 27 (new data), 28, then a spike at 29
    for s in 26..=28 {
        b.decide(s, &[], &batch(&ids(s + 100), Some(25)));
    }
    let d = b.decide(29, &[spike()], &batch(&ids(29 + 100), Some(25)));
    let mut want = ids(127);
    want.extend(ids(128));
    want.extend(ids(129));
    assert_eq!(
        d.action,
        Action::Rollback {
            to_step: 25,
            skip_samples: want
        }
    );
}

#[test]
fn no_checkpoint_degrades_a_rollback_to_a_skip() {
    let mut b = CircuitBreaker::new(BreakerPolicy::default()).unwrap();
    let d = b.decide(5, &[spike()], &batch(&ids(5), None));
    assert_eq!(d.action, Action::SkipBatch);
    assert_eq!(
        d.events.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [EventKind::Alert, EventKind::Info, EventKind::SkipBatch]
    );
    // a checkpoint at (or after) the spike step is not a rollback target either
    let d = b.decide(8, &[spike()], &batch(&ids(8), Some(8)));
    assert_eq!(d.action, Action::SkipBatch);
    assert_eq!(b.breaker_state().rollbacks, 0);
}

#[test]
fn non_finite_skips_the_batch() {
    let mut b = CircuitBreaker::new(BreakerPolicy::default()).unwrap();
    let d = b.decide(12, &[nan()], &batch(&ids(12), Some(10)));
    assert_eq!(d.action, Action::SkipBatch);
    assert_eq!(
        d.events.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [EventKind::Alert, EventKind::SkipBatch]
    );
    assert_eq!(b.breaker_state().skipped_batches, 1);
    assert_eq!(b.breaker_state().skipped[0].cause, SkipCause::SkipBatch);
    assert_eq!(b.breaker_state().skipped[0].sample_ids, ids(12));
    assert_eq!(b.lr_factor(13), 1.0);
}

#[test]
fn the_most_severe_answer_wins_and_alerts_do_not_count() {
    let mut b = CircuitBreaker::new(BreakerPolicy::default()).unwrap();
    let d = b.decide(
        40,
        &[straggler(), nan(), spike()],
        &batch(&ids(40), Some(30)),
    );
    assert!(matches!(d.action, Action::Rollback { to_step: 30, .. }));
    assert_eq!(d.events.len(), 4);
    assert_eq!(b.breaker_state().event_marks.len(), 1);
    // a straggler alone is an alert: continue, and never a halt
    for s in 41..100 {
        let d = b.decide(s, &[straggler()], &batch(&ids(s), Some(30)));
        assert_eq!(d.action, Action::Continue);
        assert_eq!(d.events.len(), 1);
    }
    assert_eq!(b.breaker_state().event_marks.len(), 1);
}

#[test]
fn grad_spike_cool_down_expires() {
    let policy = BreakerPolicy {
        on_grad_spike: Response::CoolDown,
        cooldown_lr_factor: 0.25,
        cooldown_steps: 3,
        ..BreakerPolicy::default()
    };
    let mut b = CircuitBreaker::new(policy).unwrap();
    let g = Verdict::Spike {
        metric: Metric::GradNorm,
        value: 10.0,
        median: 1.0,
        robust_sd: 0.1,
        threshold: 2.0,
    };
    let d = b.decide(10, &[g], &batch(&ids(10), Some(5)));
    assert_eq!(
        d.action,
        Action::CoolDown {
            lr_factor: 0.25,
            steps: 3
        }
    );
    assert!(d.action.applies_update());
    let factors: Vec<f64> = (10..15).map(|s| b.lr_factor(s)).collect();
    assert_eq!(factors, [1.0, 0.25, 0.25, 0.25, 1.0]);
    for s in 11..=13 {
        let d = b.decide(s, &[], &batch(&ids(s), Some(5)));
        assert!(d.events.is_empty(), "step {s}: {:?}", d.events);
        assert!(b.breaker_state().cooldown.is_some());
    }
    let d = b.decide(14, &[], &batch(&ids(14), Some(5)));
    assert_eq!(d.action, Action::Continue);
    assert_eq!(d.events.len(), 1);
    assert_eq!(d.events[0].kind, EventKind::CoolDownEnded);
    assert!(b.breaker_state().cooldown.is_none());
}

#[test]
fn n_events_in_m_steps_halt() {
    let policy = BreakerPolicy {
        halt_after_events: 3,
        halt_window_steps: 10,
        ..BreakerPolicy::default()
    };
    let mut b = CircuitBreaker::new(policy).unwrap();
    // events 10 steps apart never make 3 within a window of 10
    for s in 0..60u64 {
        let v = if s % 10 == 0 { vec![nan()] } else { vec![] };
        let d = b.decide(s, &v, &batch(&ids(s), None));
        assert!(!matches!(d.action, Action::Halt(_)), "step {s}");
    }
    // three within 10 do
    let mut last = None;
    for s in [61u64, 64, 67] {
        last = Some(b.decide(s, &[nan()], &batch(&ids(s), None)));
    }
    let d = last.unwrap();
    let Action::Halt(reason) = &d.action else {
        panic!("{:?}", d.action)
    };
    assert_eq!(
        (reason.step, reason.events, reason.within_steps),
        (67, 3, 10)
    );
    assert_eq!(d.events.last().unwrap().kind, EventKind::Halt);
    // halted for good
    let d = b.decide(68, &[], &batch(&ids(68), None));
    let err = d.into_result().unwrap_err();
    assert!(matches!(err, MonitorError::Halted(_)));
    assert!(
        err.to_string()
            .starts_with("circuit breaker halted the run at step 67: 3 events within 10 steps"),
        "{err}"
    );
}

#[test]
fn halt_rule_matches_a_reference_count() {
    let (n, m) = (4usize, 25u64);
    let policy = BreakerPolicy {
        halt_after_events: n,
        halt_window_steps: m,
        on_loss_spike: Response::SkipBatch,
        ..BreakerPolicy::default()
    };
    for seed in 0..20 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut b = CircuitBreaker::new(policy).unwrap();
        let mut event_ticks: Vec<u64> = Vec::new();
        for tick in 1..=400u64 {
            let ev = rng.gen_bool(0.08);
            let v = if ev { vec![spike()] } else { vec![] };
            let d = b.decide(tick, &v, &batch(&[], None));
            if ev {
                event_ticks.push(tick);
            }
            // reference: events among the last m observed steps, counted when one occurs
            let recent = event_ticks.iter().filter(|&&t| t + m > tick).count();
            let should_halt = ev && recent >= n;
            if should_halt {
                assert!(
                    matches!(d.action, Action::Halt(_)),
                    "seed {seed} tick {tick}"
                );
                break;
            }
            assert!(
                !matches!(d.action, Action::Halt(_)),
                "seed {seed} tick {tick}"
            );
        }
    }
}

#[test]
fn state_survives_json_and_a_restored_breaker_decides_the_same() {
    let mut a = CircuitBreaker::new(BreakerPolicy::default()).unwrap();
    a.decide(30, &[spike()], &batch(&ids(30), Some(25)));
    a.decide(26, &[nan()], &batch(&ids(26), Some(25)));
    let json = serde_json::to_string(a.breaker_state()).unwrap();
    let state: BreakerState = serde_json::from_str(&json).unwrap();
    assert_eq!(&state, a.breaker_state());
    let mut b = CircuitBreaker::with_state(BreakerPolicy::default(), state).unwrap();
    assert_eq!(
        b.breaker_state().skipped_sample_ids(),
        a.breaker_state().skipped_sample_ids()
    );
    for s in 27..200u64 {
        let v = match s % 37 {
            0 => vec![spike()],
            5 => vec![nan()],
            _ => vec![],
        };
        let da = a.decide(s, &v, &batch(&ids(s), Some(s - 3)));
        let db = b.decide(s, &v, &batch(&ids(s), Some(s - 3)));
        assert_eq!(da.action, db.action, "step {s}");
        assert_eq!(da.events.len(), db.events.len());
        assert_eq!(a.lr_factor(s), b.lr_factor(s));
    }
    assert_eq!(a.breaker_state(), b.breaker_state());
}

#[test]
fn invalid_policies_are_rejected() {
    for p in [
        BreakerPolicy {
            cooldown_lr_factor: 0.0,
            ..BreakerPolicy::default()
        },
        BreakerPolicy {
            halt_after_events: 0,
            ..BreakerPolicy::default()
        },
        BreakerPolicy {
            halt_window_steps: 0,
            ..BreakerPolicy::default()
        },
    ] {
        let e = CircuitBreaker::new(p).unwrap_err();
        assert!(e.to_string().starts_with("invalid "), "{e}");
    }
}
