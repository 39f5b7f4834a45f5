//! Global-norm clipping: the exact sum of squares against a correctly rounded reference
//! (Shewchuk's algorithm, as in Python's `math.fsum`), and sharded == unsharded bitwise over
//! 2 and 4 thread ranks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_comm::{chunk_range, CommExt, Communicator};
use kiln_optim::{clip_grad_norm, clip_grad_norm_local, clip_to_norm, global_grad_norm, SquareSum};
use kiln_testkit::{assert_bitwise_eq, run_ranks};

/// Correctly rounded sum of f64 values (CPython's `math.fsum`, Shewchuk's partials).
fn fsum(xs: impl IntoIterator<Item = f64>) -> f64 {
    let mut partials: Vec<f64> = Vec::new();
    for x0 in xs {
        let mut x = x0;
        let mut i = 0;
        for j in 0..partials.len() {
            let mut y = partials[j];
            if x.abs() < y.abs() {
                std::mem::swap(&mut x, &mut y);
            }
            let hi = x + y;
            let lo = y - (hi - x);
            if lo != 0.0 {
                partials[i] = lo;
                i += 1;
            }
            x = hi;
        }
        partials.truncate(i);
        partials.push(x);
    }
    let Some(mut n) = partials.len().checked_sub(1) else {
        return 0.0;
    };
    let mut hi = partials[n];
    let mut lo = 0.0;
    while n > 0 {
        let x = hi;
        n -= 1;
        let y = partials[n];
        hi = x + y;
        lo = y - (hi - x);
        if lo != 0.0 {
            break;
        }
    }
    if n > 0 && ((lo < 0.0 && partials[n - 1] < 0.0) || (lo > 0.0 && partials[n - 1] > 0.0)) {
        let y = lo * 2.0;
        let x = hi + y;
        if y == x - hi {
            hi = x;
        }
    }
    hi
}

/// The reference: squares are exact in f64, their sum correctly rounded.
fn ref_sq_sum(v: &[f32]) -> f64 {
    fsum(v.iter().map(|&x| x as f64 * x as f64))
}

/// Deterministic f32 values with exponents spread from subnormal to 2^100, mixed signs.
fn wide(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let sign = (z >> 63) as u32;
            let exp = ((z >> 40) % 228) as u32; // 0 (subnormal) ..= 227 (2^100)
            let frac = (z as u32) & 0x7f_ffff;
            f32::from_bits(sign << 31 | exp << 23 | frac)
        })
        .collect()
}

/// Gradient-like values: normal around 1e-2 with a few large ones.
fn grads(seed: u64, n: usize) -> Vec<f32> {
    wide(seed, n)
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let m = f32::from_bits((x.to_bits() & 0x807f_ffff) | (127 << 23)) - 1.5; // [-0.5, 0.5)
            if i % 997 == 0 {
                m * 40.0
            } else {
                m * 1e-2
            }
        })
        .collect()
}

#[test]
fn square_sum_is_correctly_rounded() {
    for (seed, n) in [(1u64, 0usize), (2, 1), (3, 5), (4, 1000), (5, 100_003)] {
        let v = wide(seed, n);
        assert_eq!(
            SquareSum::of(&v).value().to_bits(),
            ref_sq_sum(&v).to_bits(),
            "seed {seed} n {n}"
        );
    }
    // exact zeros of both signs among the values (a gradient's unused embedding rows): they
    // add nothing, and the subnormals beside them keep their exact squares
    let mut zeros = wide(6, 40_000);
    for (i, x) in zeros.iter_mut().enumerate() {
        if i % 3 == 0 {
            *x = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
    }
    assert_eq!(
        SquareSum::of(&zeros).value().to_bits(),
        ref_sq_sum(&zeros).to_bits()
    );
    assert_eq!(SquareSum::of(&[0.0; 100]).value(), 0.0);
    // many of the largest f32: no overflow of the bins or the limbs
    let big = vec![f32::MAX; 70_000];
    assert_eq!(SquareSum::of(&big).value(), ref_sq_sum(&big));
    // the smallest subnormal squared is 2^-298
    assert_eq!(SquareSum::of(&[f32::from_bits(1)]).value(), 2f64.powi(-298));
}

#[test]
fn square_sum_rounds_ties_to_even_and_sees_the_smallest_term() {
    let t = 2f32.powi(-27); // t^2 = 2^-54
                            // 1 + 2^-53 exactly: a tie between 1 and 1 + 2^-52, rounds to even
    assert_eq!(SquareSum::of(&[1.0, t, t]).value(), 1.0);
    // 2^-298 more breaks the tie upwards (a naive f64 sum loses it)
    let tiny = f32::from_bits(1);
    assert_eq!(
        SquareSum::of(&[1.0, t, t, tiny]).value(),
        1.0 + f64::EPSILON
    );
    let naive: f64 = [1.0f32, t, t, tiny]
        .iter()
        .map(|&x| x as f64 * x as f64)
        .sum();
    assert_eq!(naive, 1.0);
}

#[test]
fn square_sum_does_not_depend_on_order_or_split() {
    let v = wide(9, 70_001);
    let whole = SquareSum::of(&v);
    for parts in [2usize, 3, 7] {
        let mut merged = SquareSum::new();
        for r in (0..parts).rev() {
            merged.merge(&SquareSum::of(&v[chunk_range(v.len(), parts, r)]));
        }
        assert_eq!(merged, whole);
    }
    let mut rev = v.clone();
    rev.reverse();
    assert_eq!(SquareSum::of(&rev), whole);
    for threads in [1, 2, 3, 64] {
        assert_eq!(SquareSum::of_threads(&v, threads), whole);
    }
}

#[test]
fn non_finite_values_are_flagged() {
    let mut v = grads(3, 100);
    v[10] = f32::INFINITY;
    assert_eq!(SquareSum::of(&v).value(), f64::INFINITY);
    v[20] = f32::NAN;
    let s = SquareSum::of(&v);
    assert!(s.value().is_nan() && !s.is_finite());

    let before = v.clone();
    let r = clip_grad_norm_local(&mut v, 1.0).unwrap();
    assert!(r.norm.is_nan() && !r.is_finite() && !r.clipped && r.coef == 1.0);
    assert_bitwise_eq(&v, &before);
}

#[test]
fn clip_uses_pytorch_coefficient() {
    let mut g = vec![3.0f32, -4.0, 0.0];
    let r = clip_grad_norm_local(&mut g, 2.0).unwrap();
    let coef = (2.0 / (5.0 + 1e-6)) as f32;
    assert_eq!((r.norm, r.coef, r.clipped), (5.0, coef, true));
    assert_eq!(g, [3.0 * coef, -4.0 * coef, 0.0]);

    // below max_norm: untouched, coefficient clamped to 1
    let mut g = vec![3.0f32, -4.0];
    let r = clip_grad_norm_local(&mut g, 6.0).unwrap();
    assert_eq!((r.coef, r.clipped), (1.0, false));
    assert_eq!(g, [3.0, -4.0]);
    // exactly at max_norm the 1e-6 still scales by 5 / (5 + 1e-6), as PyTorch does
    let r = clip_grad_norm_local(&mut g, 5.0).unwrap();
    assert_eq!((r.coef, r.clipped), ((5.0 / (5.0 + 1e-6)) as f32, true));
    assert!(r.coef < 1.0);

    let mut z = vec![0.0f32; 10];
    let r = clip_grad_norm_local(&mut z, 1.0).unwrap();
    assert_eq!((r.norm, r.clipped), (0.0, false));

    let e = clip_to_norm(&mut g, 1.0, 0.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid max_norm 0: must be finite and positive"
    );
}

#[test]
fn sharded_clipping_is_bitwise_unsharded() {
    for n in [10_001usize, 3] {
        let full = grads(42, n);
        let true_norm = ref_sq_sum(&full).sqrt();
        for max_norm in [0.5f32, 1e6] {
            let mut expected = full.clone();
            let local = clip_grad_norm_local(&mut expected, max_norm).unwrap();
            assert_eq!(local.norm.to_bits(), true_norm.to_bits());
            assert_eq!(local.clipped, max_norm as f64 <= true_norm, "n {n}");
            for world in [2usize, 4] {
                let out = run_ranks(world, |comm| {
                    let range = comm.my_chunk(n);
                    let mut shard = full[range].to_vec();
                    let norm = global_grad_norm(&comm, &shard)?;
                    let report = clip_grad_norm(&comm, &mut shard, max_norm)?;
                    let mut gathered = vec![0.0f32; n];
                    comm.all_gather(&shard, &mut gathered)?;
                    Ok((norm, report, gathered))
                });
                for (rank, (norm, report, gathered)) in out.into_iter().enumerate() {
                    assert_eq!(norm.to_bits(), true_norm.to_bits(), "rank {rank}/{world}");
                    assert_eq!(report, local, "rank {rank}/{world}");
                    assert_bitwise_eq(&gathered, &expected);
                }
            }
        }
    }
}

#[test]
fn a_nan_on_one_rank_is_reported_on_every_rank() {
    let n = 1000;
    for (bad, is_nan) in [(f32::NAN, true), (f32::NEG_INFINITY, false)] {
        let mut full = grads(5, n);
        full[chunk_range(n, 4, 2).start + 1] = bad;
        let out = run_ranks(4, |comm| {
            let mut shard = full[comm.my_chunk(n)].to_vec();
            let before = shard.clone();
            let r = clip_grad_norm(&comm, &mut shard, 0.1)?;
            Ok((r, shard == before || comm.rank() == 2))
        });
        for (r, untouched) in out {
            assert!(!r.is_finite() && !r.clipped && r.coef == 1.0);
            assert_eq!(r.norm.is_nan(), is_nan);
            assert!(untouched);
        }
    }
}

/// The binning a GPU kernel does (kiln-parallel's `square_bins`), on the host: each square's
/// high and low 24 bits into the bins of its exponent.
fn device_bins(values: &[f32]) -> ([u64; 256], [u64; 256], bool, bool) {
    let (mut hi, mut lo, mut nan, mut inf) = ([0u64; 256], [0u64; 256], false, false);
    for &x in values {
        let bits = x.to_bits();
        let e = ((bits >> 23) & 0xff) as usize;
        let frac = (bits & 0x7f_ffff) as u64;
        let (sq, bin) = match e {
            255 => {
                if frac != 0 {
                    nan = true;
                } else {
                    inf = true;
                }
                continue;
            }
            0 => (frac * frac, 1),
            _ => ((frac | 0x80_0000) * (frac | 0x80_0000), e),
        };
        hi[bin] += sq >> 24;
        lo[bin] += sq & 0xff_ffff;
    }
    (hi, lo, nan, inf)
}

#[test]
fn bins_from_a_device_give_the_same_sum() {
    let mut values: Vec<f32> = (0..100_000u64)
        .map(|i| {
            let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            (h as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi((i % 40) as i32 - 20)
        })
        .collect();
    values.extend([0.0, -0.0, f32::MIN_POSITIVE / 4.0, -1e-40, f32::MAX, 3e38]);
    let (hi, lo, nan, inf) = device_bins(&values);
    let mut s = SquareSum::new();
    s.add_bins(&hi, &lo, nan, inf);
    assert_eq!(s, SquareSum::of(&values));
    assert_eq!(
        s.value().to_bits(),
        SquareSum::of(&values).value().to_bits()
    );
    // in two halves, merged: the same
    let (a, b) = values.split_at(33_333);
    let mut two = SquareSum::new();
    for part in [a, b] {
        let (hi, lo, nan, inf) = device_bins(part);
        two.add_bins(&hi, &lo, nan, inf);
    }
    assert_eq!(two, s);
    // inf and NaN are flags, as with add
    let (hi, lo, nan, inf) = device_bins(&[1.0, f32::INFINITY]);
    let mut i = SquareSum::new();
    i.add_bins(&hi, &lo, nan, inf);
    assert_eq!(i.value(), f64::INFINITY);
    let (hi, lo, nan, inf) = device_bins(&[f32::NAN, f32::INFINITY]);
    let mut n = SquareSum::new();
    n.add_bins(&hi, &lo, nan, inf);
    assert!(n.value().is_nan());
    // a malformed binning (entry 0 used) is NaN, never a silently wrong sum
    let mut bad = [0u64; 256];
    bad[0] = 1;
    let mut m = SquareSum::new();
    m.add_bins(&bad, &[0; 256], false, false);
    assert!(m.value().is_nan());
}
