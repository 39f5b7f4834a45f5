//! Detector tests: false positives on a million steps of a realistic noisy loss (the crate
//! docs' table), injected spikes, the threshold
//! against a sorting reference, non-finite values and stragglers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_monitor::{
    Detector, DetectorSet, Metric, NonFiniteDetector, ScalerEvent, SpikeConfig, SpikeDetector,
    StepMetrics, StragglerDetector, Verdict, MAD_TO_SD,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Standard normal sample (Box-Muller).
fn gauss(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = 1.0 - rng.gen::<f64>();
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// `2 + 8 exp(-t / 2000) + N(0, 0.05)`: a decreasing loss with noise.
fn realistic_loss(seed: u64, steps: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..steps)
        .map(|t| 2.0 + 8.0 * (-(t as f64) / 2000.0).exp() + 0.05 * gauss(&mut rng))
        .collect()
}

fn loss_at(step: u64, loss: f64) -> StepMetrics {
    StepMetrics {
        step,
        loss: Some(loss),
        ..StepMetrics::default()
    }
}

fn fire_steps(d: &mut SpikeDetector, series: &[f64]) -> Vec<u64> {
    series
        .iter()
        .enumerate()
        .filter_map(|(t, &v)| d.observe(&loss_at(t as u64, v)).map(|_| t as u64))
        .collect()
}

/// The false-positive table of the crate docs, asserted as written: on 100 seeds of 10,000
/// steps (1,000,000 in all) the default rule never fires and the rule with a 10% jump fires 3
/// times; the plain upward 3-robust-sigma rule fires 79 times on the first 10 seeds (100,000
/// steps), 1 to 12 times per seed.
#[test]
fn no_false_positive_on_a_million_realistic_noisy_steps() {
    const SEEDS: u64 = 100;
    const PLAIN_SEEDS: u64 = 10;
    const STEPS: u64 = 10_000;
    let ten = SpikeConfig {
        min_rel_jump: 0.10,
        ..SpikeConfig::loss()
    };
    let plain = SpikeConfig {
        min_rel_jump: 0.0,
        ..SpikeConfig::loss()
    };
    let (mut fp_default, mut fp_ten, mut fp_plain) = (0, 0, 0);
    let mut per_seed_plain = Vec::new();
    let mut steps = 0;
    for seed in 0..SEEDS {
        let series = realistic_loss(seed, STEPS);
        steps += series.len() as u64;
        fp_default += fire_steps(&mut SpikeDetector::loss(), &series).len();
        fp_ten += fire_steps(&mut SpikeDetector::new(Metric::Loss, ten).unwrap(), &series).len();
        if seed < PLAIN_SEEDS {
            let n = fire_steps(
                &mut SpikeDetector::new(Metric::Loss, plain).unwrap(),
                &series,
            )
            .len();
            per_seed_plain.push(n);
            fp_plain += n;
        }
    }
    assert_eq!(steps, 1_000_000);
    println!(
        "false positives on {steps} steps: default rule {fp_default}, 10% jump {fp_ten}; on \
         {} steps, plain 3-robust-sigma {fp_plain} (per seed {per_seed_plain:?})",
        PLAIN_SEEDS * STEPS
    );
    assert_eq!(fp_default, 0, "the default rule on 1,000,000 noisy steps");
    assert_eq!(fp_ten, 3, "the 10% rule on 1,000,000 noisy steps");
    // the series is noisy enough that the k-sigma test alone fires (the Gaussian tail)
    assert_eq!(fp_plain, 79, "the plain rule on 100,000 noisy steps");
    assert!(
        per_seed_plain.iter().all(|n| (1..=12).contains(n)),
        "{per_seed_plain:?}"
    );
}

#[test]
fn fires_on_injected_spikes_and_nowhere_else() {
    let mut series = realistic_loss(42, 10_000);
    let spikes = [300u64, 2_500, 5_000, 5_001, 9_000];
    for &s in &spikes {
        series[s as usize] *= 1.25;
    }
    let fired = fire_steps(&mut SpikeDetector::loss(), &series);
    assert_eq!(fired, spikes);
}

#[test]
fn warm_up_holds_fire() {
    let mut d = SpikeDetector::loss();
    for t in 0..49 {
        assert!(d
            .observe(&loss_at(t, 3.0 + 0.01 * (t % 3) as f64))
            .is_none());
    }
    // 50th value: the window has 49 < warm-up 50, so even a huge value passes (and enters)
    assert!(d.observe(&loss_at(49, 100.0)).is_none());
    assert_eq!(d.len(), 50);
    // now it may fire; the window's median is unmoved by the one outlier
    let v = d.observe(&loss_at(50, 5.0)).unwrap();
    match v {
        Verdict::Spike { median, .. } => assert!((median - 3.01).abs() < 1e-12, "{median}"),
        other => panic!("{other:?}"),
    }
}

/// A straightforward reference: sort a copy of the window.
fn reference_threshold(window: &[f64], cfg: &SpikeConfig) -> f64 {
    let mut s = window.to_vec();
    s.sort_by(f64::total_cmp);
    let med = |s: &[f64]| {
        let n = s.len();
        if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    };
    let m = med(&s);
    let mut dev: Vec<f64> = s.iter().map(|x| (x - m).abs()).collect();
    dev.sort_by(f64::total_cmp);
    let mad = med(&dev);
    m + (cfg.k * MAD_TO_SD * mad).max(cfg.min_rel_jump * m.abs())
}

#[test]
fn threshold_matches_a_sorting_reference() {
    let cfg = SpikeConfig {
        k: 2.5,
        window: 37,
        warmup: 10,
        min_rel_jump: 0.01,
    };
    let mut d = SpikeDetector::new(Metric::Loss, cfg).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut window: Vec<f64> = Vec::new();
    let mut fired = 0;
    for t in 0..3_000u64 {
        // heavy-tailed noise so both branches of the max and both outcomes occur
        let x = 5.0 + gauss(&mut rng) * if rng.gen_bool(0.05) { 4.0 } else { 0.3 };
        let expected_threshold =
            (window.len() >= cfg.warmup).then(|| reference_threshold(&window, &cfg));
        match (d.observe(&loss_at(t, x)), expected_threshold) {
            (
                Some(Verdict::Spike {
                    threshold, value, ..
                }),
                Some(th),
            ) => {
                assert!(
                    (threshold - th).abs() <= 1e-12 * th.abs(),
                    "step {t}: {threshold} vs {th}"
                );
                assert!(value > th);
                fired += 1;
            }
            (None, Some(th)) => {
                assert!(x <= th, "step {t}: {x} > {th} but no verdict");
                window.push(x);
            }
            (None, None) => window.push(x),
            (v, th) => panic!("step {t}: verdict {v:?} with reference threshold {th:?}"),
        }
        if window.len() > cfg.window {
            window.remove(0);
        }
    }
    assert!(fired > 10 && fired < 300, "fired {fired}");
}

#[test]
fn spikes_do_not_enter_the_window_and_rollback_forgets() {
    let mut d = SpikeDetector::loss();
    for t in 0..100 {
        d.observe(&loss_at(t, 2.0 + 0.01 * (t % 7) as f64));
    }
    let before = d.threshold().unwrap();
    assert!(d.observe(&loss_at(100, 50.0)).is_some());
    assert_eq!(d.threshold().unwrap(), before);
    assert_eq!(d.len(), 100);
    d.rollback(89);
    assert_eq!(d.len(), 90);
    // the remaining window is steps 0..=89
    d.rollback(0);
    assert_eq!(d.len(), 1);
}

#[test]
fn grad_norm_spike_needs_a_doubling() {
    let mut d = SpikeDetector::grad_norm();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for t in 0..200 {
        let m = StepMetrics {
            step: t,
            grad_norm: Some(1.0 + 0.1 * gauss(&mut rng)),
            ..StepMetrics::default()
        };
        assert!(d.observe(&m).is_none(), "step {t}");
    }
    let at = |s, g| StepMetrics {
        step: s,
        grad_norm: Some(g),
        ..StepMetrics::default()
    };
    assert!(d.observe(&at(200, 1.8)).is_none());
    match d.observe(&at(201, 2.2)) {
        Some(Verdict::Spike {
            metric: Metric::GradNorm,
            value,
            ..
        }) => assert_eq!(value, 2.2),
        other => panic!("{other:?}"),
    }
}

#[test]
fn non_finite_detection() {
    let mut d = NonFiniteDetector::default();
    let m = |loss: f64, g: f64, ev: Option<ScalerEvent>| StepMetrics {
        step: 1,
        loss: Some(loss),
        grad_norm: Some(g),
        scaler_event: ev,
        ..StepMetrics::default()
    };
    assert_eq!(d.observe(&m(2.0, 1.0, None)), None);
    match d.observe(&m(f64::NAN, 1.0, None)) {
        Some(Verdict::NonFinite {
            metric: Metric::Loss,
            value,
        }) => assert!(value.is_nan()),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        d.observe(&m(2.0, f64::INFINITY, None)),
        Some(Verdict::NonFinite {
            metric: Metric::GradNorm,
            value: f64::INFINITY
        })
    );
    // the loss scaler already skipped that step: routine overflow, no verdict
    assert_eq!(
        d.observe(&m(2.0, f64::INFINITY, Some(ScalerEvent::BackedOff))),
        None
    );
    // ...unless asked to report it anyway
    let mut strict = NonFiniteDetector {
        ignore_scaler_skips: false,
        ..NonFiniteDetector::default()
    };
    assert!(strict
        .observe(&m(2.0, f64::NEG_INFINITY, Some(ScalerEvent::Skipped)))
        .is_some());
    // a non-finite loss is reported even on a scaler skip
    assert!(d
        .observe(&m(f64::INFINITY, f64::INFINITY, Some(ScalerEvent::Skipped)))
        .is_some());

    // the spike detector ignores non-finite values (they are the other detector's job)
    let mut s = SpikeDetector::loss();
    s.observe(&loss_at(0, 2.0));
    s.observe(&loss_at(1, f64::NAN));
    assert_eq!(s.len(), 1);
}

#[test]
fn straggler_against_the_lower_median() {
    let mut d = StragglerDetector::default();
    let m = |t: &[f64]| StepMetrics {
        step: 9,
        rank_step_time_s: t.to_vec(),
        ..StepMetrics::default()
    };
    assert_eq!(
        d.observe(&m(&[1.0, 1.1, 0.9, 2.0])),
        Some(Verdict::Straggler {
            rank: 3,
            step_time_s: 2.0,
            median_s: 1.0,
            ratio: 2.0
        })
    );
    assert_eq!(d.observe(&m(&[1.0, 1.1, 0.9, 1.45])), None);
    // two ranks: the slow one is compared with the fast one
    assert_eq!(
        d.observe(&m(&[1.6, 1.0])),
        Some(Verdict::Straggler {
            rank: 0,
            step_time_s: 1.6,
            median_s: 1.0,
            ratio: 1.6
        })
    );
    assert_eq!(d.observe(&m(&[1.0])), None);
    assert!(StragglerDetector::new(1.0).is_err());
}

#[test]
fn standard_set_reports_every_verdict() {
    let mut set = DetectorSet::standard();
    assert_eq!(
        set.names(),
        ["non_finite", "loss_spike", "grad_norm_spike", "straggler"]
    );
    let v = set.observe(&StepMetrics {
        step: 0,
        loss: Some(f64::NAN),
        rank_step_time_s: vec![1.0, 3.0],
        ..StepMetrics::default()
    });
    assert_eq!(v.len(), 2);
    assert!(matches!(v[0], Verdict::NonFinite { .. }));
    assert!(matches!(v[1], Verdict::Straggler { rank: 1, .. }));
}

#[test]
fn invalid_spike_configs_are_rejected() {
    let base = SpikeConfig::loss();
    for bad in [
        SpikeConfig { k: 0.0, ..base },
        SpikeConfig { window: 2, ..base },
        SpikeConfig {
            warmup: 101,
            ..base
        },
        SpikeConfig {
            min_rel_jump: f64::NAN,
            ..base
        },
    ] {
        let e = SpikeDetector::new(Metric::Loss, bad).unwrap_err();
        assert!(e.to_string().starts_with("invalid "), "{e}");
    }
}
