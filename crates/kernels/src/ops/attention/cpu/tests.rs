//! Tests of the CPU attention kernels.

use super::*;

/// The portable path (separate multiply and add) and the dispatched one (AVX2 + FMA where
/// the CPU has them) agree to rounding: on an FMA machine the tests of `tests/attention.rs`
/// run only the latter.
#[test]
fn portable_path_matches_the_dispatched_one() -> candle_core::Result<()> {
    let (t, dh) = (37, 24);
    let n = 2 * t * dh;
    let val = |i: usize, s: usize| (((i * 7919 + s * 104_729) % 1000) as f32 / 500.0) - 1.0;
    let (q, k, v, d_o): (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) = (
        (0..n).map(|i| val(i, 1)).collect(),
        (0..n).map(|i| val(i, 2)).collect(),
        (0..n).map(|i| val(i, 3)).collect(),
        (0..n).map(|i| val(i, 4)).collect(),
    );
    let x = Qkv {
        q: &q,
        k: &k,
        v: &v,
        t,
        dh,
        rows: Rows::HeadMajor,
    };
    let scale = 0.3f32;
    let (o, lse) = forward(&x, f64::from(scale))?;
    let all = Grads {
        d_o: &d_o,
        o: &o,
        lse: &lse,
    };
    let grads = backward(&x, &all, f64::from(scale))?;
    let close = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{x} vs {y}");
        }
    };
    let mut w = Scratch::default();
    let head = t * dh;
    for h in 0..2 {
        let xh = x.head(h);
        let mut oh = vec![0f32; head];
        let mut lh = vec![0f64; t];
        fwd_head(&xh, scale, &mut oh, &mut lh, &mut w, Simd::Portable);
        close(&oh, &o[h * head..(h + 1) * head]);
        for (a, b) in lh.iter().zip(&lse[h * t..(h + 1) * t]) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let (mut dq, mut dk, mut dv) = (vec![0f32; head], vec![0f32; head], vec![0f32; head]);
        let gh = all.head(h, t, dh, Rows::HeadMajor);
        let out = HeadGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        bwd_head(&xh, &gh, scale, out, &mut w, Simd::Portable);
        for (c, mine) in [dq, dk, dv].iter().enumerate() {
            let at = c * n + h * head;
            close(mine, &grads[at..at + head]);
        }
    }
    Ok(())
}
/// The AVX2 and AVX-512 copies compute the same numbers, bitwise (every reduction's lanes
/// are explicit and every fused multiply-add is asked for), so a run does not depend on
/// which copy the CPU picks.
#[test]
fn avx2_and_avx512_copies_agree_bitwise() {
    if simd() != Simd::Avx512 {
        println!("skipped: this CPU has no AVX-512F, AVX2 and FMA");
        return;
    }
    let (t, dh) = (45, 32);
    let n = t * dh;
    let val = |i: usize, s: usize| (((i * 7919 + s * 104_729) % 1000) as f32 / 500.0) - 1.0;
    let [q, k, v, d_o]: [Vec<f32>; 4] = [1, 2, 3, 4].map(|s| (0..n).map(|i| val(i, s)).collect());
    let xh = Head {
        q: &q,
        k: &k,
        v: &v,
        t,
        dh,
        rq: dh,
        rkv: dh,
    };
    let run = |simd: Simd| {
        let mut w = Scratch::default();
        let (mut o, mut lse) = (vec![0f32; n], vec![0f64; t]);
        fwd_head(&xh, 0.2f32, &mut o, &mut lse, &mut w, simd);
        let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let g = HeadG {
            d_o: &d_o,
            o: &o,
            lse: &lse,
            rs: dh,
        };
        let out = HeadGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        bwd_head(&xh, &g, 0.2f32, out, &mut w, simd);
        (o, lse, dq, dk, dv)
    };
    let (a, b) = (run(Simd::Avx2), run(Simd::Avx512));
    assert_eq!(a.1, b.1, "logsumexp");
    for (what, x, y) in [
        ("o", &a.0, &b.0),
        ("dq", &a.2, &b.2),
        ("dk", &a.3, &b.3),
        ("dv", &a.4, &b.4),
    ] {
        let same = x
            .iter()
            .zip(y.iter())
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{what} differs between the AVX2 and AVX-512 copies");
    }
}
