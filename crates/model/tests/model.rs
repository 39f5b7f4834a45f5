//! The decoder: gradients against finite differences, seeded determinism, parameter layout,
//! segments, the layer factory seam, reduced-precision compute, generation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use kiln_model::{
    generate, DenseLinear, Gpt, GptConfig, GptOptions, Initializer, LayerFactory, LinearKind,
    LinearLayer, LinearSpec, ModelError, ParallelStyle, Sampling, Segment,
};
use kiln_testkit::{assert_bitwise_eq, assert_close};
use std::sync::Mutex;

/// A micro model for finite differences: every dimension small, embeddings not tiny.
fn micro() -> GptConfig {
    let mut c = GptConfig::new(11, 8, 8, 2, 2);
    c.embedding_std = 0.5;
    c
}

fn batch(b: usize, t: usize, vocab: usize, salt: u32) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..b * (t + 1))
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(salt) >> 7) % vocab as u32)
        .collect();
    let rows: Vec<Vec<u32>> = ids.chunks(t + 1).map(|c| c.to_vec()).collect();
    let x: Vec<u32> = rows.iter().flat_map(|r| r[..t].to_vec()).collect();
    let y: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    let dev = Device::Cpu;
    (
        Tensor::from_vec(x, (b, t), &dev).unwrap(),
        Tensor::from_vec(y, (b, t), &dev).unwrap(),
    )
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn loss_gradients_match_finite_differences_in_f64() {
    let cfg = micro();
    let opts = GptOptions::seeded(9)
        .with_param_dtype(DType::F64)
        .with_compute_dtype(DType::F64);
    let model = Gpt::new(&cfg, &opts).unwrap();
    let (x, y) = batch(2, 5, cfg.vocab_size, 1);
    let grads = model.loss(&x, &y).unwrap().backward().unwrap();
    let params = model.named_parameters();
    let checked = [
        "wte",
        "wpe",
        "h.0.ln_1.weight",
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_proj.bias",
        "h.1.ln_2.bias",
        "h.1.mlp.c_fc.weight",
        "h.1.mlp.c_proj.weight",
        "ln_f.weight",
    ];
    let h = 1e-6;
    for name in checked {
        let var = &params.iter().find(|(n, _)| n == name).unwrap().1;
        let analytic = flat(
            grads
                .get(var)
                .unwrap_or_else(|| panic!("no gradient for {name}")),
        );
        let base = flat(var.as_tensor());
        // a spread of elements of each parameter
        let picks: Vec<usize> = (0..base.len()).step_by((base.len() / 7).max(1)).collect();
        let mut numeric = Vec::new();
        let mut expected = Vec::new();
        for &e in &picks {
            let mut v = base.clone();
            v[e] = base[e] + h;
            var.set(&Tensor::from_vec(v.clone(), var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            let up = scalar(&model.loss(&x, &y).unwrap());
            v[e] = base[e] - h;
            var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            let down = scalar(&model.loss(&x, &y).unwrap());
            numeric.push((up - down) / (2.0 * h));
            expected.push(analytic[e]);
        }
        var.set(&Tensor::from_vec(base, var.shape(), &Device::Cpu).unwrap())
            .unwrap();
        assert!(
            numeric.iter().any(|g| g.abs() > 1e-4),
            "{name}: gradient all ~0"
        );
        assert_close(&expected, &numeric, 1e-8, 1e-5);
    }
}

fn param_values(model: &Gpt) -> Vec<(String, Vec<f32>)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect()
}

#[test]
fn same_seed_same_bits_different_seed_different() {
    let cfg = GptConfig::tiny();
    let (x, y) = batch(2, 16, cfg.vocab_size, 5);
    let a = Gpt::new(&cfg, &GptOptions::seeded(5)).unwrap();
    let b = Gpt::new(&cfg, &GptOptions::seeded(5)).unwrap();
    let c = Gpt::new(&cfg, &GptOptions::seeded(6)).unwrap();
    let (pa, pb, pc) = (param_values(&a), param_values(&b), param_values(&c));
    for ((na, va), (nb, vb)) in pa.iter().zip(&pb) {
        assert_eq!(na, nb);
        assert_bitwise_eq(va, vb);
    }
    let la = a.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    let lb = b.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    let lc = c.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(la.to_bits(), lb.to_bits());
    assert_ne!(la.to_bits(), lc.to_bits());
    // every randomly initialised tensor differs across seeds
    for ((n, va), (_, vc)) in pa.iter().zip(&pc) {
        let random = n.ends_with("weight") && !n.contains("ln") || n == "wte" || n == "wpe";
        assert_eq!(va != vc, random, "{n}");
    }
    // streams are keyed by name: a deeper model shares the first blocks' unscaled weights
    let mut deeper = cfg.clone();
    deeper.n_layers = 3;
    let d = Gpt::new(&deeper, &GptOptions::seeded(5)).unwrap();
    let pd = param_values(&d);
    let get = |p: &[(String, Vec<f32>)], n: &str| p.iter().find(|(m, _)| m == n).unwrap().1.clone();
    assert_bitwise_eq(
        &get(&pa, "h.1.attn.c_attn.weight"),
        &get(&pd, "h.1.attn.c_attn.weight"),
    );
    assert_bitwise_eq(&get(&pa, "wte"), &get(&pd, "wte"));
}

#[test]
fn parameters_named_ordered_counted_and_initialised() {
    let cfg = GptConfig::tiny();
    let model = Gpt::new(&cfg, &GptOptions::seeded(1)).unwrap();
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let block0 = [
        "h.0.ln_1.weight",
        "h.0.ln_1.bias",
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_attn.bias",
        "h.0.attn.c_proj.weight",
        "h.0.attn.c_proj.bias",
        "h.0.ln_2.weight",
        "h.0.ln_2.bias",
        "h.0.mlp.c_fc.weight",
        "h.0.mlp.c_fc.bias",
        "h.0.mlp.c_proj.weight",
        "h.0.mlp.c_proj.bias",
    ];
    assert_eq!(names[..2], ["wte", "wpe"]);
    assert_eq!(names[2..14], block0);
    assert_eq!(names[names.len() - 2..], ["ln_f.weight", "ln_f.bias"]);
    assert_eq!(names.len(), 2 + 12 * cfg.n_layers + 2);
    assert_eq!(
        model.parameter("h.1.mlp.c_fc.weight").unwrap().dims(),
        &[512, 128]
    );
    assert!(model.parameter("h.2.mlp.c_fc.weight").is_none());
    assert_eq!(model.num_parameters() as u64, cfg.param_count());
    assert_eq!(model.num_parameters(), 470_528);
    let micro_model = Gpt::new(&micro(), &GptOptions::seeded(1)).unwrap();
    assert_eq!(micro_model.num_parameters() as u64, micro().param_count());

    let p = param_values(&model);
    let get = |n: &str| p.iter().find(|(m, _)| m == n).unwrap().1.clone();
    let d = cfg.d_model as f64;
    // Xavier bound for c_attn [3d, d]: sqrt(6 / 4d); c_proj [d, d] scaled by 1/sqrt(2 L)
    let max_abs = |v: &[f32]| v.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    let qkv_bound = (6.0 / (4.0 * d)).sqrt();
    let m = max_abs(&get("h.0.attn.c_attn.weight"));
    assert!(m <= qkv_bound && m > 0.99 * qkv_bound, "{m} vs {qkv_bound}");
    let proj_bound = (6.0 / (2.0 * d)).sqrt() / (2.0 * cfg.n_layers as f64).sqrt();
    let m = max_abs(&get("h.1.attn.c_proj.weight"));
    assert!(
        m <= proj_bound && m > 0.99 * proj_bound,
        "{m} vs {proj_bound}"
    );
    assert!(get("h.0.mlp.c_fc.bias").iter().all(|&v| v == 0.0));
    assert!(get("h.1.ln_2.weight").iter().all(|&v| v == 1.0));
    let wte = get("wte");
    let std = (wte.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / wte.len() as f64).sqrt();
    assert!((std / 0.02 - 1.0).abs() < 0.02, "{std}");
}

#[test]
fn segments_compose_to_the_whole_model() {
    let cfg = GptConfig::tiny();
    let model = Gpt::new(&cfg, &GptOptions::seeded(2)).unwrap();
    let (x, y) = batch(2, 24, cfg.vocab_size, 3);
    let whole = model.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    let mut h = model.embed(&x).unwrap();
    for seg in model.segments() {
        if let Segment::Block(i) = seg {
            h = model.block(i, &h).unwrap();
        }
    }
    let pieces = model.head_loss(&h, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(whole.to_bits(), pieces.to_bits());
    let logits = model.forward(&x).unwrap();
    assert_eq!(logits.dims(), &[2, 24, cfg.vocab_size]);
    assert_eq!(
        model.segments(),
        vec![
            Segment::Embed,
            Segment::Block(0),
            Segment::Block(1),
            Segment::Head
        ]
    );

    // segment ownership partitions the parameters; the head reads the tied wte
    let mut names = Vec::new();
    for seg in model.segments() {
        names.extend(model.segment_parameters(seg).into_iter().map(|(n, _)| n));
    }
    let all: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, all);
    let head_names: Vec<String> = model
        .segment_parameters(Segment::Head)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(head_names, ["ln_f.weight", "ln_f.bias"]);
    let tied = model.tied_parameters(Segment::Head);
    assert_eq!(tied.len(), 1);
    assert_eq!(tied[0].0, "wte");
    assert!(model.tied_parameters(Segment::Block(0)).is_empty());

    // a segmented backward with detached boundaries gives the whole-model gradients, with
    // wte's two contributions (embedding and head) summed
    let grads_whole = model.loss(&x, &y).unwrap().backward().unwrap();
    let e_out = model.embed(&x).unwrap();
    let mut inputs = vec![Var::from_tensor(&e_out).unwrap()];
    for i in 0..model.n_blocks() {
        let out = model.block(i, inputs[i].as_tensor()).unwrap();
        inputs.push(Var::from_tensor(&out).unwrap());
    }
    let top = inputs.last().unwrap();
    let g_head = model
        .head_loss(top.as_tensor(), &y)
        .unwrap()
        .backward()
        .unwrap();
    let mut g_out = g_head.get(top).unwrap().clone();
    let mut seg_grads: Vec<(String, Tensor)> = model
        .segment_parameters(Segment::Head)
        .into_iter()
        .chain(model.tied_parameters(Segment::Head))
        .map(|(n, v)| (n, g_head.get(&v).unwrap().clone()))
        .collect();
    for i in (0..model.n_blocks()).rev() {
        let out = model.block(i, inputs[i].as_tensor()).unwrap();
        let g = (out * &g_out)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (n, v) in model.segment_parameters(Segment::Block(i)) {
            seg_grads.push((n, g.get(&v).unwrap().clone()));
        }
        g_out = g.get(&inputs[i]).unwrap().clone();
    }
    let emb = model.embed(&x).unwrap();
    let g = (emb * &g_out)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (n, v) in model.segment_parameters(Segment::Embed) {
        seg_grads.push((n, g.get(&v).unwrap().clone()));
    }
    for (n, v) in model.named_parameters() {
        let parts: Vec<&Tensor> = seg_grads
            .iter()
            .filter(|(m, _)| *m == n)
            .map(|(_, t)| t)
            .collect();
        let mut sum = parts[0].clone();
        for p in &parts[1..] {
            sum = (sum + *p).unwrap();
        }
        assert_eq!(parts.len(), if n == "wte" { 2 } else { 1 }, "{n}");
        assert_close(&flat(&sum), &flat(grads_whole.get(&v).unwrap()), 1e-6, 1e-4);
    }
}

/// A factory that records what it was asked for and builds dense layers.
#[derive(Default)]
struct Recording {
    specs: Mutex<Vec<LinearSpec>>,
}

impl LayerFactory for Recording {
    fn linear(
        &self,
        init: &Initializer,
        spec: &LinearSpec,
    ) -> kiln_model::Result<Box<dyn LinearLayer>> {
        self.specs.lock().unwrap().push(spec.clone());
        Ok(Box::new(DenseLinear::new(init, spec)?))
    }
}

#[test]
fn layers_come_from_the_factory() {
    let cfg = GptConfig::tiny();
    let rec = Recording::default();
    let model = Gpt::with_factory(&cfg, &GptOptions::seeded(4), &rec).unwrap();
    let dense = Gpt::new(&cfg, &GptOptions::seeded(4)).unwrap();
    let specs = rec.specs.lock().unwrap().clone();
    assert_eq!(specs.len(), 4 * cfg.n_layers);
    let d = cfg.d_model;
    let want = [
        (
            "h.0.attn.c_attn",
            d,
            3 * d,
            LinearKind::AttnQkv,
            ParallelStyle::Column,
        ),
        (
            "h.0.attn.c_proj",
            d,
            d,
            LinearKind::AttnOut,
            ParallelStyle::Row,
        ),
        (
            "h.0.mlp.c_fc",
            d,
            4 * d,
            LinearKind::MlpUp,
            ParallelStyle::Column,
        ),
        (
            "h.0.mlp.c_proj",
            4 * d,
            d,
            LinearKind::MlpDown,
            ParallelStyle::Row,
        ),
    ];
    for (s, (name, i, o, kind, style)) in specs.iter().zip(want) {
        assert_eq!(
            (s.name.as_str(), s.in_features, s.out_features, s.kind),
            (name, i, o, kind)
        );
        assert_eq!(s.kind.parallel_style(), style);
        assert!(s.bias);
    }
    let (x, y) = batch(1, 8, cfg.vocab_size, 7);
    let a = model.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    let b = dense.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(a.to_bits(), b.to_bits());
}

#[test]
fn half_precision_compute_trains_the_f32_master_weights() {
    let cfg = GptConfig::tiny();
    let (x, y) = batch(2, 32, cfg.vocab_size, 9);
    let base = Gpt::new(&cfg, &GptOptions::seeded(8)).unwrap();
    let l32 = base.loss(&x, &y).unwrap();
    let g32 = l32.backward().unwrap();
    let l32 = scalar(&l32);
    // loss and gradient agreement: f16 keeps ~3 decimal digits, bf16 ~2
    for (dtype, loss_rtol, grad_tol) in [(DType::F16, 2e-3, 0.02), (DType::BF16, 1e-2, 0.1)] {
        let model = Gpt::new(&cfg, &GptOptions::seeded(8).with_compute_dtype(dtype)).unwrap();
        // half types on the CPU keep f32 activations and multiply in the half type
        assert_eq!(model.activation_dtype(), DType::F32);
        assert_eq!(model.forward(&x).unwrap().dtype(), DType::F32);
        let loss = model.loss(&x, &y).unwrap();
        assert_eq!(loss.dtype(), DType::F32);
        assert!(
            (scalar(&loss) / l32 - 1.0).abs() < loss_rtol,
            "{dtype:?}: {} vs {l32}",
            scalar(&loss)
        );
        let g = loss.backward().unwrap();
        for ((n, v), (_, v32)) in model.named_parameters().iter().zip(base.named_parameters()) {
            let gv = g
                .get(v)
                .unwrap_or_else(|| panic!("{dtype:?}: no gradient for {n}"));
            assert_eq!(gv.dtype(), DType::F32, "{n}");
            let (a, e) = (flat(gv), flat(g32.get(&v32).unwrap()));
            // relative to the tensor's gradient scale
            let scale = e.iter().fold(0f64, |m, x| m.max(x.abs()));
            let worst = a
                .iter()
                .zip(&e)
                .fold(0f64, |m, (a, e)| m.max((a - e).abs()));
            assert!(
                worst <= grad_tol * scale,
                "{dtype:?} {n}: {worst} vs scale {scale}"
            );
        }
    }
}

/// bf16 (f16) compute on the CPU is the f32 model with every linear product at bf16 (f16)
/// operands: bitwise the f32 model run under `MatmulPrecision::Bf16` (`F16`), and not the f32
/// model itself.
#[test]
fn cpu_half_compute_is_f32_with_half_products() {
    use kiln_parallel::tp::{with_matmul_precision, MatmulPrecision};
    let cfg = GptConfig::tiny();
    let (x, y) = batch(2, 32, cfg.vocab_size, 10);
    let f32_model = Gpt::new(&cfg, &GptOptions::seeded(9)).unwrap();
    let exact = scalar(&f32_model.loss(&x, &y).unwrap());
    for (dtype, precision) in [
        (DType::BF16, MatmulPrecision::Bf16),
        (DType::F16, MatmulPrecision::F16),
    ] {
        let half_model = Gpt::new(&cfg, &GptOptions::seeded(9).with_compute_dtype(dtype)).unwrap();
        assert_eq!(half_model.activation_dtype(), DType::F32);
        let half = half_model.loss(&x, &y).unwrap();
        let g_half = half.backward().unwrap();
        let emulated = with_matmul_precision(precision, || f32_model.loss(&x, &y)).unwrap();
        let g_emulated = emulated.backward().unwrap();
        assert_eq!(
            scalar(&half).to_bits(),
            scalar(&emulated).to_bits(),
            "{dtype:?}"
        );
        assert_ne!(scalar(&half).to_bits(), exact.to_bits(), "{dtype:?}");
        for ((n, v), (_, ve)) in half_model
            .named_parameters()
            .iter()
            .zip(f32_model.named_parameters())
        {
            assert_eq!(
                flat(g_half.get(v).unwrap()),
                flat(g_emulated.get(&ve).unwrap()),
                "{dtype:?} {n}"
            );
        }
    }
}

#[test]
fn generation_is_seeded_and_crops_the_context() {
    let mut cfg = GptConfig::tiny();
    cfg.n_ctx = 16;
    let model = Gpt::new(&cfg, &GptOptions::seeded(12)).unwrap();
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 % 512) as u32).collect();
    let greedy = generate(&model, &prompt, 6, Sampling::Greedy, 0).unwrap();
    assert_eq!(greedy.len(), 26);
    assert_eq!(greedy[..20], prompt[..]);
    // greedy ignores the seed and equals the argmax of the cropped context's last logits
    assert_eq!(
        greedy,
        generate(&model, &prompt, 6, Sampling::Greedy, 99).unwrap()
    );
    let ctx = Tensor::new(&prompt[4..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let last = model
        .forward(&ctx)
        .unwrap()
        .get(0)
        .unwrap()
        .get(15)
        .unwrap();
    assert_eq!(
        last.argmax(0).unwrap().to_scalar::<u32>().unwrap(),
        greedy[20]
    );

    let s = Sampling::TopK {
        k: 50,
        temperature: 2.0,
    };
    let a = generate(&model, &prompt, 12, s, 1).unwrap();
    assert_eq!(a, generate(&model, &prompt, 12, s, 1).unwrap());
    assert_ne!(a, generate(&model, &prompt, 12, s, 2).unwrap());
    let k1 = Sampling::TopK {
        k: 1,
        temperature: 1.0,
    };
    assert_eq!(generate(&model, &prompt, 6, k1, 3).unwrap(), greedy);
    assert!(matches!(
        generate(&model, &[], 1, Sampling::Greedy, 0),
        Err(ModelError::EmptyPrompt)
    ));
    let bad = Sampling::TopK {
        k: 0,
        temperature: 1.0,
    };
    assert!(generate(&model, &prompt, 1, bad, 0).is_err());
}

#[test]
fn bad_inputs_are_typed_errors() {
    let cfg = GptConfig::tiny();
    let model = Gpt::new(&cfg, &GptOptions::seeded(0)).unwrap();
    let dev = Device::Cpu;
    let long = Tensor::zeros((1, 65), DType::U32, &dev).unwrap();
    assert!(matches!(
        model.embed(&long),
        Err(ModelError::SequenceTooLong {
            got: 65,
            max: 64,
            ..
        })
    ));
    let oov = Tensor::new(&[[1u32, 512]], &dev).unwrap();
    let err = model.embed(&oov).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::TokenOutOfRange {
                index: 1,
                value: 512,
                ..
            }
        ),
        "{err}"
    );
    let floats = Tensor::zeros((1, 4), DType::F32, &dev).unwrap();
    assert!(matches!(
        model.embed(&floats),
        Err(ModelError::Dtype { .. })
    ));
    let h = model
        .embed(&Tensor::zeros((1, 4), DType::U32, &dev).unwrap())
        .unwrap();
    assert!(matches!(
        model.block(2, &h),
        Err(ModelError::BlockOutOfRange {
            index: 2,
            n_blocks: 2
        })
    ));
    let wrong = Tensor::zeros((1, 3), DType::U32, &dev).unwrap();
    assert!(matches!(
        model.head_loss(&h, &wrong),
        Err(ModelError::Shape { .. })
    ));
    let mut bad = cfg.clone();
    bad.n_heads = 5;
    assert!(matches!(
        Gpt::new(&bad, &GptOptions::seeded(0)),
        Err(ModelError::HeadsDoNotDivide {
            n_heads: 5,
            d_model: 128
        })
    ));
    assert!(Gpt::new(&cfg, &GptOptions::seeded(0).with_compute_dtype(DType::U8)).is_err());
}
