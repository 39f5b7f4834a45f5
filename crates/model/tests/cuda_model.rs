//! The GPT model on CUDA against the same model on the CPU: the loss and every parameter's
//! gradient, f32 and bf16 compute; and the input checks of the ops' front ends on CUDA. Needs
//! a build with the `cuda` feature and a GPU; anywhere else each test says why it did not run
//! and passes (CI has no GPU; `scripts/gpu_check.sh` runs these on one). The kernels
//! themselves are compared with the CPU in kiln-kernels' `cuda` test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor};
use kiln_model::{ops, DeviceSpec, Gpt, GptConfig, GptOptions};
use kiln_testkit::assert_close;

/// The GPU, or `None` after printing why there is none.
fn gpu(test: &str) -> Option<Device> {
    match DeviceSpec::Cuda(0).device() {
        Ok(d) => Some(d),
        Err(e) => {
            println!("{test}: skipped, no CUDA device: {e}");
            None
        }
    }
}

fn host(t: &Tensor) -> Vec<f32> {
    let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    t.to_vec1::<f32>().unwrap()
}

/// The tolerance of a dtype: f32 differs from the CPU only in summation order and exp.
fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 1e-2,
        _ => 5e-2,
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
        assert_eq!(g_gpu.len(), g_cpu.len());
        for ((n, a), (_, b)) in g_gpu.iter().zip(&g_cpu) {
            println!("{dtype:?}: the gradient of {n}");
            // |a - b| <= t (1e-3 + |b|): relative, with a floor at 1e-3
            let t = f64::from(10.0 * tol(dtype));
            assert_close(a, b, t * 1e-3, t);
        }
    }
}

/// On CUDA, head dims past the kernels' 256 are a typed error before any launch.
#[test]
fn head_dim_over_256_is_rejected_on_cuda() {
    let Some(dev) = gpu("head_dim_over_256_is_rejected_on_cuda") else {
        return;
    };
    let x = Tensor::zeros((1, 1, 4, 264), DType::F32, &dev).unwrap();
    let e = ops::causal_attention(&x, &x, &x, 1.0).unwrap_err();
    assert!(
        matches!(
            e,
            kiln_model::ModelError::Shape {
                op: "causal_attention",
                ..
            }
        ),
        "{e}"
    );
}
