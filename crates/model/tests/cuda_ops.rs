//! The fused ops and the GPT step on CUDA against the same computation on the CPU: forward
//! values and every input's gradient, in f32, f16 and bf16. Needs a build with the `cuda`
//! feature and a GPU; anywhere else each test says why it did not run and passes (CI has no
//! GPU; `scripts/gpu_check.sh` runs these on one).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{gpu, host, values, worst};

use candle_core::{DType, Device, Tensor, Var};
use kiln_model::{ops, Gpt, GptConfig, GptOptions};

/// The tolerance of a dtype: f32 differs from the CPU only in summation order and exp.
fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        _ => 5e-2,
    }
}

/// Runs `f` on the CPU and on the GPU with variables made from `inputs` (shape, salt) in
/// `dtype`; compares the output and the gradient of every input.
fn compare(
    name: &str,
    gpu: &Device,
    dtype: DType,
    inputs: &[(&[usize], u64)],
    f: impl Fn(&[Var]) -> Tensor,
) {
    let run = |dev: &Device| {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|(shape, salt)| {
                let n = shape.iter().product();
                let t = Tensor::from_vec(values(n, *salt), *shape, dev).unwrap();
                Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
            })
            .collect();
        let y = f(&vars);
        // a weighted sum, so every output element has its own gradient
        let w = Tensor::from_vec(values(y.elem_count(), 99), y.shape(), dev)
            .unwrap()
            .to_dtype(y.dtype())
            .unwrap();
        let loss = (y.clone() * w).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<Vec<f32>> = vars
            .iter()
            .map(|v| host(grads.get(v.as_tensor()).unwrap()))
            .collect();
        (host(&y), g)
    };
    let (y_cpu, g_cpu) = run(&Device::Cpu);
    let (y_gpu, g_gpu) = run(gpu);
    let t = tol(dtype);
    let wy = worst(&y_gpu, &y_cpu, 1e-3);
    println!("{name} {dtype:?}: output worst relative difference {wy:e}");
    assert!(wy < t, "{name} {dtype:?}: output differs by {wy}");
    for (k, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        let w = worst(a, b, 1e-3);
        println!("{name} {dtype:?}: gradient of input {k} worst relative difference {w:e}");
        assert!(w < t, "{name} {dtype:?}: gradient {k} differs by {w}");
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn fused_ops_on_cuda_equal_the_cpu() {
    let Some(dev) = gpu("fused_ops_on_cuda_equal_the_cpu") else {
        return;
    };
    for dtype in DTYPES {
        compare(
            "layer_norm",
            &dev,
            dtype,
            &[(&[6, 300], 1), (&[300], 2), (&[300], 3)],
            |v| ops::layer_norm(&v[0], &v[1], &v[2], 1e-5).unwrap(),
        );
        // tq < tk: a query block at the end of a longer key sequence
        compare("causal_softmax", &dev, dtype, &[(&[2, 3, 5, 70], 4)], |v| {
            ops::causal_softmax_scaled(&v[0], 0.125).unwrap()
        });
        compare("gelu", &dev, dtype, &[(&[7, 129], 5)], |v| {
            ops::gelu(&v[0]).unwrap()
        });
        compare(
            "bias_gelu",
            &dev,
            dtype,
            &[(&[9, 130], 6), (&[130], 7)],
            |v| ops::bias_gelu(&v[0], &v[1]).unwrap(),
        );
    }
    // cross-entropy: one target ignored, a vocabulary wider than a block
    for dtype in DTYPES {
        let (n, vocab) = (11, 1500);
        let t: Vec<u32> = (0..n as u32).map(|i| (i * 389) % vocab as u32).collect();
        let mut with_ignored = t.clone();
        with_ignored[3] = 7;
        compare("cross_entropy", &dev, dtype, &[(&[n, vocab], 8)], |v| {
            let targets = Tensor::new(with_ignored.as_slice(), v[0].device()).unwrap();
            ops::cross_entropy(&v[0], &targets, Some(7)).unwrap()
        });
    }
}

/// The whole model: the loss and every parameter's gradient of `tiny` GPT on CUDA against the
/// CPU, f32 and bf16 compute.
#[test]
fn gpt_forward_and_backward_on_cuda_equal_the_cpu() {
    let Some(dev) = gpu("gpt_forward_and_backward_on_cuda_equal_the_cpu") else {
        return;
    };
    let cfg = GptConfig::tiny();
    for dtype in [DType::F32, DType::BF16] {
        let run = |device: &Device| {
            let opts = GptOptions::seeded(3)
                .with_compute_dtype(dtype)
                .with_device(device.clone());
            let m = Gpt::new(&cfg, &opts).unwrap();
            let ids: Vec<u32> = (0..4 * 32).map(|i| (i * 37 % 512) as u32).collect();
            let x = Tensor::from_vec(ids.clone(), (4, 32), device).unwrap();
            let y = Tensor::from_vec(
                ids.iter().map(|i| (i + 1) % 512).collect::<Vec<u32>>(),
                (4, 32),
                device,
            )
            .unwrap();
            let loss = m.loss(&x, &y).unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<(String, Vec<f32>)> = m
                .named_parameters()
                .into_iter()
                .map(|(n, v)| (n, host(grads.get(v.as_tensor()).unwrap())))
                .collect();
            (
                loss.to_dtype(DType::F32)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap(),
                g,
            )
        };
        let (l_cpu, g_cpu) = run(&Device::Cpu);
        let (l_gpu, g_gpu) = run(&dev);
        println!("tiny GPT {dtype:?}: loss cpu {l_cpu} cuda {l_gpu}");
        assert!(
            (l_cpu - l_gpu).abs() < tol(dtype) * l_cpu.abs(),
            "{l_cpu} vs {l_gpu}"
        );
        for ((n, a), (_, b)) in g_gpu.iter().zip(&g_cpu) {
            let w = worst(a, b, 1e-3);
            assert!(
                w < 10.0 * tol(dtype),
                "{dtype:?} gradient of {n} differs by {w}"
            );
        }
    }
}
