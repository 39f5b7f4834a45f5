//! Learning-rate schedules at their boundary steps against closed forms, and warmup against
//! numbers recorded from PyTorch 2.15's `LinearLR`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_optim::{Constant, Decay, LrSchedule, Warmup, WarmupDecay};
use std::f64::consts::PI;

const PEAK: f64 = 6e-4;
const FLOOR: f64 = 6e-5;
const W: u64 = 100;
const T: u64 = 1000;

fn cosine_closed_form(s: u64) -> f32 {
    let (peak, floor) = (PEAK, FLOOR);
    let x = (s - W) as f64 / (T - W) as f64;
    (floor + (peak - floor) * 0.5 * (1.0 + (PI * x).cos())) as f32
}

#[test]
fn cosine_at_boundaries() {
    let s = WarmupDecay::cosine(PEAK, FLOOR, W, T).unwrap();
    assert_eq!(s.lr(0), 0.0);
    assert_eq!(s.lr(1), (PEAK / 100.0) as f32);
    assert_eq!(s.lr(W - 1), (PEAK * 99.0 / 100.0) as f32);
    assert_eq!(s.lr(W), PEAK as f32);
    assert_eq!(s.lr(W + 1), cosine_closed_form(W + 1));
    assert!(s.lr(W + 1) < PEAK as f32);
    // halfway through the decay: the mean of peak and floor
    assert_eq!(s.lr(550), ((PEAK + FLOOR) / 2.0) as f32);
    assert_eq!(s.lr(T - 1), cosine_closed_form(T - 1));
    assert!(s.lr(T - 1) > FLOOR as f32);
    assert_eq!(s.lr(T), FLOOR as f32);
    assert_eq!(s.lr(T + 1), FLOOR as f32);
    assert_eq!(s.lr(u64::MAX), FLOOR as f32);
    // monotone: up during warmup, down after
    let lrs: Vec<f32> = (0..=T + 5).map(|i| s.lr(i)).collect();
    assert!(lrs[..=W as usize].windows(2).all(|w| w[0] < w[1]));
    assert!(lrs[W as usize..].windows(2).all(|w| w[0] >= w[1]));
}

#[test]
fn linear_decay_at_boundaries() {
    let s = WarmupDecay::linear(PEAK, FLOOR, W, T).unwrap();
    let closed = |i: u64| {
        let x = (i - W) as f64 / (T - W) as f64;
        (PEAK + (FLOOR - PEAK) * x) as f32
    };
    assert_eq!(s.lr(0), 0.0);
    assert_eq!(s.lr(W - 1), (PEAK * 0.99) as f32);
    assert_eq!(s.lr(W), PEAK as f32);
    assert_eq!(s.lr(W + 1), closed(W + 1));
    assert_eq!(s.lr(550), closed(550));
    assert_eq!(s.lr(T - 1), closed(T - 1));
    assert_eq!(s.lr(T), FLOOR as f32);
    assert_eq!(s.lr(2 * T), FLOOR as f32);
    // equal steps down
    let d1 = s.lr(200) as f64 - s.lr(300) as f64;
    let d2 = s.lr(700) as f64 - s.lr(800) as f64;
    assert!((d1 - d2).abs() < 1e-10);
}

#[test]
fn warmup_start_factor_matches_pytorch_linear_lr() {
    // torch.optim.lr_scheduler.LinearLR(SGD(lr=0.01), start_factor=0.25, total_iters=4)
    let torch = [0.0025, 0.004375, 0.00625, 0.008125, 0.01, 0.01, 0.01];
    let warmup = Warmup {
        steps: 4,
        start_factor: 0.25,
    };
    let c = Constant::with_warmup(0.01, warmup).unwrap();
    let d = WarmupDecay::new(Decay::Cosine, 0.01, 0.001, warmup, 100).unwrap();
    for (i, &want) in torch.iter().enumerate() {
        let want = want as f32;
        assert_eq!(c.lr(i as u64), want, "constant, step {i}");
        if i <= 4 {
            assert_eq!(d.lr(i as u64), want, "cosine, step {i}");
        }
    }
    assert_eq!(Constant::new(3e-4).unwrap().lr(0), 3e-4);
    assert_eq!(Constant::new(3e-4).unwrap().lr(1 << 40), 3e-4);
}

#[test]
fn no_warmup_and_no_decay_phase() {
    let s = WarmupDecay::cosine(1.0, 0.0, 0, 10).unwrap();
    assert_eq!(s.lr(0), 1.0);
    assert_eq!(s.lr(5), 0.5);
    assert_eq!(s.lr(10), 0.0);
    // warmup takes the whole run: floor from total_steps on
    let s = WarmupDecay::linear(1.0, 0.25, 10, 10).unwrap();
    assert_eq!(s.lr(9), 0.9);
    assert_eq!(s.lr(10), 0.25);
    let boxed: Box<dyn LrSchedule> = Box::new(s);
    assert_eq!(boxed.lr(9), 0.9);
}

#[test]
fn invalid_schedules_are_rejected() {
    let e = WarmupDecay::cosine(1e-3, 1e-2, 10, 100).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid floor lr 0.01: must not exceed the peak lr"
    );
    let e = WarmupDecay::cosine(1e-3, 0.0, 200, 100).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid warmup steps 200: must not exceed total_steps"
    );
    assert!(Constant::new(f64::NAN).is_err());
    assert!(Constant::new(-1.0).is_err());
    let bad = Warmup {
        steps: 3,
        start_factor: 1.5,
    };
    assert!(Constant::with_warmup(1.0, bad).is_err());
}
