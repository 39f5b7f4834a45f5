//! The Llama layout (RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases, an
//! untied head) against an independent composite forward written here from candle's plain
//! ops in f64, and its gradients against candle's autograd of that composite.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, D};
use kiln_model::{Gpt, GptConfig, GptOptions};
use std::collections::HashMap;

/// The Llama forward from the named parameters, in plain candle ops: RMSNorm, Hugging Face's
/// `rotate_half` rotary embedding, `repeat_kv`, softmax attention with a causal mask, SwiGLU.
fn reference_logits(cfg: &GptConfig, p: &HashMap<String, Tensor>, tokens: &Tensor) -> Tensor {
    let (b, t) = tokens.dims2().unwrap();
    let (d, h, hkv) = (cfg.d_model, cfg.n_heads, cfg.kv_heads());
    let dh = d / h;
    let dev = tokens.device();
    let rms = |x: &Tensor, w: &Tensor| -> Tensor {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let r = (ms + cfg.layer_norm_eps).unwrap().sqrt().unwrap();
        x.broadcast_div(&r).unwrap().broadcast_mul(w).unwrap()
    };
    let lin = |x: &Tensor, w: &Tensor| x.broadcast_matmul(&w.t().unwrap()).unwrap();
    // cos and sin [t, dh / 2] of position p and frequency theta^(-2i / dh)
    let inv: Vec<f64> = (0..dh / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / dh as f64))
        .collect();
    let ang: Vec<f64> = (0..t)
        .flat_map(|p| inv.iter().map(move |f| p as f64 * f))
        .collect();
    let ang = Tensor::from_vec(ang, (t, dh / 2), dev).unwrap();
    let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
    let cos = Tensor::cat(&[&cos, &cos], 1).unwrap();
    let sin = Tensor::cat(&[&sin, &sin], 1).unwrap();
    let rope = |x: &Tensor| -> Tensor {
        // x [b, heads, t, dh]; rotate_half: [-x2, x1]
        let x1 = x.narrow(3, 0, dh / 2).unwrap();
        let x2 = x.narrow(3, dh / 2, dh / 2).unwrap();
        let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], 3).unwrap();
        (x.broadcast_mul(&cos).unwrap() + rot.broadcast_mul(&sin).unwrap()).unwrap()
    };
    let heads = |x: &Tensor, n: usize| {
        x.reshape((b, t, n, dh))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let mask: Vec<f64> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), dev).unwrap();
    let mut x = p["wte"]
        .index_select(&tokens.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((b, t, d))
        .unwrap();
    for i in 0..cfg.n_layers {
        let w = |n: &str| &p[&format!("h.{i}.{n}")];
        let a = rms(&x, w("ln_1.weight"));
        let (q, k, v) = if cfg.grouped_query() {
            (
                lin(&a, w("attn.q_proj.weight")),
                lin(&a, w("attn.k_proj.weight")),
                lin(&a, w("attn.v_proj.weight")),
            )
        } else {
            let qkv = lin(&a, w("attn.c_attn.weight"));
            (
                qkv.narrow(2, 0, d).unwrap(),
                qkv.narrow(2, d, d).unwrap(),
                qkv.narrow(2, 2 * d, d).unwrap(),
            )
        };
        let q = rope(&heads(&q, h));
        let k = rope(&heads(&k, hkv));
        let v = heads(&v, hkv);
        // repeat_kv: head j of the keys serves query heads j * g .. (j + 1) * g
        let g = h / hkv;
        let rep = |x: &Tensor| {
            let parts: Vec<Tensor> = (0..h).map(|qh| x.narrow(1, qh / g, 1).unwrap()).collect();
            Tensor::cat(&parts, 1).unwrap()
        };
        let (k, v) = (rep(&k), rep(&v));
        let s = (q.matmul(&k.t().unwrap()).unwrap() / (dh as f64).sqrt())
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        // softmax written out: candle_nn's fused one builds no backward node
        let e = s
            .broadcast_sub(&s.max_keepdim(D::Minus1).unwrap())
            .unwrap()
            .exp()
            .unwrap();
        let s = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
        let y = s
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, d))
            .unwrap();
        x = (x + lin(&y, w("attn.c_proj.weight"))).unwrap();
        let m = rms(&x, w("ln_2.weight"));
        let gu = lin(&m, w("mlp.c_fc.weight"));
        let f = cfg.d_ff();
        let gate = gu.narrow(2, 0, f).unwrap();
        let up = gu.narrow(2, f, f).unwrap();
        let silu = (&gate * candle_nn::ops::sigmoid(&gate).unwrap()).unwrap();
        x = (x + lin(&(silu * up).unwrap(), w("mlp.c_proj.weight"))).unwrap();
    }
    lin(&rms(&x, &p["ln_f.weight"]), &p["lm_head"])
}

/// The largest `|a - b|`, and the largest `|b|`.
fn max_diff(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let m = |t: Tensor| {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    (m((a - b).unwrap()), m(b.clone()))
}

fn f64_opts() -> GptOptions {
    let mut o = GptOptions::seeded(3);
    o.param_dtype = DType::F64;
    o.compute_dtype = DType::F64;
    o
}

fn check_against_reference(cfg: &GptConfig) {
    let model = Gpt::new(cfg, &f64_opts()).unwrap();
    let params: HashMap<String, Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    assert_eq!(model.num_parameters() as u64, cfg.param_count());
    let ids: Vec<u32> = (0..2 * 37)
        .map(|i| (i * 7919 % cfg.vocab_size) as u32)
        .collect();
    let tokens = Tensor::from_vec(ids, (2, 37), &Device::Cpu).unwrap();
    let got = model.forward(&tokens).unwrap();
    let want = reference_logits(cfg, &params, &tokens);
    let (diff, scale) = max_diff(&got, &want);
    assert!(
        diff <= 1e-12 * scale.max(1.0),
        "{diff} (logits up to {scale})"
    );

    // the gradient of every parameter, against candle's autograd of the composite
    let ids: Vec<u32> = (0..2 * 37)
        .map(|i| (i * 31 % cfg.vocab_size) as u32)
        .collect();
    let targets = Tensor::from_vec(ids, (2, 37), &Device::Cpu).unwrap();
    let loss = model.loss(&tokens, &targets).unwrap();
    let ref_loss = candle_nn::loss::cross_entropy(
        &want.reshape((2 * 37, cfg.vocab_size)).unwrap(),
        &targets.flatten_all().unwrap(),
    )
    .unwrap();
    let (l, rl) = (
        loss.to_scalar::<f64>().unwrap(),
        ref_loss.to_scalar::<f64>().unwrap(),
    );
    assert!((l - rl).abs() <= 1e-12 * rl, "loss {l} vs {rl}");
    let (g, rg) = (loss.backward().unwrap(), ref_loss.backward().unwrap());
    for (name, v) in model.named_parameters() {
        let a = g.get(v.as_tensor()).unwrap();
        let b = rg.get(v.as_tensor()).unwrap();
        let (diff, scale) = max_diff(a, b);
        assert!(
            diff <= 1e-10 * scale,
            "{name}: {diff} (gradient up to {scale})"
        );
    }
}

#[test]
fn llama_forward_matches_an_independent_composite() {
    check_against_reference(&GptConfig::llama_tiny());
    let mut mha = GptConfig::llama_tiny();
    mha.n_kv_heads = None;
    check_against_reference(&mha);
    let mut mqa = GptConfig::llama_tiny();
    mqa.n_kv_heads = Some(1);
    check_against_reference(&mqa);
}
