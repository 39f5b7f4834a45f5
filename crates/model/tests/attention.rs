//! `ops::causal_attention` (fused) against the composite it replaces,
//! `causal_softmax_scaled(q k^T, scale) v`: forward and the gradients of q, k and v in f64 and
//! f32, in f16 / bf16 against the f32 result on the same inputs, against central finite
//! differences (f64), at sequence lengths that are not a multiple of the CUDA kernels' tiles
//! (16 to 64 rows), t = 1, head dims 16 and 64; and its input validation.
//! `ops::causal_attention_packed` (qkv as the projection writes it) against the split, permuted
//! copy and head-major op: bitwise in every float dtype.
//!
//! Tolerances (|a - e| <= atol + rtol |e|):
//! - finite differences, f64, h = 1e-6: atol 1e-8, rtol 1e-6;
//! - fused vs composite: f64 atol 1e-12 rtol 1e-10; f32 atol 1e-6 rtol 1e-5;
//! - half vs f32 on identical inputs (exactly representable in bf16): the kernels compute in
//!   f32 and round the outputs once, but the backward reads the rounded output (`D = dO . o`):
//!   f16 atol 2e-4 rtol 4e-3, bf16 atol 2e-3 rtol 3e-2.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;
use kiln_model::{keyed_rng, ops, ModelError};
use kiln_testkit::assert_close;
use rand::Rng;

/// Deterministic values in [-1, 1], rounded to bf16 precision.
fn values(key: &str, n: usize) -> Vec<f64> {
    let mut rng = keyed_rng(77, key);
    (0..n)
        .map(|_| bf16::from_f64(2.0 * rng.gen::<f64>() - 1.0).to_f64())
        .collect()
}

/// q, k, v of shape `[b, h, t, dh]`.
struct Case {
    shape: [usize; 4],
    qkv: [Vec<f64>; 3],
}

fn case(shape: [usize; 4]) -> Case {
    let n = shape.iter().product();
    let key = format!("{shape:?}");
    Case {
        shape,
        qkv: [
            values(&format!("q{key}"), n),
            values(&format!("k{key}"), n),
            values(&format!("v{key}"), n),
        ],
    }
}

fn scale(c: &Case) -> f64 {
    1.0 / (c.shape[3] as f64).sqrt()
}

fn fused(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
    ops::causal_attention(q, k, v, scale).unwrap()
}

fn composite(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
    let s = q.matmul(&k.t().unwrap()).unwrap();
    ops::causal_softmax_scaled(&s, scale)
        .unwrap()
        .matmul(v)
        .unwrap()
}

type Attn = fn(&Tensor, &Tensor, &Tensor, f64) -> Tensor;

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The output (as f64) and the gradients of `sum(out * r)` w.r.t. q, k, v (as f64), computed in
/// `dtype`.
fn run(f: Attn, c: &Case, dtype: DType) -> (Vec<f64>, [Vec<f64>; 3]) {
    let dev = Device::Cpu;
    let vars: Vec<Var> = c
        .qkv
        .iter()
        .map(|x| {
            let t = Tensor::from_vec(x.clone(), c.shape.as_slice(), &dev).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        })
        .collect();
    let out = f(&vars[0], &vars[1], &vars[2], scale(c));
    assert_eq!(out.dims(), c.shape.as_slice());
    assert_eq!(out.dtype(), dtype);
    let acc = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let out = out.to_dtype(acc).unwrap();
    let r = Tensor::from_vec(values("r", out.elem_count()), out.shape(), &dev)
        .unwrap()
        .to_dtype(acc)
        .unwrap();
    let grads = (out.clone() * r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = |i: usize| flat(grads.get(&vars[i]).expect("no gradient reached an input"));
    (flat(&out), [g(0), g(1), g(2)])
}

const SHAPES: [[usize; 4]; 6] = [
    [2, 3, 1, 16],
    [1, 2, 5, 16],
    [1, 1, 17, 64],
    [2, 2, 67, 64],
    [1, 2, 100, 64],
    [1, 1, 130, 16],
];

fn check_against_composite(dtype: DType, atol: f64, rtol: f64) {
    for shape in SHAPES {
        let c = case(shape);
        let (yf, gf) = run(fused, &c, dtype);
        let (yc, gc) = run(composite, &c, dtype);
        assert_close(&yf, &yc, atol, rtol);
        for (a, b) in gf.iter().zip(&gc) {
            assert_close(a, b, atol, rtol);
        }
    }
}

#[test]
fn matches_composite_f64() {
    check_against_composite(DType::F64, 1e-12, 1e-10);
}

#[test]
fn matches_composite_f32() {
    check_against_composite(DType::F32, 1e-6, 1e-5);
}

#[test]
fn half_types_match_f32() {
    for shape in SHAPES {
        let c = case(shape);
        let (y32, g32) = run(fused, &c, DType::F32);
        for (dtype, atol, rtol) in [(DType::F16, 2e-4, 4e-3), (DType::BF16, 2e-3, 3e-2)] {
            let (y, g) = run(fused, &c, dtype);
            assert_close(&y, &y32, atol, rtol);
            for (a, b) in g.iter().zip(&g32) {
                assert_close(a, b, atol, rtol);
            }
        }
    }
}

/// `sum(causal_attention(q, k, v) * r)` in f64, without autograd.
fn objective(c: &Case) -> f64 {
    let dev = Device::Cpu;
    let t: Vec<Tensor> = c
        .qkv
        .iter()
        .map(|x| Tensor::from_vec(x.clone(), c.shape.as_slice(), &dev).unwrap())
        .collect();
    let out = flat(&fused(&t[0], &t[1], &t[2], scale(c)));
    let r = values("r", out.len());
    out.iter().zip(&r).map(|(a, b)| a * b).sum()
}

#[test]
fn gradients_match_finite_differences() {
    for shape in [[1, 2, 5, 16], [1, 1, 3, 64], [2, 1, 1, 16]] {
        let mut c = case(shape);
        let (_, analytic) = run(fused, &c, DType::F64);
        let h = 1e-6;
        for (which, grad) in analytic.iter().enumerate() {
            let mut numeric = Vec::new();
            for e in 0..c.qkv[which].len() {
                let v0 = c.qkv[which][e];
                c.qkv[which][e] = v0 + h;
                let up = objective(&c);
                c.qkv[which][e] = v0 - h;
                let down = objective(&c);
                c.qkv[which][e] = v0;
                numeric.push((up - down) / (2.0 * h));
            }
            assert_close(grad, &numeric, 1e-8, 1e-6);
        }
    }
}

/// One position: the output is `v` and only `v` has a gradient.
#[test]
fn single_position_is_the_value() {
    let c = case([2, 2, 1, 16]);
    let (y, [dq, dk, dv]) = run(fused, &c, DType::F32);
    let v32: Vec<f64> = c.qkv[2].iter().map(|&x| x as f32 as f64).collect();
    assert_eq!(y, v32);
    assert!(dq.iter().chain(&dk).all(|&g| g == 0.0));
    assert_eq!(dv, values("r", dv.len()));
}

/// The backward can run twice on one graph (the logsumexp stays with the op).
#[test]
fn backward_twice() {
    let c = case([1, 2, 9, 16]);
    let first = run(fused, &c, DType::F32);
    let dev = Device::Cpu;
    let vars: Vec<Var> = c
        .qkv
        .iter()
        .map(|x| {
            Var::from_tensor(
                &Tensor::from_vec(x.clone(), c.shape.as_slice(), &dev)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
            )
            .unwrap()
        })
        .collect();
    let out = fused(&vars[0], &vars[1], &vars[2], scale(&c));
    let r = Tensor::from_vec(values("r", out.elem_count()), out.shape(), &dev)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let loss = (out * r).unwrap().sum_all().unwrap();
    for _ in 0..2 {
        let grads = loss.backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            assert_eq!(flat(grads.get(v).unwrap()), first.1[i]);
        }
    }
}

/// As the model calls it: q, k, v are views at offsets into one packed `[3, b, h, t, dh]`
/// tensor, and the gradient reaches the packed tensor.
#[test]
fn views_of_a_packed_tensor() {
    let shape = [2, 2, 21, 16];
    let n: usize = shape.iter().product();
    let packed = values("packed", 3 * n);
    let dev = Device::Cpu;
    let mut dims = vec![3];
    dims.extend_from_slice(&shape);
    let run = |f: Attn| {
        let qkv = Var::from_tensor(
            &Tensor::from_vec(packed.clone(), dims.as_slice(), &dev)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        )
        .unwrap();
        let (q, k, v) = (
            qkv.get(0).unwrap(),
            qkv.get(1).unwrap(),
            qkv.get(2).unwrap(),
        );
        let y = f(&q, &k, &v, 0.25);
        let r = Tensor::from_vec(values("r", n), shape.as_slice(), &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let grads = (y.clone() * r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        (flat(&y), flat(grads.get(&qkv).unwrap()))
    };
    let (yf, gf) = run(fused);
    let (yc, gc) = run(composite);
    assert_close(&yf, &yc, 1e-6, 1e-5);
    assert_close(&gf, &gc, 1e-6, 1e-5);
}

/// `[b, t, 3 * h * dh]` through the split, permuted copy and head-major fused op, the path
/// `causal_attention_packed` replaces on the CPU: output `[b, t, h * dh]`.
fn split_then_fused(qkv: &Tensor, h: usize, scale: f64) -> Tensor {
    let (b, t, w) = qkv.dims3().unwrap();
    let dh = w / (3 * h);
    let x = qkv
        .reshape((b, t, 3, h, dh))
        .unwrap()
        .permute((2, 0, 3, 1, 4))
        .unwrap()
        .contiguous()
        .unwrap();
    let (q, k, v) = (x.get(0).unwrap(), x.get(1).unwrap(), x.get(2).unwrap());
    fused(&q, &k, &v, scale)
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((b, t, h * dh))
        .unwrap()
}

/// The output and the gradient of `qkv` of `f` on packed inputs, against a random upstream
/// gradient.
fn packed_run(
    f: &dyn Fn(&Tensor) -> Tensor,
    (b, t, h, dh): (usize, usize, usize, usize),
    dtype: DType,
) -> (Tensor, Tensor) {
    let dev = Device::Cpu;
    let n = b * t * h * dh;
    let qkv = Var::from_tensor(
        &Tensor::from_vec(values("qkv-packed", 3 * n), (b, t, 3 * h * dh), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
    let y = f(qkv.as_tensor());
    let r = Tensor::from_vec(values("r-packed", n), (b, t, h * dh), &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let grads = (y.clone() * r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    (y, grads.get(&qkv).unwrap().clone())
}

/// The packed op is the split-permute-fused path bitwise (the same kernels on the same
/// numbers, read in place instead of copied), forward and the gradient of `qkv`, in every
/// float dtype, with a sequence length that is not a multiple of the query block.
#[test]
fn packed_qkv_is_the_split_path_bitwise() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for dims in [(2, 37, 3, 16), (1, 1, 2, 8), (3, 20, 1, 24)] {
            let h = dims.2;
            let scale = 1.0 / (dims.3 as f64).sqrt();
            let (yp, gp) = packed_run(
                &|x| ops::causal_attention_packed(x, h, scale).unwrap(),
                dims,
                dtype,
            );
            let (ys, gs) = packed_run(&|x| split_then_fused(x, h, scale), dims, dtype);
            assert_eq!(yp.dims(), &[dims.0, dims.1, h * dims.3]);
            assert_eq!(gp.dims(), &[dims.0, dims.1, 3 * h * dims.3]);
            assert_eq!(flat(&yp), flat(&ys), "{dtype:?} {dims:?}: output");
            assert_eq!(flat(&gp), flat(&gs), "{dtype:?} {dims:?}: qkv gradient");
        }
    }
}

#[test]
fn packed_rejects_bad_input_naming_the_problem() {
    let dev = Device::Cpu;
    let bad_width = Tensor::zeros((1, 4, 3 * 2 * 8 + 1), DType::F32, &dev).unwrap();
    let e = ops::causal_attention_packed(&bad_width, 2, 1.0).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::Shape {
                op: "causal_attention_packed",
                what: "qkv",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("[1, 4, 49]"), "{e}");
    let rank4 = Tensor::zeros((1, 2, 4, 48), DType::F32, &dev).unwrap();
    assert!(ops::causal_attention_packed(&rank4, 2, 1.0).is_err());
    let ok = Tensor::zeros((1, 4, 48), DType::F32, &dev).unwrap();
    assert!(ops::causal_attention_packed(&ok, 0, 1.0).is_err());
    let e = ops::causal_attention_packed(&ok, 2, f64::NAN).unwrap_err();
    assert!(
        matches!(e, ModelError::InvalidArgument { what: "scale", .. }),
        "{e}"
    );
    let ints = Tensor::zeros((1, 4, 48), DType::U32, &dev).unwrap();
    let e = ops::causal_attention_packed(&ints, 2, 1.0).unwrap_err();
    assert!(matches!(e, ModelError::Dtype { what: "qkv", .. }), "{e}");
}

fn err(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> ModelError {
    match ops::causal_attention(q, k, v, scale) {
        Ok(_) => panic!("causal_attention accepted bad input"),
        Err(e) => e,
    }
}

#[test]
fn rejects_bad_input_naming_the_problem() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 2, 4, 8), DType::F32, &dev).unwrap();

    let rank3 = Tensor::zeros((2, 4, 8), DType::F32, &dev).unwrap();
    let e = err(&rank3, &rank3, &rank3, 1.0);
    assert!(
        matches!(
            e,
            ModelError::Shape {
                op: "causal_attention",
                what: "q",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("[2, 4, 8]"), "{e}");

    let empty = Tensor::zeros((1, 2, 0, 8), DType::F32, &dev).unwrap();
    let e = err(&empty, &empty, &empty, 1.0);
    assert!(matches!(e, ModelError::Shape { what: "q", .. }), "{e}");

    let short = Tensor::zeros((1, 2, 3, 8), DType::F32, &dev).unwrap();
    let e = err(&x, &short, &x, 1.0);
    assert!(
        matches!(
            e,
            ModelError::Shape {
                op: "causal_attention",
                what: "k",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "causal_attention: k has shape [1, 2, 3, 8], expected [1, 2, 4, 8], the shape of q"
    );
    let e = err(&x, &x, &short, 1.0);
    assert!(matches!(e, ModelError::Shape { what: "v", .. }), "{e}");

    let ints = Tensor::zeros((1, 2, 4, 8), DType::U32, &dev).unwrap();
    let e = err(&ints, &ints, &ints, 1.0);
    assert!(
        matches!(
            e,
            ModelError::Dtype {
                op: "causal_attention",
                what: "q",
                got: DType::U32,
                ..
            }
        ),
        "{e}"
    );
    let half = x.to_dtype(DType::F16).unwrap();
    let e = err(&x, &x, &half, 1.0);
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

    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let e = err(&x, &x, &x, bad);
        assert!(
            matches!(
                e,
                ModelError::InvalidArgument {
                    op: "causal_attention",
                    what: "scale",
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().starts_with("causal_attention: scale is "),
            "{e}"
        );
    }
}
