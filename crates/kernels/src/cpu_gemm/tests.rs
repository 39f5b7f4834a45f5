//! Tests of the parent module.

use super::*;

/// Items cover every panel once, in order, sizes within one panel of each other; their
/// count is a multiple of the thread count, at least two a thread, where there are panels
/// enough; a packed item holds at most `A_ITEM_BYTES` where one panel fits.
#[test]
fn items_are_few_balanced_and_fit() {
    for threads in [1, 2, 3, 8] {
        for m in [1, 12, 100, 512, 1000, 1024, 2048, 8192] {
            for units in [64, 256, 1024, 8192] {
                for packed in [false, true] {
                    let starts = item_panels(m, units, packed, threads);
                    let panels = m.div_ceil(MR);
                    let what = format!("m {m} units {units} threads {threads}: {starts:?}");
                    assert_eq!((starts[0], starts[starts.len() - 1]), (0, panels), "{what}");
                    let sizes: Vec<usize> = starts.windows(2).map(|w| w[1] - w[0]).collect();
                    let (lo, hi) = (sizes.iter().min(), sizes.iter().max());
                    assert!(lo >= Some(&1) && hi <= lo.map(|l| l + 1).as_ref(), "{what}");
                    if packed && 4 * MR * units <= A_ITEM_BYTES {
                        assert!(4 * MR * units * hi.unwrap_or(&0) <= A_ITEM_BYTES, "{what}");
                    }
                    if panels >= 2 * threads {
                        assert!(sizes.len() >= 2 * threads, "{what}");
                        assert_eq!(sizes.len() % threads, 0, "{what}");
                    }
                }
            }
        }
    }
    // the weight gradient of a 512-row product on 2 threads: 4 items of 10 or 11 panels,
    // where there were 22 items of 2
    assert_eq!(item_panels(512, 1024, true, 2), vec![0, 10, 21, 32, 43]);
}

fn ops(bf16_dot: bool) -> Operands {
    if bf16_dot {
        Operands::Bf16Dot
    } else {
        Operands::Exact
    }
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
        })
        .collect()
}

/// `a b` in f64 over the given values.
fn reference<T: Copy>(
    (m, n, k): (usize, usize, usize),
    a: &Mat<'_, T>,
    b: &Mat<'_, T>,
    val: impl Fn(T) -> f64,
) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|kk| val(a.data[i * a.rs + kk * a.cs]) * val(b.data[kk * b.rs + j * b.cs]))
                .sum();
        }
    }
    out
}

const SHAPES: [(usize, usize, usize); 7] = [
    (1, 1, 1),
    (9, 1100, 40),
    (3, 5, 7),
    (8, 32, 2),
    (17, 33, 9),
    (40, 70, 129),
    (19, 45, 600),
];

/// Both operands in each of their two layouts.
fn layouts<'a, T>(
    av: &'a [T],
    bv: &'a [T],
    (m, n, k): (usize, usize, usize),
) -> Vec<(Mat<'a, T>, Mat<'a, T>)> {
    let mut out = Vec::new();
    for ta in [false, true] {
        for tb in [false, true] {
            let a = if ta {
                Mat {
                    data: av,
                    rs: 1,
                    cs: m,
                }
            } else {
                Mat {
                    data: av,
                    rs: k,
                    cs: 1,
                }
            };
            let b = if tb {
                Mat {
                    data: bv,
                    rs: 1,
                    cs: k,
                }
            } else {
                Mat {
                    data: bv,
                    rs: n,
                    cs: 1,
                }
            };
            out.push((a, b));
        }
    }
    out
}

/// The f32 kernel against f64 sums, every layout and edge size, with and without
/// accumulation (more than one reduction block at k = 600).
#[test]
fn f32_kernel_matches_f64_for_every_layout() {
    if !has_avx512() {
        println!("this CPU has no AVX-512: the f32 kernel was not exercised");
        return;
    }
    for &(m, n, k) in &SHAPES {
        let (av, bv, init) = (rand(m * k, 1), rand(k * n, 2), rand(m * n, 3));
        for (a, b) in layouts(&av, &bv, (m, n, k)) {
            let want = reference((m, n, k), &a, &b, f64::from);
            for accumulate in [false, true] {
                let mut dst = init.clone();
                assert!(gemm_f32_exact(&mut dst, accumulate, (m, n, k), a, b));
                for (i, (&got, &w)) in dst.iter().zip(&want).enumerate() {
                    let w = w + if accumulate { f64::from(init[i]) } else { 0.0 };
                    let tol = 1e-6 * k as f64;
                    assert!(
                        (f64::from(got) - w).abs() <= tol,
                        "{m}x{n}x{k} acc={accumulate} [{i}]: {got} vs {w}"
                    );
                }
            }
        }
    }
}

/// bf16 products, of bf16 tensors and of f32 tensors, against f64 sums of the bf16 values:
/// within the f32 accumulation (plus one bf16 rounding of a bf16 result).
#[test]
fn bf16_kernels_match_f64_for_every_layout() {
    for &(m, n, k) in &SHAPES {
        let (av, bv, init) = (rand(m * k, 4), rand(k * n, 5), rand(m * n, 6));
        let (ah, bh): (Vec<bf16>, Vec<bf16>) = (
            av.iter().map(|&v| bf16::from_f32(v)).collect(),
            bv.iter().map(|&v| bf16::from_f32(v)).collect(),
        );
        for ((a, b), (a32, b32)) in
            layouts(&ah, &bh, (m, n, k))
                .into_iter()
                .zip(layouts(&av, &bv, (m, n, k)))
        {
            let want = reference((m, n, k), &a, &b, |v: bf16| v.to_f64());
            for (accumulate, dot) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut d16: Vec<bf16> = init.iter().map(|&v| bf16::from_f32(v)).collect();
                let start16 = d16.clone();
                gemm_pairs(&mut d16, accumulate, (m, n, k), a, b, dot);
                let mut d32 = init.clone();
                gemm_f32_bf16(&mut d32, accumulate, (m, n, k), a32, b32);
                for i in 0..m * n {
                    let base16 = if accumulate { start16[i].to_f64() } else { 0.0 };
                    let base32 = if accumulate { f64::from(init[i]) } else { 0.0 };
                    let (w16, w32) = (want[i] + base16, want[i] + base32);
                    let acc_tol = 1e-6 * k as f64;
                    let got16 = d16[i].to_f64();
                    assert!(
                        (got16 - w16).abs() <= w16.abs() * 2f64.powi(-8) + acc_tol,
                        "bf16 {m}x{n}x{k} acc={accumulate} [{i}]: {got16} vs {w16}"
                    );
                    let got32 = f64::from(d32[i]);
                    assert!(
                        (got32 - w32).abs() <= acc_tol,
                        "f32-bf16 {m}x{n}x{k} acc={accumulate} [{i}]: {got32} vs {w32}"
                    );
                }
            }
        }
    }
    if !has_bf16_dot() {
        println!("this CPU has no avx512_bf16: the dot-product kernel was not exercised");
    }
}

/// Rounding packed panels in place or as they are copied (the f16 one through the
/// hardware conversions, 16 at a time) is bitwise the scalar rounding, NaN included, over every upper half of the f32
/// bits with lower halves at and around the rounding boundaries, and a length with a tail.
#[test]
fn rounding_in_place_is_the_scalar_rounding() {
    let lows = [
        0u32, 1, 0x0fff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001, 0xabcd, 0xffff,
    ];
    let mut bits: Vec<u32> = (0u32..1 << 16)
        .flat_map(|hi| lows.iter().map(move |lo| hi << 16 | lo))
        .collect();
    bits.push(0x3f80_0001); // a tail shorter than a vector
    type Round = fn(f32) -> f32;
    let scalars: [(Rounding, Round); 2] = [
        (Rounding::F16, crate::fastmath::round_f16),
        (Rounding::Bf16, crate::fastmath::round_bf16),
    ];
    let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    for (r, scalar) in scalars {
        let mut got = bits.clone();
        pack::round_in_place(&mut got, r);
        // and rounded as copied, into a buffer holding anything
        let mut copied = vec![0xdead_beef_u32; bits.len()];
        pack::round_into(&mut copied, &values, r);
        for ((&x, &g), &c) in bits.iter().zip(&got).zip(&copied) {
            let want = scalar(f32::from_bits(x)).to_bits();
            assert_eq!(g, want, "{r:?} {x:#010x}");
            assert_eq!(c, want, "{r:?} {x:#010x}, rounded as copied");
        }
    }
}

/// Operands rounded as they are packed give bitwise the f32 kernel's product of rounded
/// copies, for every layout and edge size, into a buffer (with and without accumulation)
/// and into a fresh one: the same values summed in the same order.
#[test]
fn rounding_while_packing_is_the_product_of_rounded_copies() {
    if !has_avx512() {
        println!("this CPU has no AVX-512: rounding while packing was not exercised");
        return;
    }
    type Round = fn(f32) -> f32;
    let roundings: [(Rounding, Round); 2] = [
        (Rounding::Bf16, crate::fastmath::round_bf16),
        (Rounding::F16, crate::fastmath::round_f16),
    ];
    for &(m, n, k) in SHAPES.iter().chain(&[(70, 40, 33)]) {
        // some beyond f16's range
        let av: Vec<f32> = rand(m * k, 13).iter().map(|v| v * 9e4).collect();
        let (bv, init) = (rand(k * n, 14), rand(m * n, 15));
        for (r, round) in roundings {
            let (ar, br): (Vec<f32>, Vec<f32>) = (
                av.iter().map(|&v| round(v)).collect(),
                bv.iter().map(|&v| round(v)).collect(),
            );
            for ((a, b), (a2, b2)) in
                layouts(&av, &bv, (m, n, k))
                    .into_iter()
                    .zip(layouts(&ar, &br, (m, n, k)))
            {
                for accumulate in [false, true] {
                    let mut got = init.clone();
                    assert!(gemm_f32(
                        &mut got,
                        accumulate,
                        (m, n, k),
                        a,
                        b,
                        Operands::Rounded(r)
                    ));
                    let mut want = init.clone();
                    assert!(gemm_f32_exact(&mut want, accumulate, (m, n, k), a2, b2));
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{r:?} {m}x{n}x{k} acc={accumulate}"
                    );
                    if accumulate {
                        continue;
                    }
                    let mut fresh = vec![MaybeUninit::new(f32::NAN); m * n];
                    assert!(gemm_f32_fresh(
                        &mut fresh,
                        Operands::Rounded(r),
                        (m, n, k),
                        a,
                        b
                    ));
                    // SAFETY: the buffer was initialised (to NaN) when it was made
                    let fresh: Vec<f32> =
                        fresh.iter().map(|v| unsafe { v.assume_init() }).collect();
                    assert_eq!(bits(&fresh), bits(&want), "fresh {r:?} {m}x{n}x{k}");
                }
            }
        }
    }
}

/// A product into a fresh buffer writes every element, bitwise what the product into a
/// zeroed buffer gives, for every layout and edge size at both precisions (the buffer
/// starts as NaN, so an element left unwritten would show).
#[test]
fn fresh_products_write_every_element() {
    for &(m, n, k) in SHAPES.iter().chain(&[(5, 7, 0)]) {
        let (av, bv) = (rand(m * k, 9), rand(k * n, 10));
        for (a, b) in layouts(&av, &bv, (m, n, k)) {
            for bf16_operands in [false, true] {
                let mut fresh = vec![MaybeUninit::new(f32::NAN); m * n + 3];
                if !gemm_f32_fresh(&mut fresh, ops(bf16_operands), (m, n, k), a, b) {
                    println!("this CPU lacks the kernel: fresh products were not exercised");
                    return;
                }
                let mut zeroed = vec![0f32; m * n];
                if bf16_operands {
                    gemm_f32_bf16(&mut zeroed, false, (m, n, k), a, b);
                } else {
                    assert!(gemm_f32_exact(&mut zeroed, false, (m, n, k), a, b));
                }
                // SAFETY: the buffer was initialised (to NaN) when it was made
                let got: Vec<u32> = fresh
                    .iter()
                    .map(|v| unsafe { v.assume_init() }.to_bits())
                    .collect();
                let want: Vec<u32> = zeroed.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got[..m * n], want[..], "{m}x{n}x{k} bf16={bf16_operands}");
                assert!(got[m * n..].iter().all(|&v| f32::from_bits(v).is_nan()));
            }
        }
    }
}

/// Packing buffers are reused as they are: every element a product reads was written by
/// its own packing. The kept buffers start as NaN here, so a panel element left from an
/// earlier product (or never written) would show in the results, at every edge size,
/// layout and precision.
#[test]
fn reused_packing_buffers_leave_no_trace() {
    let poison = 0x7fc0_7fc0u32; // a NaN as f32, and two bf16 NaNs as a pair
    for &(m, n, k) in &SHAPES {
        let (av, bv) = (rand(m * k, 11), rand(k * n, 12));
        for (a, b) in layouts(&av, &bv, (m, n, k)) {
            for bf16_operands in [false, true] {
                scratch::put_b(vec![poison; 1 << 16]);
                scratch::put_a(vec![poison; 1 << 16], vec![poison; 1 << 16]);
                let mut got = vec![MaybeUninit::new(0f32); m * n];
                if !gemm_f32_fresh(&mut got, ops(bf16_operands), (m, n, k), a, b) {
                    println!("this CPU lacks the kernel: buffer reuse was not exercised");
                    return;
                }
                let val = |v: f32| {
                    if bf16_operands {
                        f64::from(bf16::from_f32(v).to_f32())
                    } else {
                        f64::from(v)
                    }
                };
                let want = reference((m, n, k), &a, &b, val);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    // SAFETY: the buffer was initialised (to 0) when it was made
                    let g = f64::from(unsafe { g.assume_init() });
                    assert!(
                        (g - w).abs() <= 1e-5 * k as f64,
                        "{m}x{n}x{k} bf16={bf16_operands} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// The dot-product kernel and the widened fallback agree to the accumulation order, and
/// the kernel gives the same bits on every run.
#[test]
fn bf16_kernel_and_fallback_agree() {
    let (m, n, k) = (37, 70, 300);
    let (av, bv) = (rand(m * k, 7), rand(k * n, 8));
    let a = Mat {
        data: &av,
        rs: k,
        cs: 1,
    };
    let b = Mat {
        data: &bv,
        rs: n,
        cs: 1,
    };
    let mut fast = vec![0f32; m * n];
    gemm_f32_bf16(&mut fast, false, (m, n, k), a, b);
    let mut again = vec![0f32; m * n];
    gemm_f32_bf16(&mut again, false, (m, n, k), a, b);
    assert_eq!(fast, again);
    let mut slow = vec![0f32; m * n];
    widened(&mut slow, false, (m, n, k), a, b);
    let worst = fast
        .iter()
        .zip(&slow)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-4, "worst {worst}");
}
