//! The pipeline schedules against their theory: every generated schedule passes the checker and
//! the simulator for pp 1..=8 over a range of micro-batches (and 2..=4 virtual stages), its
//! simulated bubble is the closed form, its activations in flight are 1F1B's or GPipe's, and
//! hand-broken schedules (a missing receive, a reordered pair, a cycle of receives) are caught.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_parallel::pipeline::{
    theoretical_bubble, theoretical_bubble_with, Action, Costs, PipelineSpec, Schedule,
    ScheduleError, ScheduleKind,
};

fn spec(stages: usize, virtual_stages: usize, micro_batches: usize) -> PipelineSpec {
    PipelineSpec {
        stages,
        virtual_stages,
        micro_batches,
    }
}

/// Every shape the tests sweep for `kind`: pp 1..=8 (2..=8 interleaved), and micro-batches
/// from 1 (or pp) up to 3 pp + 2 (multiples of pp interleaved).
fn shapes(kind: ScheduleKind) -> Vec<PipelineSpec> {
    let mut out = Vec::new();
    for p in 1..=8 {
        if kind == ScheduleKind::Interleaved {
            if p < 2 {
                continue;
            }
            for v in 2..=4 {
                for m in (p..=4 * p).step_by(p) {
                    out.push(spec(p, v, m));
                }
            }
        } else {
            for m in 1..=3 * p + 2 {
                out.push(spec(p, 1, m));
            }
        }
    }
    out
}

#[test]
fn every_schedule_checks_and_simulates_over_the_sweep() {
    let mut n = 0;
    for kind in ScheduleKind::ALL {
        for s in shapes(kind) {
            let schedule = Schedule::build(kind, s).unwrap_or_else(|e| panic!("{kind} {s:?}: {e}"));
            schedule.check().unwrap();
            let t = schedule.simulate(&Costs::default()).unwrap();
            // every compute action ran once: (F + B + W) per micro-batch and chunk per rank
            let busy: f64 = (0..s.stages)
                .flat_map(|r| {
                    t.compute_spans(r)
                        .map(|sp| sp.end - sp.start)
                        .collect::<Vec<_>>()
                })
                .sum();
            let want = 3.0 * (s.stages * s.virtual_stages * s.micro_batches) as f64;
            assert_eq!(busy, want, "{kind} {s:?}");
            n += 1;
        }
    }
    println!("{n} schedules checked and simulated");
}

fn timeline(kind: ScheduleKind, s: PipelineSpec, costs: &Costs) -> kiln_parallel::Timeline {
    Schedule::build(kind, s)
        .unwrap()
        .simulate(costs)
        .unwrap_or_else(|e| panic!("{kind} {s:?}: {e}"))
}

#[test]
fn the_simulated_bubble_is_the_closed_form() {
    // the closed forms, computed here from p, m and v alone
    let closed = |kind: ScheduleKind, s: PipelineSpec| {
        let (p, m, v) = (
            s.stages as f64,
            s.micro_batches as f64,
            s.virtual_stages as f64,
        );
        match kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => (p - 1.0) / (m + p - 1.0),
            ScheduleKind::Interleaved => (p - 1.0) / (v * m + p - 1.0),
            ScheduleKind::ZbH1 => (p - 1.0) / (3.0 * m + p - 1.0),
        }
    };
    let mut worst_zb_short = 0.0f64;
    for kind in ScheduleKind::ALL {
        for s in shapes(kind) {
            let t = timeline(kind, s, &Costs::default());
            let want = closed(kind, s);
            assert!(
                (theoretical_bubble(kind, s) - want).abs() < 1e-15,
                "{kind} {s:?}"
            );
            // busy time is every rank's (F + B + W) per micro-batch and chunk
            let busy = 3.0 * (s.virtual_stages * s.micro_batches) as f64;
            assert!((t.bubble_fraction - (1.0 - busy / t.makespan)).abs() < 1e-12);
            if kind == ScheduleKind::ZbH1 && s.micro_batches < s.stages {
                // too few micro-batches to defer every weight gradient into the cool-down:
                // between ZB-H1's figure and 1F1B's
                assert!(t.bubble_fraction > want, "{s:?}");
                let one_f_one_b = (s.stages as f64 - 1.0) / (s.micro_batches + s.stages - 1) as f64;
                assert!(t.bubble_fraction < one_f_one_b + 1e-12, "{s:?}");
                worst_zb_short = worst_zb_short.max(t.bubble_fraction - want);
            } else {
                assert!(
                    (t.bubble_fraction - want).abs() < 1e-12,
                    "{kind} {s:?}: simulated {} against {want}",
                    t.bubble_fraction
                );
            }
        }
    }
    println!("ZB-H1 with m < p is above its figure by at most {worst_zb_short:.4}");
    // GPipe's and 1F1B's bubble does not depend on the costs; ZB-H1's is (p-1)(F+B-W) while
    // W <= F + B fills the cool-down
    let costs = Costs {
        forward: 2.0,
        backward_input: 3.0,
        backward_weight: 1.5,
        p2p: 0.0,
    };
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
    ] {
        for p in 1..=6 {
            for m in p..=3 * p {
                let s = spec(p, 1, m);
                let t = timeline(kind, s, &costs);
                let want = theoretical_bubble_with(kind, s, &costs);
                assert!(
                    (t.bubble_fraction - want).abs() < 1e-12,
                    "{kind} {s:?}: {} vs {want}",
                    t.bubble_fraction
                );
            }
        }
    }
    // p = 4, m = 8 (v = 2 interleaved), the figures the documentation quotes
    for (kind, v, want) in [
        (ScheduleKind::GPipe, 1, 3.0 / 11.0),
        (ScheduleKind::OneFOneB, 1, 3.0 / 11.0),
        (ScheduleKind::Interleaved, 2, 3.0 / 19.0),
        (ScheduleKind::ZbH1, 1, 3.0 / 27.0),
    ] {
        let t = timeline(kind, spec(4, v, 8), &Costs::default());
        println!(
            "{kind:<11} p=4 m=8 v={v}: bubble {:.4} (theory {want:.4})",
            t.bubble_fraction
        );
        assert!((t.bubble_fraction - want).abs() < 1e-12);
    }
}

#[test]
fn send_costs_lengthen_the_step() {
    let s = spec(4, 1, 8);
    let free = timeline(ScheduleKind::OneFOneB, s, &Costs::default());
    let slow = timeline(
        ScheduleKind::OneFOneB,
        s,
        &Costs {
            p2p: 0.5,
            ..Costs::default()
        },
    );
    // the first micro-batch's forward crosses three links and its gradient three back; every
    // send on a rank's own timeline delays it too
    assert!(
        slow.makespan >= free.makespan + 6.0 * 0.5,
        "{} vs {}",
        slow.makespan,
        free.makespan
    );
    assert!(slow.bubble_fraction > free.bubble_fraction);
}

#[test]
fn activations_in_flight_are_1f1b_p_and_gpipe_m() {
    for p in 1..=8 {
        for m in 1..=3 * p + 2 {
            let s = spec(p, 1, m);
            let gpipe = timeline(ScheduleKind::GPipe, s, &Costs::default()).peak_in_flight;
            let ofob = timeline(ScheduleKind::OneFOneB, s, &Costs::default()).peak_in_flight;
            let zb = timeline(ScheduleKind::ZbH1, s, &Costs::default()).peak_in_flight;
            assert_eq!(gpipe, vec![m; p], "{s:?}");
            let want: Vec<usize> = (0..p).map(|r| (p - r).min(m)).collect();
            assert_eq!(ofob, want, "1F1B {s:?}");
            // ZB-H1 holds an activation until its deferred weight gradient: 1F1B's peak of
            // rank 0, min(p, m), on every rank, so the pipeline's peak is 1F1B's
            assert_eq!(zb[0], ofob[0], "ZB-H1 {s:?}");
            assert_eq!(zb.iter().max(), ofob.iter().max(), "ZB-H1 {s:?}");
            assert!(zb.iter().all(|&z| z == p.min(m)), "ZB-H1 {s:?}: {zb:?}");
        }
    }
    // interleaved: Megatron's warm-up of 2 (p - r - 1) + (v - 1) p forwards plus one, in
    // chunk activations of 1/v of the rank's layers
    for p in 2..=6 {
        for v in 2..=4 {
            let m = 3 * p;
            let t = timeline(ScheduleKind::Interleaved, spec(p, v, m), &Costs::default());
            let want: Vec<usize> = (0..p)
                .map(|r| (2 * (p - r - 1) + (v - 1) * p + 1).min(m * v))
                .collect();
            assert_eq!(t.peak_in_flight, want, "p={p} v={v}");
        }
    }
}

/// The position of the first action of `rank` matching `pred`.
fn find(s: &Schedule, rank: usize, pred: impl Fn(&Action) -> bool) -> usize {
    s.ranks[rank].iter().position(pred).unwrap()
}

#[test]
fn a_missing_receive_is_an_unmatched_send() {
    let mut s = Schedule::build(ScheduleKind::OneFOneB, spec(4, 1, 8)).unwrap();
    let at = find(&s, 2, |a| matches!(a, Action::RecvActivation { mb: 3, .. }));
    s.ranks[2].remove(at);
    let err = s.check().unwrap_err();
    let sent = Action::SendActivation {
        mb: 3,
        chunk: 0,
        to: 2,
    };
    let index = find(&s, 1, |a| *a == sent);
    assert_eq!(
        err,
        ScheduleError::UnmatchedSend {
            rank: 1,
            index,
            action: sent,
            peer: 2
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("rank 1") && msg.contains("unmatched send") && msg.contains("rank 2"),
        "{msg}"
    );
    assert!(msg.contains("SendActivation(mb 3"), "{msg}");
    assert!(matches!(
        s.simulate(&Costs::default()),
        Err(ScheduleError::UnmatchedSend { .. })
    ));
    // and a receive with no send
    let mut s = Schedule::build(ScheduleKind::OneFOneB, spec(4, 1, 8)).unwrap();
    let at = find(&s, 1, |a| matches!(a, Action::SendGrad { mb: 5, .. }));
    s.ranks[1].remove(at);
    let err = s.check().unwrap_err();
    assert!(
        matches!(
            err,
            ScheduleError::UnmatchedRecv {
                rank: 0,
                peer: 1,
                action: Action::RecvGrad { mb: 5, .. },
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_reordered_receive_pair_is_caught() {
    let mut s = Schedule::build(ScheduleKind::GPipe, spec(3, 1, 4)).unwrap();
    let a = find(&s, 1, |a| matches!(a, Action::RecvActivation { mb: 1, .. }));
    let b = find(&s, 1, |a| matches!(a, Action::RecvActivation { mb: 2, .. }));
    s.ranks[1].swap(a, b);
    let err = s.check().unwrap_err();
    match &err {
        ScheduleError::OrderMismatch {
            from: 0,
            to: 1,
            position: 1,
            sent,
            received,
            recv_index,
            ..
        } => {
            assert_eq!(
                *sent,
                Action::SendActivation {
                    mb: 1,
                    chunk: 0,
                    to: 1
                }
            );
            assert_eq!(
                *received,
                Action::RecvActivation {
                    mb: 2,
                    chunk: 0,
                    from: 0
                }
            );
            assert_eq!(*recv_index, a);
        }
        other => panic!("expected an order mismatch, got {other}"),
    }
    println!("{err}");
    // swapped sends are the same mistake seen from the other side
    let mut s = Schedule::build(ScheduleKind::ZbH1, spec(4, 1, 8)).unwrap();
    let a = find(&s, 3, |a| matches!(a, Action::SendGrad { mb: 4, .. }));
    let b = find(&s, 3, |a| matches!(a, Action::SendGrad { mb: 5, .. }));
    s.ranks[3].swap(a, b);
    assert!(matches!(
        s.check(),
        Err(ScheduleError::OrderMismatch { from: 3, to: 2, .. })
    ));
}

#[test]
fn receives_waiting_on_each_other_are_a_deadlock() {
    // rank 0 waits for micro-batch 0's gradient before running its forward
    let mut s = Schedule::build(ScheduleKind::OneFOneB, spec(2, 1, 1)).unwrap();
    let at = find(&s, 0, |a| matches!(a, Action::RecvGrad { .. }));
    let recv = s.ranks[0].remove(at);
    s.ranks[0].insert(0, recv);
    let err = s.simulate(&Costs::default()).unwrap_err();
    let ScheduleError::Deadlock { blocked } = &err else {
        panic!("expected a deadlock, got {err}")
    };
    assert_eq!(blocked.len(), 2);
    assert_eq!(
        (blocked[0].rank, blocked[0].index, blocked[0].action),
        (
            0,
            0,
            Action::RecvGrad {
                mb: 0,
                chunk: 0,
                from: 1
            }
        )
    );
    assert_eq!(
        (blocked[1].rank, blocked[1].index, blocked[1].action),
        (
            1,
            0,
            Action::RecvActivation {
                mb: 0,
                chunk: 0,
                from: 0
            }
        )
    );
    let msg = err.to_string();
    assert!(
        msg.contains("deadlock")
            && msg.contains("rank 0 waits at action 0")
            && msg.contains("rank 1 waits at action 0"),
        "{msg}"
    );
    assert_eq!(s.check().unwrap_err(), err);
    // a cycle through every rank: rank 0 waits for micro-batch 0's and 1's gradients before
    // sending micro-batch 1's activation, but in 1F1B rank 1 runs B0 only after F2, and every
    // later rank waits for micro-batch 1's activation
    let mut s = Schedule::build(ScheduleKind::OneFOneB, spec(4, 1, 8)).unwrap();
    for mb in [0, 1] {
        let at = find(
            &s,
            0,
            |a| matches!(a, Action::RecvGrad { mb: m, .. } if *m == mb),
        );
        let recv = s.ranks[0].remove(at);
        let f1 = find(&s, 0, |a| matches!(a, Action::Forward { mb: 1, .. }));
        s.ranks[0].insert(f1, recv);
    }
    let err = s.simulate(&Costs::default()).unwrap_err();
    let ScheduleError::Deadlock { blocked } = &err else {
        panic!("expected a deadlock, got {err}")
    };
    println!("{err}");
    let waits: Vec<(usize, Action)> = blocked.iter().map(|b| (b.rank, b.action)).collect();
    assert_eq!(
        waits,
        vec![
            (
                0,
                Action::RecvGrad {
                    mb: 0,
                    chunk: 0,
                    from: 1
                }
            ),
            (
                1,
                Action::RecvActivation {
                    mb: 1,
                    chunk: 0,
                    from: 0
                }
            ),
            (
                2,
                Action::RecvActivation {
                    mb: 1,
                    chunk: 0,
                    from: 1
                }
            ),
            (
                3,
                Action::RecvActivation {
                    mb: 1,
                    chunk: 0,
                    from: 2
                }
            ),
        ]
    );
    for b in blocked {
        assert_eq!(s.ranks[b.rank][b.index], b.action);
    }
}

#[test]
fn broken_compute_rules_name_the_rank_and_micro_batch() {
    // weight gradients out of micro-batch order
    let mut s = Schedule::build(ScheduleKind::ZbH1, spec(4, 1, 8)).unwrap();
    let a = find(&s, 2, |a| matches!(a, Action::BackwardWeight { mb: 6, .. }));
    let b = find(&s, 2, |a| matches!(a, Action::BackwardWeight { mb: 7, .. }));
    s.ranks[2].swap(a, b);
    let err = s.check().unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ScheduleError::Invariant { rank: 2, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("weight gradients") && msg.contains("micro-batch 6 after 7"),
        "{msg}"
    );
    // a weight gradient before its input gradient
    let mut s = Schedule::build(ScheduleKind::ZbH1, spec(2, 1, 2)).unwrap();
    let bi = find(&s, 0, |a| matches!(a, Action::BackwardInput { mb: 1, .. }));
    let bw = find(&s, 0, |a| matches!(a, Action::BackwardWeight { mb: 1, .. }));
    s.ranks[0].swap(bi, bw);
    let msg = s.check().unwrap_err().to_string();
    assert!(
        msg.contains("rank 0") && msg.contains("BackwardWeight") && msg.contains("micro-batch 1"),
        "{msg}"
    );
    // a forward run twice
    let mut s = Schedule::build(ScheduleKind::GPipe, spec(2, 1, 2)).unwrap();
    s.ranks[0].push(Action::Forward { mb: 1, chunk: 0 });
    let msg = s.check().unwrap_err().to_string();
    assert!(
        msg.contains("rank 0") && msg.contains("2 Forward actions"),
        "{msg}"
    );
    // a forward before its activation arrives
    let mut s = Schedule::build(ScheduleKind::GPipe, spec(2, 1, 2)).unwrap();
    let r = find(&s, 1, |a| matches!(a, Action::RecvActivation { mb: 0, .. }));
    s.ranks[1].swap(r, r + 1);
    let msg = s.check().unwrap_err().to_string();
    assert!(
        msg.contains("rank 1")
            && msg.contains("RecvActivation")
            && msg.contains("before its Forward"),
        "{msg}"
    );
    // a send to the wrong rank
    let mut s = Schedule::build(ScheduleKind::OneFOneB, spec(3, 1, 3)).unwrap();
    let at = find(&s, 0, |a| matches!(a, Action::SendActivation { .. }));
    s.ranks[0][at] = Action::SendActivation {
        mb: 0,
        chunk: 0,
        to: 2,
    };
    let msg = s.check().unwrap_err().to_string();
    assert!(
        msg.contains("names rank 2, but stage 1 is on rank 1"),
        "{msg}"
    );
}

#[test]
fn bad_shapes_name_the_factor_and_the_rule() {
    let cases: [(ScheduleKind, PipelineSpec, &str, &str); 7] = [
        (
            ScheduleKind::OneFOneB,
            spec(0, 1, 4),
            "stages",
            "at least one stage",
        ),
        (
            ScheduleKind::GPipe,
            spec(2, 1, 0),
            "micro_batches",
            "at least one micro-batch",
        ),
        (
            ScheduleKind::GPipe,
            spec(2, 2, 4),
            "virtual_stages",
            "virtual stages need the interleaved schedule; gpipe got virtual_stages = 2",
        ),
        (
            ScheduleKind::Interleaved,
            spec(2, 1, 4),
            "virtual_stages",
            "needs virtual_stages >= 2, got 1",
        ),
        (
            ScheduleKind::Interleaved,
            spec(4, 2, 6),
            "micro_batches",
            "divisible by stages (Megatron-LM's rule), got micro_batches = 6, stages = 4",
        ),
        (
            ScheduleKind::Interleaved,
            spec(4, 2, 2),
            "micro_batches",
            "micro_batches = 2 < stages = 4",
        ),
        (
            ScheduleKind::Interleaved,
            spec(1, 2, 4),
            "stages",
            "stages >= 2",
        ),
    ];
    for (kind, s, field, rule) in cases {
        let err = Schedule::build(kind, s).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, ScheduleError::InvalidSpec { field: f, .. } if *f == field),
            "{msg}"
        );
        assert!(msg.contains(rule), "{kind} {s:?}: {msg}");
    }
    let err = Schedule::build(ScheduleKind::OneFOneB, spec(2, 1, 2))
        .unwrap()
        .simulate(&Costs {
            forward: -1.0,
            ..Costs::default()
        })
        .unwrap_err();
    assert!(err.to_string().contains("forward = -1"), "{err}");
    // names round trip, and an unknown one lists the known
    for kind in ScheduleKind::ALL {
        assert_eq!(kind.to_string().parse::<ScheduleKind>().unwrap(), kind);
    }
    assert_eq!("ZB_H1".parse::<ScheduleKind>().unwrap(), ScheduleKind::ZbH1);
    let err = "pipedream".parse::<ScheduleKind>().unwrap_err().to_string();
    assert!(
        err.contains("\"pipedream\"") && err.contains("1f1b"),
        "{err}"
    );
    // and into the crate's error
    let e: kiln_parallel::ParallelError = Schedule::build(ScheduleKind::GPipe, spec(2, 2, 4))
        .unwrap_err()
        .into();
    assert!(
        e.to_string().contains("gpipe got virtual_stages = 2"),
        "{e}"
    );
}

#[test]
fn the_text_timeline_puts_each_action_in_its_slots() {
    // 1F1B on two stages, two micro-batches, F = 1 and B = 2: rank 1 runs F0 at 1, B0 over
    // 2..4, F1 at 4, B1 over 5..7; rank 0 F0, F1, then waits for B0's gradient until 4
    let t = timeline(ScheduleKind::OneFOneB, spec(2, 1, 2), &Costs::default());
    assert_eq!(t.makespan, 9.0);
    assert_eq!(
        t.render_text(),
        "rank 0: F0 F1 .  .  B0 -- .  B1 --\nrank 1: .  F0 B0 -- F1 B1 --\n"
    );
    // the spans say the same
    let r1: Vec<(f64, f64)> = t.compute_spans(1).map(|s| (s.start, s.end)).collect();
    assert_eq!(r1, vec![(1.0, 2.0), (2.0, 4.0), (4.0, 5.0), (5.0, 7.0)]);
    // interleaved labels carry the chunk
    let t = timeline(ScheduleKind::Interleaved, spec(2, 2, 2), &Costs::default());
    assert!(
        t.render_text().starts_with("rank 0: F0.0 F1.0 F0.1 F1.1"),
        "{}",
        t.render_text()
    );
}
