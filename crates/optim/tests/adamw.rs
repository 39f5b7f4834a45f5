//! AdamW against an independent f64 implementation of the textbook update, against numbers
//! recorded from PyTorch 2.15 (`torch.optim.AdamW`, `foreach=False`, CPU), shard == whole
//! buffer bitwise, and bitwise resume.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::needless_range_loop)] // the references index like the formulas they transcribe

use kiln_comm::chunk_range;
use kiln_optim::{
    AdamW, AdamWConfig, AdamWState, DecayOverride, OptimError, Optimizer, PARALLEL_MIN_LEN,
};
use kiln_testkit::{assert_bitwise_eq, assert_close};

/// Deterministic values in [-1, 1) (splitmix64).
fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Gradients of step `t`: magnitudes spread over six decades, signs mixed.
fn grads(t: u64, n: usize) -> Vec<f32> {
    let u = uniform(1000 + t, n);
    let s = uniform(5000 + t, n);
    u.iter()
        .zip(&s)
        .map(|(&u, &s)| u * 10f32.powf(3.0 * s))
        .collect()
}

fn lr_at(t: u64) -> f32 {
    1e-3 * (1.0 + (t % 7) as f32 / 7.0)
}

/// The textbook AdamW (Loshchilov and Hutter, as PyTorch documents it) in f64.
struct RefAdamW {
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
    cfg: AdamWConfig,
}

impl RefAdamW {
    fn step(&mut self, g: &[f32], lr: f64) {
        let c = self.cfg;
        self.t += 1;
        for i in 0..self.p.len() {
            let g = g[i] as f64;
            self.p[i] -= lr * c.weight_decay * self.p[i];
            self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
            self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
            let m_hat = self.m[i] / (1.0 - c.beta1.powi(self.t));
            let v_hat = self.v[i] / (1.0 - c.beta2.powi(self.t));
            self.p[i] -= lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }
}

const DEFAULT_WD01: [[[u32; 5]; 3]; 5] = [
    [
        [0x3eff799a, 0xbf9fdc00, 0x3fffd99a, 0x3b049860, 0xbf403b34],
        [0x3c23d70b, 0xbca3d70b, 0x3cf5c290, 0x3727c5ac, 0x3e800000],
        [0x3727c5ad, 0x3827c5ad, 0x38bcbe63, 0x2d2febff, 0x3bccccce],
    ],
    [
        [0x3eff28a5, 0xbf9feb70, 0x3fff8ccf, 0x3b336d78, 0xbf40ac26],
        [0x3b83126f, 0x3cb43959, 0x3d6978d6, 0xb7388ca4, 0x3ec00000],
        [0x37518c25, 0x3951ac5b, 0x393ca63a, 0x2e5bdbbc, 0x3c0b295f],
    ],
    [
        [0x3efe18cb, 0xbf9fec91, 0x3fff80e8, 0x3b4d9e20, 0xbf40a8b3],
        [0x3cc154ca, 0x3c20902f, 0xbc0e8a6f, 0xb6a46aae, 0x3d199998],
        [0x385c1b4d, 0x395bf309, 0x3a0d7cad, 0x2e66a234, 0x3c8f3d3e],
    ],
    [
        [0x3efd5c67, 0xbfa000b7, 0x3fff6f94, 0x3aeddbe9, 0xbf40af28],
        [0x3cadff83, 0x3d0a86d7, 0x3b0e369b, 0x38c8777f, 0x3dab851e],
        [0x385be2f4, 0x398ea1f9, 0x3a0ff78c, 0x3090a39a, 0x3c9124dd],
    ],
    [
        [0x3efd6a36, 0xbf9ffb72, 0x3fff6433, 0x3af4a548, 0xbf40b880],
        [0xbc3252ce, 0xbb957cd6, 0x3cb3d6c9, 0xb76a5c63, 0x3e339581],
        [0x391549dc, 0x39ceb722, 0x3a1a4f0c, 0x310cf77a, 0x3c9930dc],
    ],
];
const BETA1_03: [[[u32; 5]; 3]; 5] = [
    [
        [0x3eff8000, 0xbf9fe000, 0x3fffe000, 0x3b053dde, 0xbf404000],
        [0x3d8f5c29, 0xbe0f5c29, 0x3e570a3e, 0x3892ccf6, 0x3fe00000],
        [0x3a03126f, 0x3b03126f, 0x3b9374bd, 0x3009705f, 0x3ea00000],
    ],
    [
        [0x3effb235, 0xbfa01487, 0x3fffa000, 0x3b6da508, 0xbf40ac1e],
        [0xbc65603f, 0x3e73b645, 0x3e8bc6a8, 0xb8f98fa3, 0x3fc9999a],
        [0x3a1d4952, 0x3c22339d, 0x3c0fc505, 0x312a14a9, 0x3ed1999a],
    ],
    [
        [0x3efe22f5, 0xbfa0150d, 0x3fffeda1, 0x3b6eaf60, 0xbf4027b3],
        [0x3e0b0f28, 0x3ab78049, 0xbead1b72, 0xb53be7b0, 0xbfd051ec],
        [0x3b286d73, 0x3c224896, 0x3cd7bf20, 0x312a2aa6, 0x3f56c290],
    ],
    [
        [0x3efdb065, 0xbfa04b7a, 0x3ffff477, 0x39d4d798, 0xbf401d06],
        [0x3d26defd, 0x3e33a14d, 0xbd00bcc0, 0x3a37721d, 0xbe0d916b],
        [0x3b200194, 0x3c4d5e8e, 0x3cd10e24, 0x3360da1e, 0x3f4f38d5],
    ],
    [
        [0x3efe428e, 0xbfa0359f, 0x3fffe82b, 0x3a93c52f, 0xbf40333a],
        [0xbe4a8651, 0xbe44fdb0, 0x3e05b467, 0xba007792, 0x3f289518],
        [0x3bdf757d, 0x3c93b9f8, 0x3cd6fc8a, 0x33d62dcd, 0x3f51a931],
    ],
];

fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Parameters in +-[0.5, 1.5): far enough from zero for a relative comparison.
fn params0(n: usize) -> Vec<f32> {
    uniform(7, n)
        .iter()
        .map(|&x| x.signum() * (0.5 + x.abs()))
        .collect()
}

fn configs() -> [AdamWConfig; 3] {
    [
        AdamWConfig {
            weight_decay: 0.1,
            ..Default::default()
        },
        // lerp's other branch (weight 1 - beta1 >= 0.5), no weight decay
        AdamWConfig {
            beta1: 0.3,
            beta2: 0.95,
            eps: 1e-6,
            weight_decay: 0.0,
        },
        AdamWConfig::default(),
    ]
}

#[test]
fn every_step_matches_f64_reference_from_the_same_state() {
    let n = 4096;
    for cfg in configs() {
        let mut p = params0(n);
        let mut opt = AdamW::new(n, cfg).unwrap();
        for t in 0..50u64 {
            let g = grads(t, n);
            let lr = lr_at(t);
            let mut r = RefAdamW {
                p: to_f64(&p),
                m: to_f64(opt.exp_avg()),
                v: to_f64(opt.exp_avg_sq()),
                t: t as i32,
                cfg,
            };
            let m_old = r.m.clone();
            r.step(&g, lr as f64);
            opt.step(&mut p, &g, lr).unwrap();
            assert_close(&p, &r.p, 0.0, 1e-6);
            assert_close(opt.exp_avg_sq(), &r.v, 0.0, 1e-6);
            // m = beta1 m + (1 - beta1) g may cancel: bound the error by the terms' size
            for i in 0..n {
                let scale = cfg.beta1 * m_old[i].abs() + (1.0 - cfg.beta1) * (g[i] as f64).abs();
                let err = (opt.exp_avg()[i] as f64 - r.m[i]).abs();
                assert!(
                    err <= 1e-6 * scale,
                    "step {t} m[{i}]: error {err:e} vs terms {scale:e}"
                );
            }
        }
    }
}

#[test]
fn fifty_steps_track_f64_reference() {
    // the f32 run rounds its state at every step: the drift grows like sqrt(steps) ulps
    let n = 64;
    for cfg in configs() {
        let p0 = params0(n);
        let mut p = p0.clone();
        let mut opt = AdamW::new(n, cfg).unwrap();
        let mut r = RefAdamW {
            p: to_f64(&p0),
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
            cfg,
        };
        for t in 0..50u64 {
            let g = grads(t, n);
            opt.step(&mut p, &g, lr_at(t)).unwrap();
            r.step(&g, lr_at(t) as f64);
        }
        assert_eq!(opt.step_count(), 50);
        // PyTorch rounds the decay factor `1 - lr * weight_decay` to f32 once per step, and so
        // does the kernel: a systematic drift the f64 reference does not have. Allow exactly it
        // on top of 1e-6.
        let drift = (0..50u64)
            .map(|t| {
                let d = 1.0 - lr_at(t) as f64 * cfg.weight_decay;
                (d as f32) as f64 / d
            })
            .product::<f64>();
        assert_close(&p, &r.p, 0.0, 1e-6 + (drift - 1.0).abs());
        assert_close(opt.exp_avg_sq(), &r.v, 0.0, 2e-6);
        let m_max = r.m.iter().fold(0.0f64, |a, &b| a.max(b.abs()));
        assert_close(opt.exp_avg(), &r.m, 1e-6 * m_max, 1e-6);
        // and the parameters really moved: not a test that passes by standing still
        let moved = p
            .iter()
            .zip(&p0)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(moved > 1e-2, "parameters moved only {moved}");
    }
}

/// PyTorch's CPU `_single_tensor_adam` with `decoupled_weight_decay=True`, operation by
/// operation in f32, including the fused multiply-adds its build contracts `lerp_` and
/// `addcmul_` into (the kernel under test does not fuse: it stays within an ulp or two).
struct TorchFma {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
    cfg: AdamWConfig,
}

impl TorchFma {
    fn step(&mut self, g: &[f32], lr: f64) {
        let c = self.cfg;
        self.t += 1;
        let w = (1.0 - c.beta1) as f32;
        let bc1 = 1.0 - c.beta1.powi(self.t);
        let bc2_sqrt = (1.0 - c.beta2.powi(self.t)).sqrt() as f32;
        for i in 0..self.p.len() {
            self.p[i] *= (1.0 - lr * c.weight_decay) as f32;
            self.m[i] = if w < 0.5 {
                w.mul_add(g[i] - self.m[i], self.m[i])
            } else {
                (w - 1.0).mul_add(g[i] - self.m[i], g[i])
            };
            self.v[i] = ((1.0 - c.beta2) as f32 * g[i]).mul_add(g[i], self.v[i] * c.beta2 as f32);
            let denom = self.v[i].sqrt() / bc2_sqrt + c.eps as f32;
            self.p[i] += (-(lr / bc1)) as f32 * self.m[i] / denom;
        }
    }
}

fn bits_to_f32(b: &[u32; 5]) -> Vec<f32> {
    b.iter().map(|&x| f32::from_bits(x)).collect()
}

#[test]
fn matches_pytorch_recorded_numbers() {
    let p0 = [0.5f32, -1.25, 2.0, 3.0e-3, -0.75];
    let grads: [[f32; 5]; 5] = [
        [0.1, -0.2, 0.3, 1.0e-4, 2.5],
        [-0.05, 0.4, 0.3, -2.0e-4, 1.5],
        [0.2, -0.1, -0.6, 5.0e-5, -3.0],
        [0.0, 0.25, 0.1, 1.0e-3, 0.5],
        [-0.3, -0.35, 0.2, -1.0e-3, 1.0],
    ];
    // exactly representable in f32, so PyTorch's f64 learning rate is the same number
    let lrs = [
        2f32.powi(-10),
        2f32.powi(-9),
        3.0 * 2f32.powi(-10),
        5.0 * 2f32.powi(-11),
        2f32.powi(-10),
    ];
    let cases = [
        (
            AdamWConfig {
                weight_decay: 0.1,
                ..Default::default()
            },
            &DEFAULT_WD01,
        ),
        (
            AdamWConfig {
                beta1: 0.3,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.0,
            },
            &BETA1_03,
        ),
    ];
    for (cfg, expected) in cases {
        let mut p = p0.to_vec();
        let mut opt = AdamW::new(5, cfg).unwrap();
        let mut fma = TorchFma {
            p: p0.to_vec(),
            m: vec![0.0; 5],
            v: vec![0.0; 5],
            t: 0,
            cfg,
        };
        let mut m_prev = vec![0.0f32; 5];
        for (t, want) in expected.iter().enumerate() {
            opt.step(&mut p, &grads[t], lrs[t]).unwrap();
            fma.step(&grads[t], lrs[t] as f64);
            // the same formula with PyTorch's contractions gives PyTorch's bits exactly
            assert_bitwise_eq(&fma.p, &bits_to_f32(&want[0]));
            assert_bitwise_eq(&fma.m, &bits_to_f32(&want[1]));
            assert_bitwise_eq(&fma.v, &bits_to_f32(&want[2]));
            let (wp, wm, wv) = (
                bits_to_f32(&want[0]),
                bits_to_f32(&want[1]),
                bits_to_f32(&want[2]),
            );
            assert_close(&p, &wp, 0.0, 1e-6);
            assert_close(opt.exp_avg_sq(), &wv, 0.0, 1e-6);
            // m = lerp(m, g, 1 - beta1) cancels when g changes sign: bound its error by a few
            // ulps of the operands rather than of the result
            for i in 0..5 {
                let scale = grads[t][i].abs() + m_prev[i].abs();
                let err = (opt.exp_avg()[i] - wm[i]).abs();
                assert!(
                    err <= 4.0 * f32::EPSILON * scale,
                    "step {} m[{i}]: {} vs {}",
                    t + 1,
                    opt.exp_avg()[i],
                    wm[i]
                );
            }
            m_prev = wm;
        }
    }
}

/// Runs `steps` steps of an optimizer over `range` of the full buffer.
fn run_range(
    cfg: AdamWConfig,
    n: usize,
    range: std::ops::Range<usize>,
    steps: u64,
    threads: usize,
) -> (Vec<f32>, AdamW) {
    let mut p = params0(n)[range.clone()].to_vec();
    let mut opt = AdamW::new(range.len(), cfg).unwrap();
    opt.set_threads(threads);
    for t in 0..steps {
        let g = grads(t, n);
        opt.step(&mut p, &g[range.clone()], lr_at(t)).unwrap();
    }
    (p, opt)
}

#[test]
fn shards_are_bitwise_the_whole_buffer() {
    let n = 10_007;
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    let (whole, whole_opt) = run_range(cfg, n, 0..n, 20, 1);
    let mut ranges: Vec<_> = (0..3).map(|r| chunk_range(n, 3, r)).collect();
    ranges.extend([1..n - 3, 4093..4101, 17..18, 5..5]);
    for range in ranges {
        let (p, opt) = run_range(cfg, n, range.clone(), 20, 1);
        assert_bitwise_eq(&p, &whole[range.clone()]);
        assert_bitwise_eq(opt.exp_avg(), &whole_opt.exp_avg()[range.clone()]);
        assert_bitwise_eq(opt.exp_avg_sq(), &whole_opt.exp_avg_sq()[range.clone()]);
    }
}

#[test]
fn threads_do_not_change_a_bit() {
    let n = PARALLEL_MIN_LEN + 4099;
    let cfg = AdamWConfig::default();
    let (one, one_opt) = run_range(cfg, n, 0..n, 3, 1);
    for threads in [2, 3] {
        let (p, opt) = run_range(cfg, n, 0..n, 3, threads);
        assert_bitwise_eq(&p, &one);
        assert_bitwise_eq(opt.exp_avg_sq(), one_opt.exp_avg_sq());
    }
}

/// Runs jobs in reverse order on two scoped threads, counting the jobs it ran.
#[derive(Debug, Default)]
struct ReverseRunner(std::sync::atomic::AtomicUsize);

impl kiln_optim::ParallelRunner for ReverseRunner {
    fn run(&self, n: usize, job: &(dyn Fn(usize) + Sync)) {
        std::thread::scope(|s| {
            s.spawn(|| (0..n).rev().step_by(2).for_each(job));
            s.spawn(|| (0..n).rev().skip(1).step_by(2).for_each(job));
        });
        self.0.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A step on a runner (jobs in any order, on other threads) is bitwise the step on the
/// caller's thread, and the runner runs it (a large buffer); a small buffer stays on the
/// caller's thread.
#[test]
fn a_runner_does_not_change_a_bit() {
    let n = PARALLEL_MIN_LEN + 4099;
    let cfg = AdamWConfig::default();
    let (one, one_opt) = run_range(cfg, n, 0..n, 3, 1);
    let runner = std::sync::Arc::new(ReverseRunner::default());
    let mut p = params0(n);
    let mut opt = AdamW::new(n, cfg).unwrap();
    opt.set_runner(Some(runner.clone()));
    for t in 0..3 {
        opt.step(&mut p, &grads(t, n), lr_at(t)).unwrap();
    }
    assert_bitwise_eq(&p, &one);
    assert_bitwise_eq(opt.exp_avg(), one_opt.exp_avg());
    assert_bitwise_eq(opt.exp_avg_sq(), one_opt.exp_avg_sq());
    let jobs = runner.0.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(jobs, 3 * n.div_ceil(1 << 16));
    let mut small = AdamW::new(100, cfg).unwrap();
    small.set_runner(Some(runner.clone()));
    small.step(&mut [0.5; 100], &[0.1; 100], 0.1).unwrap();
    assert_eq!(runner.0.load(std::sync::atomic::Ordering::Relaxed), jobs);
}

#[test]
fn resume_is_bitwise() {
    let n = 3001;
    let cfg = AdamWConfig {
        weight_decay: 0.05,
        ..Default::default()
    };
    let (straight, straight_opt) = run_range(cfg, n, 0..n, 10, 1);

    let (mut p, first) = run_range(cfg, n, 0..n, 5, 1);
    // through serde, as a checkpoint would
    let json = serde_json::to_string(&first.adamw_state()).unwrap();
    let state: AdamWState = serde_json::from_str(&json).unwrap();
    assert_eq!(state.step, 5);
    let mut resumed = AdamW::new(n, cfg).unwrap();
    resumed.load_adamw_state(state).unwrap();
    // and through the named buffers, as a tensor checkpoint would
    let mut by_buffers = AdamW::new(n, cfg).unwrap();
    for ((name, dst), (src_name, src)) in by_buffers
        .state_buffers_mut()
        .into_iter()
        .zip(first.state_buffers())
    {
        assert_eq!(name, src_name);
        dst.copy_from_slice(src);
    }
    by_buffers.set_step_count(first.step_count());
    let mut p2 = p.clone();
    for t in 5..10 {
        let g = grads(t, n);
        resumed.step(&mut p, &g, lr_at(t)).unwrap();
        by_buffers.step(&mut p2, &g, lr_at(t)).unwrap();
    }
    assert_bitwise_eq(&p, &straight);
    assert_bitwise_eq(&p2, &straight);
    assert_eq!(resumed, straight_opt);
    assert_eq!(by_buffers, straight_opt);
}

#[test]
fn bad_lengths_are_errors_and_change_nothing() {
    let mut opt = AdamW::new(4, AdamWConfig::default()).unwrap();
    let mut p = vec![1.0f32; 4];
    let e = opt.step(&mut p[..3], &[0.1; 3], 1e-3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "adamw step: params has 3 elements, expected 4"
    );
    let e = opt.step(&mut p, &[0.1; 5], 1e-3).unwrap_err();
    assert!(matches!(
        e,
        OptimError::LengthMismatch {
            what: "grads",
            expected: 4,
            got: 5,
            ..
        }
    ));
    assert_eq!(opt.step_count(), 0);
    assert_eq!(p, [1.0; 4]);
    assert!(opt.exp_avg().iter().all(|&m| m == 0.0));
    let e = opt
        .load_adamw_state(AdamWState {
            step: 1,
            m: vec![0.0; 3],
            v: vec![0.0; 4],
        })
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "adamw load_state: m has 3 elements, expected 4"
    );
    assert!(opt.step(&mut p, &[0.1; 4], f32::NAN).is_err());
    let e = opt.step(&mut p, &[0.1; 4], -1e-3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid lr -0.0010000000474974513: must be finite and at least 0"
    );
    assert_eq!(opt.step_count(), 0);
    let e = AdamW::new(
        1,
        AdamWConfig {
            beta2: 1.0,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "invalid beta2 1: must be in [0, 1)");
}

fn overrides() -> Vec<DecayOverride> {
    let o = |range, weight_decay| DecayOverride {
        range,
        weight_decay,
    };
    vec![o(100..300, 0.0), o(300..301, 0.5), o(4000..5000, 0.0)]
}

#[test]
fn decay_overrides_equal_separate_optimizers() {
    let n = 5000;
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = AdamW::new(n, cfg).unwrap();
    opt.set_decay_overrides(overrides()).unwrap();
    let mut p = params0(n);
    // the same segments as independent optimizers, each with its weight decay
    let segments = [
        (0..100, 0.1),
        (100..300, 0.0),
        (300..301, 0.5),
        (301..4000, 0.1),
        (4000..5000, 0.0),
    ];
    let mut parts: Vec<(AdamW, Vec<f32>)> = segments
        .iter()
        .map(|(r, wd)| {
            let c = AdamWConfig {
                weight_decay: *wd,
                ..cfg
            };
            (
                AdamW::new(r.len(), c).unwrap(),
                params0(n)[r.clone()].to_vec(),
            )
        })
        .collect();
    for t in 0..10 {
        let g = grads(t, n);
        opt.step(&mut p, &g, lr_at(t)).unwrap();
        for ((o, q), (r, _)) in parts.iter_mut().zip(&segments) {
            o.step(q, &g[r.clone()], lr_at(t)).unwrap();
        }
    }
    for ((o, q), (r, _)) in parts.iter().zip(&segments) {
        assert_bitwise_eq(&p[r.clone()], q);
        assert_bitwise_eq(&opt.exp_avg_sq()[r.clone()], o.exp_avg_sq());
    }
    // and the override really changed something
    let (plain, _) = run_range(cfg, n, 0..n, 10, 1);
    assert_ne!(plain[150], p[150]);
    assert_eq!(plain[50], p[50]);
}

#[test]
fn sharded_decay_overrides_are_bitwise() {
    let n = 5000;
    let cfg = AdamWConfig::default();
    let mut whole = AdamW::new(n, cfg).unwrap();
    whole.set_decay_overrides(overrides()).unwrap();
    for world in [3usize, 7] {
        let mut shards: Vec<_> = (0..world)
            .map(|r| {
                let range = chunk_range(n, world, r);
                let mut o = AdamW::new(range.len(), cfg).unwrap();
                o.set_decay_overrides(DecayOverride::for_shard(&overrides(), range.clone()))
                    .unwrap();
                (o, params0(n)[range.clone()].to_vec(), range)
            })
            .collect();
        let mut pw = params0(n);
        let mut w = whole.clone();
        for t in 0..5 {
            let g = grads(t, n);
            w.step(&mut pw, &g, lr_at(t)).unwrap();
            for (o, q, r) in shards.iter_mut() {
                o.step(q, &g[r.clone()], lr_at(t)).unwrap();
            }
        }
        for (_, q, r) in &shards {
            assert_bitwise_eq(q, &pw[r.clone()]);
        }
    }
    assert_eq!(
        DecayOverride::for_shard(&overrides(), 250..350),
        vec![
            DecayOverride {
                range: 0..50,
                weight_decay: 0.0
            },
            DecayOverride {
                range: 50..51,
                weight_decay: 0.5
            },
        ]
    );
}

#[test]
fn bad_decay_overrides_are_rejected() {
    let mut opt = AdamW::new(100, AdamWConfig::default()).unwrap();
    let o = |range, weight_decay| DecayOverride {
        range,
        weight_decay,
    };
    let e = opt
        .set_decay_overrides(vec![o(10..20, 0.0), o(15..30, 0.0)])
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "weight decay override 15..30 is out of order or outside a buffer of 100 elements"
    );
    assert!(opt.set_decay_overrides(vec![o(90..101, 0.0)]).is_err());
    assert!(opt.set_decay_overrides(vec![o(0..1, -1.0)]).is_err());
    assert!(opt.decay_overrides().is_empty());
    // object safe: usable as a trait object
    let mut boxed: Box<dyn Optimizer> = Box::new(opt);
    let mut p = vec![1.0f32; 100];
    boxed.step(&mut p, &[0.5; 100], 1e-2).unwrap();
    assert_eq!(boxed.step_count(), 1);
    assert_eq!(boxed.state_buffers()[1].0, "exp_avg_sq");
}
