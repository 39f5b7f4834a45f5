//! The fused ops (LayerNorm, RMSNorm, causal softmax, GELU, bias-GELU, SwiGLU, rotary
//! embedding, repeated key/value heads, cross-entropy) against central finite differences (f64), against composite candle implementations (f64, f32, and at sizes that take the multi-threaded path), and in f16 /
//! bf16 against the f32 result on the same inputs.
//!
//! Tolerances (|a - e| <= atol + rtol |e|):
//! - finite differences, f64, h = 1e-6: atol 1e-7, rtol 1e-6 (truncation error ~h^2);
//! - fused vs composite: f64 atol 1e-11 rtol 1e-9; f32 atol 2e-5 rtol 1e-4;
//! - half vs f32 on identical inputs (values exactly representable in bf16, hence in f16 and
//!   f32): the kernels compute in f32 and round once, so the bound is about one ulp of the
//!   half type: f16 atol 1e-4 rtol 2e-3 (ulp 2^-10), bf16 atol 1e-3 rtol 1.6e-2 (ulp 2^-7).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;
use kiln_model::{keyed_rng, ops, reference};
use kiln_testkit::assert_close;
use rand::Rng;

type OpFn = dyn Fn(&[Tensor]) -> anyhow::Result<Tensor>;

/// Deterministic values in [-scale, scale] + offset, rounded to bf16 precision.
fn values(key: &str, n: usize, scale: f64, offset: f64) -> Vec<f64> {
    let mut rng = keyed_rng(1234, key);
    (0..n)
        .map(|_| {
            let v = offset + scale * (2.0 * rng.gen::<f64>() - 1.0);
            bf16::from_f64(v).to_f64()
        })
        .collect()
}

struct Input {
    shape: Vec<usize>,
    vals: Vec<f64>,
    grad: bool,
}

fn input(key: &str, shape: &[usize], scale: f64, offset: f64, grad: bool) -> Input {
    let n = shape.iter().product();
    Input {
        shape: shape.to_vec(),
        vals: values(key, n, scale, offset),
        grad,
    }
}

/// Runs `f` on the inputs in `dtype`; returns the output (as f64) and the gradient of
/// `sum(out * r)` w.r.t. each input marked `grad` (as f64), with `r` drawn from `r_key`.
fn run(f: &OpFn, inputs: &[Input], dtype: DType, r_key: &str) -> (Vec<f64>, Vec<Vec<f64>>) {
    let dev = Device::Cpu;
    let vars: Vec<Var> = inputs
        .iter()
        .map(|i| {
            let t = Tensor::from_vec(i.vals.clone(), i.shape.as_slice(), &dev).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        })
        .collect();
    let tensors: Vec<Tensor> = vars
        .iter()
        .zip(inputs)
        .map(|(v, i)| {
            if i.grad {
                v.as_tensor().clone()
            } else {
                v.as_detached_tensor()
            }
        })
        .collect();
    let out = f(&tensors).unwrap();
    let acc = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let out_acc = out.to_dtype(acc).unwrap();
    let r = Tensor::from_vec(values(r_key, out.elem_count(), 1.0, 0.0), out.shape(), &dev)
        .unwrap()
        .to_dtype(acc)
        .unwrap();
    let l = (out_acc.clone() * r).unwrap().sum_all().unwrap();
    let grads = l.backward().unwrap();
    let gs = vars
        .iter()
        .zip(inputs)
        .filter(|(_, i)| i.grad)
        .map(|(v, _)| flat(grads.get(v).expect("no gradient reached an input")))
        .collect();
    (flat(&out_acc), gs)
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `sum(f(inputs) * r)` in f64 without autograd.
fn objective(f: &OpFn, inputs: &[Input], r_key: &str) -> f64 {
    let ts: Vec<Tensor> = inputs
        .iter()
        .map(|i| Tensor::from_vec(i.vals.clone(), i.shape.as_slice(), &Device::Cpu).unwrap())
        .collect();
    let out = f(&ts).unwrap();
    let r = values(r_key, out.elem_count(), 1.0, 0.0);
    flat(&out).iter().zip(&r).map(|(a, b)| a * b).sum()
}

fn check_finite_differences(f: &OpFn, inputs: &mut [Input]) {
    let (_, analytic) = run(f, inputs, DType::F64, "r");
    let h = 1e-6;
    let mut k = 0;
    for idx in 0..inputs.len() {
        if !inputs[idx].grad {
            continue;
        }
        let mut numeric = Vec::new();
        for e in 0..inputs[idx].vals.len() {
            let v0 = inputs[idx].vals[e];
            inputs[idx].vals[e] = v0 + h;
            let up = objective(f, inputs, "r");
            inputs[idx].vals[e] = v0 - h;
            let down = objective(f, inputs, "r");
            inputs[idx].vals[e] = v0;
            numeric.push((up - down) / (2.0 * h));
        }
        assert_close(&analytic[k], &numeric, 1e-7, 1e-6);
        k += 1;
    }
}

fn check_against_composite(fused: &OpFn, composite: &OpFn, inputs: &[Input], dtype: DType) {
    let (atol, rtol) = if dtype == DType::F64 {
        (1e-11, 1e-9)
    } else {
        (2e-5, 1e-4)
    };
    let (yf, gf) = run(fused, inputs, dtype, "r");
    let (yc, gc) = run(composite, inputs, dtype, "r");
    assert_close(&yf, &yc, atol, rtol);
    assert_eq!(gf.len(), gc.len());
    for (a, b) in gf.iter().zip(&gc) {
        assert_close(a, b, atol, rtol);
    }
}

fn check_half(fused: &OpFn, inputs: &[Input]) {
    let (y32, g32) = run(fused, inputs, DType::F32, "r");
    for (dtype, atol, rtol) in [(DType::F16, 1e-4, 2e-3), (DType::BF16, 1e-3, 1.6e-2)] {
        let (y, g) = run(fused, inputs, dtype, "r");
        assert_close(&y, &y32, atol, rtol);
        for (a, b) in g.iter().zip(&g32) {
            assert_close(a, b, atol, rtol);
        }
    }
}

fn check_all(fused: &OpFn, composite: &OpFn, mut inputs: Vec<Input>) {
    check_finite_differences(fused, &mut inputs);
    check_against_composite(fused, composite, &inputs, DType::F64);
    check_against_composite(fused, composite, &inputs, DType::F32);
    check_half(fused, &inputs);
}

fn ln_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::layer_norm(&x[0], &x[1], &x[2], 1e-5)?)
}
fn ln_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::layer_norm(&x[0], &x[1], &x[2], 1e-5)?)
}

#[test]
fn layer_norm_gradients() {
    check_all(
        &ln_fused,
        &ln_composite,
        vec![
            input("ln.x", &[2, 3, 6], 2.0, 0.5, true),
            input("ln.w", &[6], 0.5, 1.0, true),
            input("ln.b", &[6], 0.5, 0.0, true),
        ],
    );
}

#[test]
fn layer_norm_multithreaded_matches_composite() {
    // 600 rows of 256: several chunks on candle's worker pool
    let inputs = vec![
        input("ln.big.x", &[600, 256], 3.0, -1.0, true),
        input("ln.big.w", &[256], 0.5, 1.0, true),
        input("ln.big.b", &[256], 0.5, 0.0, true),
    ];
    check_against_composite(&ln_fused, &ln_composite, &inputs, DType::F32);
}

fn rms_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::rms_norm(&x[0], &x[1], 1e-5)?)
}
fn rms_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::rms_norm(&x[0], &x[1], 1e-5)?)
}

#[test]
fn rms_norm_gradients() {
    // rows of 6 (fewer than the 16 summing lanes) and of 37 (two full lane groups and a rest)
    for (key, d) in [("rms", 6usize), ("rms37", 37)] {
        check_all(
            &rms_fused,
            &rms_composite,
            vec![
                input(&format!("{key}.x"), &[2, 3, d], 2.0, 0.5, true),
                input(&format!("{key}.w"), &[d], 0.5, 1.0, true),
            ],
        );
    }
}

#[test]
fn rms_norm_multithreaded_matches_composite() {
    // 600 rows of 256: several chunks on candle's worker pool
    let inputs = vec![
        input("rms.big.x", &[600, 256], 3.0, -1.0, true),
        input("rms.big.w", &[256], 0.5, 1.0, true),
    ];
    check_against_composite(&rms_fused, &rms_composite, &inputs, DType::F32);
}

#[test]
fn rms_norm_bad_inputs_name_what_is_wrong() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let e = ops::rms_norm(&x, &Tensor::zeros(3, DType::F32, &dev).unwrap(), 1e-5).unwrap_err();
    assert!(
        e.to_string().contains("weight") && e.to_string().contains("[4]"),
        "{e}"
    );
    let e = ops::rms_norm(&x, &Tensor::zeros(4, DType::F16, &dev).unwrap(), 1e-5).unwrap_err();
    assert!(e.to_string().contains("weight"), "{e}");
    let w = Tensor::ones(4, DType::F32, &dev).unwrap();
    let e = ops::rms_norm(&x, &w, -1.0).unwrap_err();
    assert!(e.to_string().contains("eps"), "{e}");
}

fn swiglu_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::swiglu(&x[0])?)
}
fn swiglu_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::swiglu(&x[0])?)
}

#[test]
fn swiglu_gradients() {
    // gate values over [-5, 5]: the sigmoid's tails and its middle
    check_all(
        &swiglu_fused,
        &swiglu_composite,
        vec![input("swiglu.x", &[2, 3, 10], 5.0, 0.0, true)],
    );
}

#[test]
fn swiglu_multithreaded_matches_composite() {
    let inputs = vec![input("swiglu.big.x", &[300, 2 * 688], 4.0, 0.0, true)];
    check_against_composite(&swiglu_fused, &swiglu_composite, &inputs, DType::F32);
}

#[test]
fn swiglu_odd_width_is_an_error() {
    let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
    let e = ops::swiglu(&x).unwrap_err().to_string();
    assert!(e.contains("2n") && e.contains("[2, 5]"), "{e}");
}

/// Rotary on `[2, 5, 3 x 4 + 2]`: 2 heads of 4 rotated, the third head and 2 more columns
/// passing through (a fused projection's layout), at a small theta so the angles vary. The
/// table is rounded to bf16 first, so every dtype rotates by the same angles (the half-type
/// bound is about the rounding of the result, as for the inputs).
fn rotary_case(layout: ops::RotaryLayout) -> (Box<OpFn>, Box<OpFn>) {
    let table = move |dtype: DType| {
        ops::rotary_table(5, 4, 3.0, None, DType::BF16, &Device::Cpu)
            .and_then(|t| Ok(t.to_dtype(dtype)?))
            .unwrap()
    };
    let fused = move |x: &[Tensor]| -> anyhow::Result<Tensor> {
        Ok(ops::rotary(&x[0], &table(x[0].dtype()), 4, 2, layout)?)
    };
    let composite = move |x: &[Tensor]| -> anyhow::Result<Tensor> {
        Ok(reference::rotary(
            &x[0],
            &table(x[0].dtype()),
            4,
            2,
            layout,
        )?)
    };
    (Box::new(fused), Box::new(composite))
}

#[test]
fn rotary_gradients_in_both_layouts() {
    for layout in [ops::RotaryLayout::Half, ops::RotaryLayout::Interleaved] {
        let (fused, composite) = rotary_case(layout);
        check_all(
            &*fused,
            &*composite,
            vec![input("rot.x", &[2, 5, 14], 2.0, 0.0, true)],
        );
    }
}

#[test]
fn rotary_layouts_differ_and_keep_norms() {
    let dev = Device::Cpu;
    let table = ops::rotary_table(5, 4, 3.0, None, DType::F64, &dev).unwrap();
    let x = Tensor::from_vec(values("rot.l", 40, 1.0, 0.0), (1, 5, 8), &dev).unwrap();
    let half = ops::rotary(&x, &table, 4, 2, ops::RotaryLayout::Half).unwrap();
    let inter = ops::rotary(&x, &table, 4, 2, ops::RotaryLayout::Interleaved).unwrap();
    // a mix-up of the two layouts shows: the same input rotates differently
    let diff = (&half - &inter).unwrap().abs().unwrap().max_all().unwrap();
    assert!(diff.to_scalar::<f64>().unwrap() > 0.1);
    // a rotation keeps each pair's norm, so the row's norm
    let norms = |t: &Tensor| flat(&t.sqr().unwrap().sum(2).unwrap());
    assert_close(&norms(&half), &norms(&x), 1e-12, 1e-12);
}

#[test]
fn rotary_tables_match_the_formula_and_llama3_scaling() {
    let t = ops::rotary_table(3, 4, 10_000.0, None, DType::F64, &Device::Cpu).unwrap();
    let row2 = flat(&t.get(2).unwrap());
    let f1 = 1.0 / 10_000f64.powf(0.5);
    let want = [2f64.cos(), (2.0 * f1).cos(), 2f64.sin(), (2.0 * f1).sin()];
    assert_close(&row2, &want, 1e-15, 1e-15);
    // Llama 3.1's scaling: high frequencies kept, the lowest divided by the factor
    let s = ops::Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let (plain, scaled) = (
        ops::rotary_inv_freq(128, 500_000.0, None),
        ops::rotary_inv_freq(128, 500_000.0, Some(s)),
    );
    assert_eq!(plain[0], scaled[0]);
    assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18);
    // in between, interpolated: strictly between f / 8 and f
    let mid = (0..64)
        .find(|&i| {
            let w = 2.0 * std::f64::consts::PI / plain[i];
            w > 8192.0 / 4.0 && w < 8192.0
        })
        .unwrap();
    assert!(scaled[mid] < plain[mid] && scaled[mid] > plain[mid] / 8.0);
}

#[test]
fn rope_scaling_reads_llama3_and_names_what_it_cannot() {
    use serde_json::json;
    let read = ops::Llama3Scaling::from_hf;
    assert_eq!(read(&json!(null)).unwrap(), None);
    assert_eq!(read(&json!({"rope_type": "default"})).unwrap(), None);
    // Llama 3.1's config.json, and the older `type` key
    let want = ops::Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    for key in ["rope_type", "type"] {
        let v = json!({key: "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        assert_eq!(read(&v).unwrap(), Some(want));
    }
    for kind in ["linear", "dynamic", "yarn", "longrope"] {
        let e = read(&json!({"rope_type": kind, "factor": 2.0}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rope_scaling.rope_type") && e.contains(kind),
            "{e}"
        );
    }
    let e = read(&json!({"rope_type": "llama3", "factor": 8.0}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_scaling.low_freq_factor"), "{e}");
}

#[test]
fn rotary_bad_inputs_name_what_is_wrong() {
    let dev = Device::Cpu;
    let e = ops::rotary_table(4, 5, 1e4, None, DType::F32, &dev).unwrap_err();
    assert!(e.to_string().contains("head_dim"), "{e}");
    let table = ops::rotary_table(4, 4, 1e4, None, DType::F32, &dev).unwrap();
    let x = Tensor::zeros((1, 3, 8), DType::F32, &dev).unwrap();
    let e = ops::rotary(&x, &table, 4, 2, ops::RotaryLayout::Half).unwrap_err();
    assert!(e.to_string().contains("[1, 3, 8]"), "{e}");
    let x = Tensor::zeros((1, 4, 6), DType::F32, &dev).unwrap();
    let e = ops::rotary(&x, &table, 4, 2, ops::RotaryLayout::Half).unwrap_err();
    assert!(e.to_string().contains("2 heads of 4"), "{e}");
}

fn repeat_kv_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::repeat_kv(&x[0], 3)?)
}
fn repeat_kv_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::repeat_kv(&x[0], 3)?)
}

#[test]
fn repeat_kv_gradients() {
    // 2 key/value heads for 6 query heads: each gradient the sum of its group of 3
    check_all(
        &repeat_kv_fused,
        &repeat_kv_composite,
        vec![input("rkv.x", &[2, 2, 3, 4], 2.0, 0.0, true)],
    );
    let big = vec![input("rkv.big.x", &[4, 2, 128, 64], 2.0, 0.0, true)];
    check_against_composite(&repeat_kv_fused, &repeat_kv_composite, &big, DType::F32);
}

#[test]
fn grouped_query_attention_matches_the_expanded_reference() {
    // 4 query heads on 2 key/value heads through the fused attention op
    let gqa = |x: &[Tensor]| -> anyhow::Result<Tensor> {
        let (k, v) = (ops::repeat_kv(&x[1], 2)?, ops::repeat_kv(&x[2], 2)?);
        Ok(ops::causal_attention(&x[0], &k, &v, 0.5)?)
    };
    let reference = |x: &[Tensor]| -> anyhow::Result<Tensor> {
        let (k, v) = (
            reference::repeat_kv(&x[1], 2)?,
            reference::repeat_kv(&x[2], 2)?,
        );
        let s = (x[0].matmul(&k.t()?)? * 0.5)?;
        Ok(reference::causal_softmax_scaled(&s, 1.0)?.matmul(&v)?)
    };
    let mut inputs = vec![
        input("gqa.q", &[1, 4, 5, 4], 1.0, 0.0, true),
        input("gqa.k", &[1, 2, 5, 4], 1.0, 0.0, true),
        input("gqa.v", &[1, 2, 5, 4], 1.0, 0.0, true),
    ];
    check_finite_differences(&gqa, &mut inputs);
    check_against_composite(&gqa, &reference, &inputs, DType::F64);
    check_against_composite(&gqa, &reference, &inputs, DType::F32);
    // the attention op's own half-type bounds (tests/attention.rs): it rounds more than once
    let (y32, g32) = run(&gqa, &inputs, DType::F32, "r");
    for (dtype, atol, rtol) in [(DType::F16, 2e-4, 4e-3), (DType::BF16, 2e-3, 3e-2)] {
        let (y, g) = run(&gqa, &inputs, dtype, "r");
        assert_close(&y, &y32, atol, rtol);
        for (a, b) in g.iter().zip(&g32) {
            assert_close(a, b, atol, rtol);
        }
    }
}

fn sm_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::causal_softmax_scaled(&x[0], 0.7)?)
}
fn sm_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::causal_softmax_scaled(&x[0], 0.7)?)
}

#[test]
fn causal_softmax_gradients() {
    check_all(
        &sm_fused,
        &sm_composite,
        vec![input("sm.x", &[2, 2, 5, 5], 3.0, 0.0, true)],
    );
    // rectangular scores: 3 queries over 6 keys, the first query sees 4
    check_all(
        &sm_fused,
        &sm_composite,
        vec![input("sm.r", &[1, 3, 6], 3.0, 0.0, true)],
    );
}

#[test]
fn causal_softmax_masks_exactly() {
    let x = Tensor::from_vec(values("sm.m", 2 * 16, 5.0, 0.0), (2, 4, 4), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let y = ops::causal_softmax(xv.as_tensor()).unwrap();
    let r = Tensor::from_vec(values("sm.mr", 32, 1.0, 0.0), (2, 4, 4), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let g = (y.clone() * r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let y = y.to_vec3::<f32>().unwrap();
    let g = g.get(&xv).unwrap().to_vec3::<f32>().unwrap();
    for b in 0..2 {
        for i in 0..4 {
            let row_sum: f32 = y[b][i].iter().sum();
            assert!((row_sum - 1.0).abs() < 1e-6);
            for j in i + 1..4 {
                assert_eq!(y[b][i][j], 0.0, "y[{b}][{i}][{j}]");
                assert_eq!(g[b][i][j], 0.0, "grad[{b}][{i}][{j}]");
            }
        }
    }
    assert!(
        ops::causal_softmax(&Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap()).is_err()
    );
}

#[test]
fn causal_softmax_multithreaded_matches_composite() {
    let inputs = vec![input("sm.big", &[2, 4, 128, 128], 4.0, 0.0, true)];
    check_against_composite(&sm_fused, &sm_composite, &inputs, DType::F32);
}

fn gelu_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::gelu(&x[0])?)
}
fn gelu_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::gelu(&x[0])?)
}

#[test]
fn gelu_gradients() {
    check_all(
        &gelu_fused,
        &gelu_composite,
        vec![input("gelu.x", &[3, 7], 4.0, 0.0, true)],
    );
}

#[test]
fn gelu_multithreaded_matches_composite() {
    // 300,000 elements: many 4096-element rows plus a ragged tail
    let inputs = vec![input("gelu.big", &[300_003], 5.0, 0.0, true)];
    check_against_composite(&gelu_fused, &gelu_composite, &inputs, DType::F32);
}

fn bias_gelu_fused(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(ops::bias_gelu(&x[0], &x[1])?)
}
fn bias_gelu_composite(x: &[Tensor]) -> anyhow::Result<Tensor> {
    Ok(reference::bias_gelu(&x[0], &x[1])?)
}

#[test]
fn bias_gelu_gradients() {
    check_all(
        &bias_gelu_fused,
        &bias_gelu_composite,
        vec![
            input("bg.x", &[2, 3, 5], 3.0, 0.0, true),
            input("bg.b", &[5], 1.0, 0.0, true),
        ],
    );
}

#[test]
fn bias_gelu_multithreaded_matches_composite() {
    let inputs = vec![
        input("bg.big.x", &[700, 384], 4.0, 0.0, true),
        input("bg.big.b", &[384], 1.0, 0.0, true),
    ];
    check_against_composite(&bias_gelu_fused, &bias_gelu_composite, &inputs, DType::F32);
}

/// Targets for `n` rows over `v` classes, with the ignore index 99 at every third row.
fn targets(n: usize, v: usize) -> Tensor {
    let t: Vec<u32> = (0..n)
        .map(|i| {
            if i % 3 == 2 {
                99
            } else {
                ((i * 7 + 3) % v) as u32
            }
        })
        .collect();
    Tensor::new(t, &Device::Cpu).unwrap()
}

#[test]
fn cross_entropy_gradients() {
    let fused = |x: &[Tensor]| -> anyhow::Result<Tensor> {
        let n = x[0].dim(0)?;
        Ok(ops::cross_entropy(&x[0], &targets(n, 7), Some(99))?)
    };
    let composite = |x: &[Tensor]| -> anyhow::Result<Tensor> {
        let n = x[0].dim(0)?;
        Ok(reference::cross_entropy(&x[0], &targets(n, 7), Some(99))?)
    };
    check_all(
        &fused,
        &composite,
        vec![input("ce.x", &[5, 7], 4.0, 0.0, true)],
    );
}

#[test]
fn cross_entropy_multithreaded_matches_composite() {
    let fused = |x: &[Tensor]| -> anyhow::Result<Tensor> {
        Ok(ops::cross_entropy(&x[0], &targets(512, 2000), Some(99))?)
    };
    let composite = |x: &[Tensor]| -> anyhow::Result<Tensor> {
        Ok(reference::cross_entropy(
            &x[0],
            &targets(512, 2000),
            Some(99),
        )?)
    };
    let inputs = vec![input("ce.big", &[512, 2000], 6.0, 0.0, true)];
    check_against_composite(&fused, &composite, &inputs, DType::F32);
}

#[test]
fn cross_entropy_closed_form_and_errors() {
    let dev = Device::Cpu;
    // uniform logits: loss ln(v), gradient (1/v - onehot) / count
    let logits = Var::zeros((4, 5), DType::F32, &dev).unwrap();
    let t = Tensor::new(&[1u32, 0, 9, 4], &dev).unwrap();
    let loss = ops::cross_entropy(logits.as_tensor(), &t, Some(9)).unwrap();
    assert!((loss.to_scalar::<f32>().unwrap() - 5f32.ln()).abs() < 1e-6);
    let g = loss
        .backward()
        .unwrap()
        .get(&logits)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(g[2], vec![0.0; 5]);
    assert!((g[0][1] - (0.2 - 1.0) / 3.0).abs() < 1e-7 && (g[0][0] - 0.2 / 3.0).abs() < 1e-7);
    // all ignored: zero loss, zero gradient
    let all = Tensor::new(&[9u32, 9, 9, 9], &dev).unwrap();
    let loss = ops::cross_entropy(logits.as_tensor(), &all, Some(9)).unwrap();
    assert_eq!(loss.to_scalar::<f32>().unwrap(), 0.0);
    // out of range target names position and value
    let bad = Tensor::new(&[1u32, 5, 0, 0], &dev).unwrap();
    let err = ops::cross_entropy(logits.as_tensor(), &bad, None).unwrap_err();
    assert!(err.to_string().contains("target 5 at position 1"), "{err}");
    let wrong = Tensor::new(&[1u32, 2], &dev).unwrap();
    assert!(ops::cross_entropy(logits.as_tensor(), &wrong, None).is_err());
}

#[test]
fn layer_norm_rejects_mismatched_arguments() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let w3 = Tensor::ones(3, DType::F32, &dev).unwrap();
    let w4 = Tensor::ones(4, DType::F32, &dev).unwrap();
    let w4h = Tensor::ones(4, DType::F16, &dev).unwrap();
    let err = ops::layer_norm(&x, &w3, &w4, 1e-5).unwrap_err();
    assert_eq!(
        err.to_string(),
        "layer_norm: weight has shape [3], expected [4]"
    );
    assert!(ops::layer_norm(&x, &w4, &w4h, 1e-5).is_err());
}

/// The trap of DESIGN.md: candle's fused layer norm and softmax build no backward node, so a
/// model trained through them never updates its LayerNorm weights. If a candle release fixes
/// this, this test fails and the note in DESIGN.md can go.
#[test]
fn candle_fused_layer_norm_and_softmax_drop_gradients() {
    let dev = Device::Cpu;
    let x = Var::from_tensor(
        &Tensor::from_vec(values("trap.x", 12, 2.0, 0.0), (3, 4), &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap(),
    )
    .unwrap();
    let w = Var::ones(4, DType::F32, &dev).unwrap();
    let b = Var::zeros(4, DType::F32, &dev).unwrap();
    let r = Tensor::from_vec(values("trap.r", 12, 1.0, 0.0), (3, 4), &dev)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();

    let y = candle_nn::ops::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
    let grads = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(
        grads.get(&w).is_none(),
        "candle's layer_norm now has a weight gradient"
    );
    assert!(
        grads.get(&b).is_none(),
        "candle's layer_norm now has a bias gradient"
    );
    assert!(
        grads.get(&x).is_none(),
        "candle's layer_norm now has an input gradient"
    );

    let y = candle_nn::ops::softmax_last_dim(x.as_tensor()).unwrap();
    let grads = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(
        grads.get(&x).is_none(),
        "candle's softmax_last_dim now has a gradient"
    );

    // kiln's op on the same input delivers all three, and a non-trivial one for the weight
    let y = ops::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
    let grads = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let gw = grads.get(&w).unwrap().to_vec1::<f32>().unwrap();
    assert!(gw.iter().any(|v| v.abs() > 1e-3), "{gw:?}");
    assert!(grads.get(&b).is_some() && grads.get(&x).is_some());
}
