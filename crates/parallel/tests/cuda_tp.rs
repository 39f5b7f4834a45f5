//! The tensor-parallel ops on CUDA tensors (staged through host memory until kiln-comm has a
//! device communicator) against the same computation on the CPU, on two thread ranks that
//! both hold their tensors on cuda:0:
//!
//! - the conjugate operators and the last-dim gather/scatter in f32, f64, f16 and bf16, on
//!   inputs that start at an offset in their buffer: bitwise equal (the values are multiples
//!   of 1/8, so every sum is exact, and the host logic is the CPU's);
//! - the vocab-parallel cross-entropy on given logits in every dtype: bitwise equal (the loss
//!   and its gradient are the CPU's host code on the same numbers);
//! - a column-parallel + row-parallel MLP and a tied vocab-parallel embedding, head and
//!   cross-entropy, forward and backward in f32: within 1e-5 + 1e-5 relative (cuBLAS and the
//!   CPU gemm sum products in different orders).
//!
//! Needs the `cuda` feature and a GPU; anywhere else each test says why it did not run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use kiln_comm::{Communicator, ReduceOp};
use kiln_parallel::tp::{
    all_reduce_tensor, copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
    scatter_to_tp_region, vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear,
    TpComm, VocabParallelEmbedding,
};
use kiln_testkit::{assert_close, run_ranks, worst_diff};
use std::sync::Arc;

const WORLD: usize = 2;
const ATOL: f64 = 1e-5;
const RTOL: f64 = 1e-5;
const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// cuda:0, or `None` after printing why `test` did not run.
fn cuda(test: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            println!("{test}: skipped, no CUDA device: {e}");
            None
        }
    }
}

/// Uniform values in [-scale, scale) from a counter-based hash of (seed, index), on the CPU.
fn uniform(dims: &[usize], seed: u64, scale: f32) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let h = kiln_state::splitmix64(i ^ (seed << 40));
            ((h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// A `[rows, cols]` tensor of multiples of 1/8 in [-5/8, 5/8], different for each `salt`.
fn eighths(rows: usize, cols: usize, salt: usize) -> Tensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| (((i / cols) * 7 + (i % cols) * 3 + salt * 5) % 11) as f32 / 8.0 - 5.0 / 8.0)
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

fn tp(comm: kiln_comm::ThreadComm) -> TpComm {
    Arc::new(comm)
}

/// The values of `t` as f64 on the host, and its device, dtype and shape.
#[derive(Debug, PartialEq)]
struct Host {
    cuda: bool,
    dtype: DType,
    dims: Vec<usize>,
    values: Vec<f64>,
}

fn host(t: &Tensor) -> Host {
    Host {
        cuda: t.device().is_cuda(),
        dtype: t.dtype(),
        dims: t.dims().to_vec(),
        values: t
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap(),
    }
}

fn grad(g: &candle_core::backprop::GradStore, v: &Var) -> Tensor {
    g.get(v).expect("a gradient").clone()
}

/// Every rank's results on cuda:0 and on the CPU: the same dtypes and shapes, and the values
/// bitwise equal when `exact`, otherwise within the tolerance.
fn compare(what: &str, on_cuda: &[Vec<Host>], on_cpu: &[Vec<Host>], exact: bool) {
    assert_eq!(on_cuda.len(), on_cpu.len(), "{what}: ranks");
    for (r, (gpu, cpu)) in on_cuda.iter().zip(on_cpu).enumerate() {
        assert_eq!(gpu.len(), cpu.len(), "{what}: results of rank {r}");
        for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
            assert!(g.cuda && !c.cuda, "{what} #{i}, rank {r}: devices");
            assert_eq!(
                (g.dtype, &g.dims),
                (c.dtype, &c.dims),
                "{what} #{i}, rank {r}"
            );
            if exact {
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&g.values),
                    bits(&c.values),
                    "{what} #{i}, rank {r}: cuda and cpu differ"
                );
            } else {
                if let Some(w) = worst_diff(&g.values, &c.values, ATOL, RTOL) {
                    println!("{what} #{i}, rank {r}: worst abs diff {:e}", w.abs);
                }
                assert_close(&g.values, &c.values, ATOL, RTOL);
            }
        }
    }
    println!("{what}: cuda equals the cpu on {WORLD} ranks");
}

/// f, g, gather, scatter and a max all-reduce, forward and backward, on `dev`: `x` `[4, 6]`
/// is the middle rows of a `[6, 6]` buffer (an input at an offset).
fn conjugate_ops(dev: &Device, dtype: DType) -> Vec<Vec<Host>> {
    run_ranks(WORLD, |comm| {
        let r = comm.rank();
        let comm = tp(comm);
        let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
        let whole = on(eighths(6, 6, r))?;
        let x = Var::from_tensor(&whole.narrow(0, 1, 4)?)?;
        let up = on(eighths(4, 6 * WORLD, 7 + r))?;
        let y_f = copy_to_tp_region(x.as_tensor(), &comm)?;
        let y_g = reduce_from_tp_region(x.as_tensor(), &comm)?;
        let y_gather = gather_from_tp_region(x.as_tensor(), &comm)?;
        let y_scatter = scatter_to_tp_region(x.as_tensor(), &comm)?;
        let max = all_reduce_tensor(x.as_tensor(), ReduceOp::Max, &comm)?;
        let loss = ((&y_f * &y_f)?.sum_all()?
            + (&y_g * &y_g)?.sum_all()?
            + (&y_gather * &up)?.sum_all()?
            + (&y_scatter * up.narrow(1, 0, 3)?)?.sum_all()?)?;
        let dx = grad(&loss.backward()?, &x);
        Ok([y_f, y_g, y_gather, y_scatter, max, dx]
            .iter()
            .map(host)
            .collect())
    })
}

#[test]
fn tp_ops_on_cuda_equal_the_cpu_bitwise_in_every_dtype() {
    let Some(dev) = cuda("tp_ops_on_cuda_equal_the_cpu_bitwise_in_every_dtype") else {
        return;
    };
    for dtype in DTYPES {
        let on_cuda = conjugate_ops(&dev, dtype);
        let on_cpu = conjugate_ops(&Device::Cpu, dtype);
        compare(
            &format!("f, g, gather, scatter {dtype:?}"),
            &on_cuda,
            &on_cpu,
            true,
        );
    }
}

/// Targets over a vocabulary of 16 touching both ranks' slices, two of them the ignore index 5.
const TARGETS: [u32; 7] = [0, 5, 15, 7, 5, 8, 3];

/// The vocab-parallel cross-entropy of given logits `[7, 16]` on `dev`: loss and gradient.
fn cross_entropy(dev: &Device, dtype: DType) -> Vec<Vec<Host>> {
    let v = 16 / WORLD;
    run_ranks(WORLD, |comm| {
        let r = comm.rank();
        let comm = tp(comm);
        let logits = uniform(&[TARGETS.len(), 16], 3, 4.0).narrow(1, r * v, v)?;
        let local = Var::from_tensor(&logits.to_dtype(dtype)?.to_device(dev)?)?;
        let targets = Tensor::new(&TARGETS, dev)?;
        let loss = vocab_parallel_cross_entropy(local.as_tensor(), &targets, Some(5), &comm)?;
        let dlogits = grad(&(&loss * 3.0)?.backward()?, &local);
        Ok(vec![host(&loss), host(&dlogits)])
    })
}

#[test]
fn vocab_cross_entropy_on_cuda_equals_the_cpu_bitwise_in_every_dtype() {
    let Some(dev) = cuda("vocab_cross_entropy_on_cuda_equals_the_cpu_bitwise_in_every_dtype")
    else {
        return;
    };
    for dtype in DTYPES {
        let on_cuda = cross_entropy(&dev, dtype);
        let on_cpu = cross_entropy(&Device::Cpu, dtype);
        compare(&format!("cross-entropy {dtype:?}"), &on_cuda, &on_cpu, true);
    }
}

/// `fc2(gelu(fc1(x)))` with fc1 column-parallel `6 -> 16` and fc2 row-parallel `16 -> 6`,
/// forward and backward on `dev` in f32: output, input gradient, every shard's gradient.
fn mlp(dev: &Device) -> Vec<Vec<Host>> {
    let (d, hidden) = (6, 16);
    let w1 = uniform(&[hidden, d], 10, 1.0 / (d as f32).sqrt());
    let b1 = uniform(&[hidden], 11, 0.5);
    let w2 = uniform(&[d, hidden], 12, 1.0 / (hidden as f32).sqrt());
    let b2 = uniform(&[d], 13, 0.5);
    let x = uniform(&[2, 3, d], 14, 1.0);
    let up = uniform(&[2, 3, d], 15, 1.0);
    run_ranks(WORLD, |comm| {
        let comm = tp(comm);
        let on = |t: &Tensor| t.to_device(dev);
        let fc1 = ColumnParallelLinear::from_full(&on(&w1)?, Some(&on(&b1)?), comm.clone())?;
        let fc2 = RowParallelLinear::from_full(&on(&w2)?, Some(&on(&b2)?), comm)?;
        let xv = Var::from_tensor(&on(&x)?)?;
        let y = fc2.forward(&fc1.forward(xv.as_tensor())?.gelu()?)?;
        let g = (&y * on(&up)?)?.sum_all()?.backward()?;
        let (b1, b2) = (fc1.bias().unwrap(), fc2.bias().unwrap());
        Ok([
            y.clone(),
            grad(&g, &xv),
            grad(&g, fc1.weight()),
            grad(&g, b1),
            grad(&g, fc2.weight()),
            grad(&g, b2),
        ]
        .iter()
        .map(host)
        .collect())
    })
}

#[test]
fn column_and_row_parallel_mlp_on_cuda_matches_the_cpu() {
    let Some(dev) = cuda("column_and_row_parallel_mlp_on_cuda_matches_the_cpu") else {
        return;
    };
    compare(
        "column + row parallel mlp f32",
        &mlp(&dev),
        &mlp(&Device::Cpu),
        false,
    );
}

/// Embedding lookup, tied head and cross-entropy of a vocab-parallel `wte` `[16, 8]` on `dev`
/// in f32: loss, the gradient of the hidden states and of this rank's rows of `wte`.
fn tied_model(dev: &Device) -> Vec<Vec<Host>> {
    let (vocab, d) = (16, 8);
    let wte = uniform(&[vocab, d], 20, 1.0);
    let ids = [3u32, 14, 7, 0, 9, 8, 15];
    let h = uniform(&[ids.len(), d], 21, 1.0);
    run_ranks(WORLD, |comm| {
        let comm = tp(comm);
        let emb = VocabParallelEmbedding::from_full(&wte.to_device(dev)?, comm.clone())?;
        let hv = Var::from_tensor(&h.to_device(dev)?)?;
        let x = (emb.forward(&Tensor::new(&ids, dev)?)? + hv.as_tensor())?;
        let logits = emb.logits(&x)?;
        let targets = Tensor::new(&TARGETS, dev)?;
        let loss = vocab_parallel_cross_entropy(&logits, &targets, Some(5), &comm)?;
        let g = loss.backward()?;
        Ok(vec![
            host(&loss),
            host(&logits),
            host(&grad(&g, &hv)),
            host(&grad(&g, emb.weight())),
        ])
    })
}

#[test]
fn tied_vocab_parallel_embedding_and_cross_entropy_on_cuda_match_the_cpu() {
    let Some(dev) = cuda("tied_vocab_parallel_embedding_and_cross_entropy_on_cuda_match_the_cpu")
    else {
        return;
    };
    let (on_cuda, on_cpu) = (tied_model(&dev), tied_model(&Device::Cpu));
    for (r, (g, c)) in on_cuda.iter().zip(&on_cpu).enumerate() {
        println!(
            "rank {r}: loss cuda {} cpu {}",
            g[0].values[0], c[0].values[0]
        );
    }
    compare(
        "tied vocab-parallel embedding, head and cross-entropy f32",
        &on_cuda,
        &on_cpu,
        false,
    );
}
