//! [`CausalAttention`] on CUDA against the same op on the CPU: the output and the
//! gradients of q, k and v in f32, f16 and bf16, at t = 1, 100 (partial tiles) and 2048 (many
//! tiles), b = 1, h = 2, head_dim 64; plus head dims 16 and 80 (a padded instantiation) in f32.

use crate::common::{gpu, host, tol, values, worst};

use candle_core::{DType, Device, Tensor, Var};
use kiln_kernels::ops::CausalAttention;

/// The output and the gradients of q, k, v of `sum(attention * w)` on `dev`, as f32.
fn run(dev: &Device, dtype: DType, shape: [usize; 4]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let n: usize = shape.iter().product();
    let scale = 1.0 / (shape[3] as f64).sqrt();
    let vars: Vec<Var> = (0..3)
        .map(|salt| {
            // q and k scaled down so that the softmax is neither one-hot nor flat
            let s = if salt < 2 { 0.5 } else { 1.0 };
            let v: Vec<f32> = values(n, salt).iter().map(|x| x * s).collect();
            let t = Tensor::from_vec(v, shape.as_slice(), dev).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        })
        .collect();
    let y = vars[0]
        .apply_op3(&vars[1], &vars[2], CausalAttention::new(scale))
        .unwrap();
    let w = Tensor::from_vec(values(n, 9), shape.as_slice(), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let grads = (y.clone() * w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g = vars
        .iter()
        .map(|v| host(grads.get(v.as_tensor()).unwrap()))
        .collect();
    (host(&y), g)
}

fn compare(dev: &Device, dtype: DType, shape: [usize; 4]) {
    let (y_cpu, g_cpu) = run(&Device::Cpu, dtype, shape);
    let (y_gpu, g_gpu) = run(dev, dtype, shape);
    let t = tol(dtype);
    let wy = worst(&y_gpu, &y_cpu, 1e-3);
    println!("{shape:?} {dtype:?}: output worst relative difference {wy:e}");
    assert!(wy < t, "{shape:?} {dtype:?}: output differs by {wy}");
    for (name, (a, b)) in ["q", "k", "v"].iter().zip(g_gpu.iter().zip(&g_cpu)) {
        let w = worst(a, b, 1e-3);
        println!("{shape:?} {dtype:?}: gradient of {name} worst relative difference {w:e}");
        assert!(
            w < t,
            "{shape:?} {dtype:?}: gradient of {name} differs by {w}"
        );
    }
}

#[test]
fn causal_attention_on_cuda_equals_the_cpu() {
    let Some(dev) = gpu("causal_attention_on_cuda_equals_the_cpu") else {
        return;
    };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for t in [1, 100, 2048] {
            compare(&dev, dtype, [1, 2, t, 64]);
        }
    }
    for dh in [16, 80] {
        compare(&dev, DType::F32, [2, 3, 77, dh]);
    }
}

/// A long sequence runs (no `t x t` buffer, a grid of many query tiles) and gives finite
/// values.
#[test]
fn causal_attention_forward_at_2048_runs_on_cuda() {
    let Some(dev) = gpu("causal_attention_forward_at_2048_runs_on_cuda") else {
        return;
    };
    let shape = [1, 2, 2048, 64];
    let n: usize = shape.iter().product();
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::from_vec(values(n, 5), shape.as_slice(), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let y = x.apply_op3(&x, &x, CausalAttention::new(0.125));
        let y = y.unwrap_or_else(|e| panic!("{dtype:?}: the CUDA forward failed: {e}"));
        assert_eq!(y.dims(), shape.as_slice());
        assert!(host(&y).iter().all(|v| v.is_finite()), "{dtype:?}");
    }
}

/// Past the kernels' 256, the op itself refuses a head dimension, naming it, before any launch.
#[test]
fn head_dim_over_256_is_an_error_of_the_kernel() {
    let Some(dev) = gpu("head_dim_over_256_is_an_error_of_the_kernel") else {
        return;
    };
    let x = Tensor::zeros((1, 1, 4, 264), DType::F32, &dev).unwrap();
    let e = x.apply_op3(&x, &x, CausalAttention::new(1.0)).unwrap_err();
    assert!(e.to_string().contains("head_dim 264"), "{e}");
}
