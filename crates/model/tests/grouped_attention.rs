//! `ops::grouped_attention` (q `[b, t, heads * dh]`, k and v `[b, t, kv_heads * dh]`) for
//! multi-head (kv_heads = heads), grouped-query (heads / 2) and multi-query (1) attention:
//! against central finite differences (f64); against an f64/f32 reference built from candle's
//! own ops (`reference::repeat_kv`, `matmul`, `reference::causal_softmax_scaled`); in f16 and
//! bf16 against the f32 result on the same inputs; bitwise against the composite it replaces
//! (permute, `ops::repeat_kv`, `ops::causal_attention`) in every float dtype; on kiln-memory's
//! tape; and its input validation. Sequence lengths 5, 37 and 70: under, between and over the
//! CPU kernels' 32-row query blocks, none a multiple of 32.
//!
//! Tolerances (|a - e| <= atol + rtol |e|):
//! - finite differences, f64, h = 1e-6: atol 1e-8, rtol 1e-6;
//! - fused vs reference: f64 atol 1e-12 rtol 1e-10; f32 atol 1e-6 rtol 1e-5;
//! - half vs f32 on identical inputs (exactly representable in bf16): `causal_attention`'s
//!   bounds (f16 atol 2e-4 rtol 4e-3, bf16 atol 2e-3 rtol 3e-2) for the output and `dq`; a
//!   key/value gradient sums its group's `heads / kv_heads` query heads' gradients, each
//!   rounded to the half type first (as the composite rounds them, bitwise), so its atol is
//!   that many times the op's. The largest atol these cases need beside rtol: f16 3.2e-4, bf16
//!   1.6e-3 (dv, multi-query, 70 positions).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;
use kiln_memory::tape;
use kiln_model::{keyed_rng, ops, reference, ModelError};
use kiln_testkit::assert_close;
use rand::Rng;

const HEADS: usize = 4;
const DH: usize = 8;
const SCALE: f64 = 0.35;

/// Deterministic values in [-1, 1], rounded to bf16 precision.
fn values(key: &str, n: usize) -> Vec<f64> {
    let mut rng = keyed_rng(4321, key);
    (0..n)
        .map(|_| bf16::from_f64(2.0 * rng.gen::<f64>() - 1.0).to_f64())
        .collect()
}

/// q, k, v of one case: `[b, t, heads * dh]`, `[b, t, kv * dh]` twice.
struct Case {
    b: usize,
    t: usize,
    heads: usize,
    kv: usize,
    dh: usize,
    qkv: [Vec<f64>; 3],
}

impl Case {
    fn new(b: usize, t: usize, heads: usize, kv: usize, dh: usize) -> Self {
        let key = format!("{b}.{t}.{heads}.{kv}.{dh}");
        let (nq, nkv) = (b * t * heads * dh, b * t * kv * dh);
        Case {
            b,
            t,
            heads,
            kv,
            dh,
            qkv: [
                values(&format!("q{key}"), nq),
                values(&format!("k{key}"), nkv),
                values(&format!("v{key}"), nkv),
            ],
        }
    }

    fn shape(&self, i: usize) -> (usize, usize, usize) {
        let n = if i == 0 { self.heads } else { self.kv };
        (self.b, self.t, n * self.dh)
    }

    fn tensors(&self, dtype: DType) -> Vec<Tensor> {
        (0..3)
            .map(|i| {
                Tensor::from_vec(self.qkv[i].clone(), self.shape(i), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            })
            .collect()
    }
}

type Attn = dyn Fn(&Case, &[Tensor]) -> Tensor;

fn fused(c: &Case, x: &[Tensor]) -> Tensor {
    ops::grouped_attention(&x[0], &x[1], &x[2], c.heads, c.kv, SCALE).unwrap()
}

/// `[b, t, n * dh] -> [b, n, t, dh]`.
fn heads_first(c: &Case, x: &Tensor, n: usize) -> Tensor {
    x.reshape((c.b, c.t, n, c.dh))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

/// `[b, heads, t, dh] -> [b, t, heads * dh]`.
fn heads_side_by_side(c: &Case, y: &Tensor) -> Tensor {
    y.transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((c.b, c.t, c.heads * c.dh))
        .unwrap()
}

/// The composite `grouped_attention` replaces: kiln's `repeat_kv` and `causal_attention`.
fn composite(c: &Case, x: &[Tensor]) -> Tensor {
    let g = c.heads / c.kv;
    let k = ops::repeat_kv(&heads_first(c, &x[1], c.kv), g).unwrap();
    let v = ops::repeat_kv(&heads_first(c, &x[2], c.kv), g).unwrap();
    let y = ops::causal_attention(&heads_first(c, &x[0], c.heads), &k, &v, SCALE).unwrap();
    heads_side_by_side(c, &y)
}

/// From candle's own ops only: Hugging Face's `repeat_kv`, `q k^T`, a causal softmax, `p v`.
fn reference(c: &Case, x: &[Tensor]) -> Tensor {
    let g = c.heads / c.kv;
    let k = reference::repeat_kv(&heads_first(c, &x[1], c.kv), g).unwrap();
    let v = reference::repeat_kv(&heads_first(c, &x[2], c.kv), g).unwrap();
    let q = heads_first(c, &x[0], c.heads);
    let s = q.matmul(&k.t().unwrap()).unwrap();
    let p = reference::causal_softmax_scaled(&s, SCALE).unwrap();
    heads_side_by_side(c, &p.matmul(&v).unwrap())
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The output and the gradients of `sum(out * r)` w.r.t. q, k, v, computed in `dtype`; all
/// four in `dtype`.
fn run_raw(f: &Attn, c: &Case, dtype: DType) -> [Tensor; 4] {
    let vars: Vec<Var> = c
        .tensors(dtype)
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(c, &ts);
    assert_eq!(out.dims(), &[c.b, c.t, c.heads * c.dh]);
    assert_eq!(out.dtype(), dtype);
    let acc = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let r = Tensor::from_vec(values("r", out.elem_count()), out.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(acc)
        .unwrap();
    let grads = (out.to_dtype(acc).unwrap() * r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = |i: usize| {
        let g = grads.get(&vars[i]).expect("no gradient reached an input");
        assert_eq!(g.dims(), vars[i].dims());
        g.clone()
    };
    [out, g(0), g(1), g(2)]
}

/// [`run_raw`] as f64 values: the output and the three gradients.
fn run(f: &Attn, c: &Case, dtype: DType) -> (Vec<f64>, Vec<Vec<f64>>) {
    let [y, dq, dk, dv] = run_raw(f, c, dtype);
    (flat(&y), vec![flat(&dq), flat(&dk), flat(&dv)])
}

/// `sum(grouped_attention(q, k, v) * r)` in f64, without autograd.
fn objective(c: &Case) -> f64 {
    let out = flat(&fused(c, &c.tensors(DType::F64)));
    let r = values("r", out.len());
    out.iter().zip(&r).map(|(a, b)| a * b).sum()
}

fn check_finite_differences(c: &mut Case) {
    let (_, analytic) = run(&fused, c, DType::F64);
    let h = 1e-6;
    for (which, grad) in analytic.iter().enumerate() {
        let mut numeric = Vec::new();
        for e in 0..c.qkv[which].len() {
            let v0 = c.qkv[which][e];
            c.qkv[which][e] = v0 + h;
            let up = objective(c);
            c.qkv[which][e] = v0 - h;
            let down = objective(c);
            c.qkv[which][e] = v0;
            numeric.push((up - down) / (2.0 * h));
        }
        assert_close(grad, &numeric, 1e-8, 1e-6);
    }
}

fn check_against_reference(c: &Case, dtype: DType) {
    let (atol, rtol) = if dtype == DType::F64 {
        (1e-12, 1e-10)
    } else {
        (1e-6, 1e-5)
    };
    let (yf, gf) = run(&fused, c, dtype);
    let (yr, gr) = run(&reference, c, dtype);
    assert_close(&yf, &yr, atol, rtol);
    for (a, b) in gf.iter().zip(&gr) {
        assert_close(a, b, atol, rtol);
    }
}

fn check_half(c: &Case) {
    let (y32, g32) = run(&fused, c, DType::F32);
    let groups = (c.heads / c.kv) as f64;
    for (dtype, atol, rtol) in [(DType::F16, 2e-4, 4e-3), (DType::BF16, 2e-3, 3e-2)] {
        let (y, g) = run(&fused, c, dtype);
        assert_close(&y, &y32, atol, rtol);
        assert_close(&g[0], &g32[0], atol, rtol);
        // dk, dv: the sum of `groups` query heads' gradients, each rounded on its own
        for (a, b) in g[1..].iter().zip(&g32[1..]) {
            assert_close(a, b, groups * atol, rtol);
        }
    }
}

/// Multi-head, grouped-query and multi-query attention.
const KV_HEADS: [usize; 3] = [HEADS, HEADS / 2, 1];

#[test]
fn gradients_match_finite_differences() {
    for kv in KV_HEADS {
        for (b, t) in [(2, 5), (1, 37)] {
            check_finite_differences(&mut Case::new(b, t, HEADS, kv, DH));
        }
    }
}

#[test]
fn matches_the_reference_in_f64_and_f32() {
    for kv in KV_HEADS {
        for (b, t) in [(2, 5), (1, 37), (2, 70)] {
            let c = Case::new(b, t, HEADS, kv, DH);
            check_against_reference(&c, DType::F64);
            check_against_reference(&c, DType::F32);
        }
    }
}

#[test]
fn half_types_match_f32() {
    for kv in KV_HEADS {
        for (b, t) in [(2, 5), (1, 37), (2, 70)] {
            check_half(&Case::new(b, t, HEADS, kv, DH));
        }
    }
}

/// At a size where the heads run on candle's worker pool: 8 query heads of 32 on 2 key/value
/// heads, 100 positions.
#[test]
fn multithreaded_matches_the_reference() {
    let c = Case::new(2, 100, 8, 2, 32);
    check_against_reference(&c, DType::F32);
}

/// The fused op is the composite it replaces bit for bit: the same kernels on the same
/// numbers, each head's rows read in place instead of permuted and repeated copies, and each
/// key/value head's gradient summed over its group in head order as `repeat_kv`'s backward
/// sums it. Output and all three gradients, every float dtype.
#[test]
fn is_the_repeat_kv_composite_bitwise() {
    let bits = |t: &Tensor| -> Vec<u64> { flat(t).into_iter().map(f64::to_bits).collect() };
    for kv in KV_HEADS {
        for (b, t) in [(2, 5), (1, 37), (2, 70)] {
            let c = Case::new(b, t, HEADS, kv, DH);
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let f = run_raw(&fused, &c, dtype);
                let k = run_raw(&composite, &c, dtype);
                for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
                    assert_eq!(f[i].dtype(), dtype);
                    assert!(
                        bits(&f[i]) == bits(&k[i]),
                        "{what}: kv_heads {kv}, t {t}, {dtype:?}"
                    );
                }
            }
        }
    }
    let big = Case::new(2, 100, 8, 2, 32);
    let (f, k) = (
        run(&fused, &big, DType::F32),
        run(&composite, &big, DType::F32),
    );
    assert_eq!(f, k);
}

/// On kiln-memory's tape: one record, which alone leads from q, k, v to the output, and whose
/// backward gives candle's gradients.
#[test]
fn records_one_op_on_the_tape() {
    let c = Case::new(2, 37, HEADS, 2, DH);
    let vars: Vec<Var> = c
        .tensors(DType::F32)
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (out, tape) = tape::record(|| fused(&c, &ts));
    assert_eq!(tape.len(), 1);
    assert!(tape.covers(&out));
    let r = Tensor::from_vec(values("r", out.elem_count()), out.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let from_tape = tape.backward(&out, r).unwrap().unwrap();
    let (_, want) = run(&fused, &c, DType::F32);
    for (v, w) in vars.iter().zip(&want) {
        assert_eq!(&flat(from_tape.get(v).unwrap()), w);
    }
}

fn err(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, kv: usize, scale: f64) -> ModelError {
    match ops::grouped_attention(q, k, v, heads, kv, scale) {
        Ok(_) => panic!("grouped_attention accepted bad input"),
        Err(e) => e,
    }
}

#[test]
fn rejects_bad_input_naming_the_problem() {
    let dev = Device::Cpu;
    let z = |d: &[usize], dtype: DType| Tensor::zeros(d, dtype, &dev).unwrap();
    // 4 query heads of 8 on 2 key/value heads
    let q = z(&[2, 3, 32], DType::F32);
    let kv = z(&[2, 3, 16], DType::F32);
    assert!(ops::grouped_attention(&q, &kv, &kv, 4, 2, 1.0).is_ok());

    for (heads, kvh, what) in [(0, 2, "heads"), (4, 0, "kv_heads")] {
        let e = err(&q, &kv, &kv, heads, kvh, 1.0);
        assert!(
            matches!(e, ModelError::InvalidArgument { op: "grouped_attention", what: w, .. } if w == what),
            "{e}"
        );
    }
    let e = err(&q, &kv, &kv, 4, 3, 1.0);
    assert!(
        matches!(
            e,
            ModelError::KvHeadsDoNotDivide {
                op: "grouped_attention",
                heads: 4,
                kv_heads: 3
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "grouped_attention: kv_heads (3) must divide heads (4)"
    );

    // q: not rank 3, a zero size, a width that is not heads * head_dim
    for bad in [&[2, 3, 4, 8][..], &[2, 0, 32], &[2, 3, 30]] {
        let e = err(&z(bad, DType::F32), &kv, &kv, 4, 2, 1.0);
        assert!(
            matches!(
                e,
                ModelError::Shape {
                    op: "grouped_attention",
                    what: "q",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
    }
    // k and v: another head_dim, batch or sequence than q's
    let e = err(&q, &z(&[2, 3, 12], DType::F32), &kv, 4, 2, 1.0);
    assert!(matches!(e, ModelError::Shape { what: "k", .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "grouped_attention: k has shape [2, 3, 12], expected [2, 3, 16]: q's batch and seq, \
         2 kv_heads of q's head_dim 8"
    );
    for bad in [&[1, 3, 16][..], &[2, 4, 16]] {
        let e = err(&q, &kv, &z(bad, DType::F32), 4, 2, 1.0);
        assert!(matches!(e, ModelError::Shape { what: "v", .. }), "{e}");
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
    }

    let ints = z(&[2, 3, 32], DType::U32);
    let kv_ints = z(&[2, 3, 16], DType::U32);
    let e = err(&ints, &kv_ints, &kv_ints, 4, 2, 1.0);
    assert!(
        matches!(
            e,
            ModelError::Dtype {
                op: "grouped_attention",
                what: "q",
                got: DType::U32,
                ..
            }
        ),
        "{e}"
    );
    let half = z(&[2, 3, 16], DType::F16);
    let e = err(&q, &kv, &half, 4, 2, 1.0);
    assert!(
        matches!(
            e,
            ModelError::Dtype {
                what: "v",
                got: DType::F16,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&q, &half, &kv, 4, 2, 1.0);
    assert!(matches!(e, ModelError::Dtype { what: "k", .. }), "{e}");

    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let e = err(&q, &kv, &kv, 4, 2, bad);
        assert!(
            matches!(
                e,
                ModelError::InvalidArgument {
                    op: "grouped_attention",
                    what: "scale",
                    ..
                }
            ),
            "{e}"
        );
    }
}
