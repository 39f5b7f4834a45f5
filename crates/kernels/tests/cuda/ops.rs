//! The fused ops on CUDA against the same ops on the CPU: forward values and every input's
//! gradient, in f32, f16 and bf16.

use crate::common::{gpu, host, tol, values, worst};

use candle_core::{DType, Device, Tensor, Var};
use kiln_kernels::ops::{
    BiasGelu, CausalSoftmax, CrossEntropy, Gelu, LayerNorm, RepeatKv, RmsNorm, Rotary,
    RotaryLayout, SwiGlu,
};

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
            |v| v[0].apply_op3(&v[1], &v[2], LayerNorm::new(1e-5)).unwrap(),
        );
        // tq < tk: a query block at the end of a longer key sequence
        compare("causal_softmax", &dev, dtype, &[(&[2, 3, 5, 70], 4)], |v| {
            v[0].apply_op1(CausalSoftmax { scale: 0.125 }).unwrap()
        });
        compare("gelu", &dev, dtype, &[(&[7, 129], 5)], |v| {
            v[0].apply_op1(Gelu).unwrap()
        });
        compare(
            "bias_gelu",
            &dev,
            dtype,
            &[(&[9, 130], 6), (&[130], 7)],
            |v| v[0].apply_op2(&v[1], BiasGelu).unwrap(),
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
            let op = CrossEntropy {
                ignore_index: Some(7),
            };
            v[0].apply_op2(&targets, op).unwrap()
        });
    }
}

#[test]
fn llama_ops_on_cuda_equal_the_cpu() {
    let Some(dev) = gpu("llama_ops_on_cuda_equal_the_cpu") else {
        return;
    };
    for dtype in DTYPES {
        compare(
            "rms_norm",
            &dev,
            dtype,
            &[(&[6, 300], 11), (&[300], 12)],
            |v| v[0].apply_op2(&v[1], RmsNorm::new(1e-5)).unwrap(),
        );
        compare("swiglu", &dev, dtype, &[(&[7, 2 * 129], 13)], |v| {
            v[0].apply_op1(SwiGlu).unwrap()
        });
        // 3 heads of 8 rotated in rows of 30 (the rest passes through), 5 positions
        for layout in [RotaryLayout::Half, RotaryLayout::Interleaved] {
            compare("rotary", &dev, dtype, &[(&[2, 5, 30], 14)], |v| {
                let x = &v[0];
                let table = Tensor::from_vec(values(5 * 8, 15), (5, 8), x.device())
                    .unwrap()
                    .to_dtype(x.dtype())
                    .unwrap();
                x.apply_op2(&table, Rotary::new(8, 3, layout)).unwrap()
            });
        }
        compare("repeat_kv", &dev, dtype, &[(&[2, 3, 5, 8], 16)], |v| {
            v[0].apply_op1(RepeatKv::new(4)).unwrap()
        });
    }
}
