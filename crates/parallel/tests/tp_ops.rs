//! The conjugate operators f and g and the last-dim gather/scatter, forward and backward, on
//! 1, 2 and 4 thread ranks, in f32, f64, f16 and bf16 on non-contiguous inputs. The values are
//! multiples of 1/8 small enough that every sum is exact in every dtype, so the expected
//! tensors (computed directly from the definitions) are compared bitwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use kiln_comm::Communicator;
use kiln_parallel::tp::{
    all_reduce_tensor, copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
    scatter_to_tp_region, TpComm,
};
use kiln_parallel::ParallelError;
use kiln_testkit::{run_ranks, try_run_ranks};
use std::sync::Arc;
use std::time::Duration;

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// A `[rows, cols]` tensor of multiples of 1/8 in [-5/8, 5/8], different for each `salt`.
fn eighths(rows: usize, cols: usize, salt: usize, dtype: DType) -> Tensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| (((i / cols) * 7 + (i % cols) * 3 + salt * 5) % 11) as f32 / 8.0 - 5.0 / 8.0)
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn grad_of(loss: &Tensor, v: &Var) -> Tensor {
    loss.backward().unwrap().get(v).expect("a gradient").clone()
}

fn tp(comm: kiln_comm::ThreadComm) -> TpComm {
    Arc::new(comm)
}

#[test]
fn f_is_the_identity_forward_and_sums_gradients_backward() {
    for world in [1, 2, 4] {
        for dtype in DTYPES {
            let out = run_ranks(world, |comm| {
                let r = comm.rank();
                let comm = tp(comm);
                let x = Var::from_tensor(&eighths(3, 4, 0, dtype))?;
                // a transposed (non-contiguous) view enters the op
                let y = copy_to_tp_region(&x.t()?, &comm)?;
                assert_eq!(y.dtype(), dtype);
                let loss = (&y * eighths(4, 3, r + 1, dtype))?.sum_all()?;
                Ok((values(&y), values(&grad_of(&loss, &x))))
            });
            let x_t = values(&eighths(3, 4, 0, dtype).t().unwrap());
            let want_grad: Vec<f64> = (0..world)
                .map(|r| values(&eighths(4, 3, r + 1, DType::F32).t().unwrap()))
                .fold(vec![0.0; 12], |acc, g| {
                    acc.iter().zip(&g).map(|(a, b)| a + b).collect()
                });
            for (y, dx) in out {
                assert_eq!(y, x_t, "f forward, {dtype:?} world {world}");
                assert_eq!(dx, want_grad, "f backward, {dtype:?} world {world}");
            }
        }
    }
}

#[test]
fn g_sums_forward_and_passes_the_gradient_backward() {
    for world in [1, 2, 4] {
        for dtype in DTYPES {
            let out = run_ranks(world, |comm| {
                let r = comm.rank();
                let comm = tp(comm);
                let x = Var::from_tensor(&eighths(3, 4, r, dtype))?;
                let y = reduce_from_tp_region(&x.t()?, &comm)?;
                let up = eighths(4, 3, 9, dtype);
                let loss = (&y * &up)?.sum_all()?;
                Ok((values(&y), values(&grad_of(&loss, &x))))
            });
            let want_y: Vec<f64> = (0..world)
                .map(|r| values(&eighths(3, 4, r, DType::F32).t().unwrap()))
                .fold(vec![0.0; 12], |acc, g| {
                    acc.iter().zip(&g).map(|(a, b)| a + b).collect()
                });
            let want_grad = values(&eighths(4, 3, 9, dtype).t().unwrap());
            for (y, dx) in out {
                assert_eq!(y, want_y, "g forward, {dtype:?} world {world}");
                assert_eq!(dx, want_grad, "g backward, {dtype:?} world {world}");
            }
        }
    }
}

/// Columns `k * n .. (k + 1) * n` of a row-major `[rows, n * parts]` matrix.
fn block(m: &[f64], rows: usize, n: usize, parts: usize, k: usize) -> Vec<f64> {
    (0..rows)
        .flat_map(|i| m[i * n * parts + k * n..i * n * parts + (k + 1) * n].to_vec())
        .collect()
}

#[test]
fn gather_concatenates_the_last_dim_and_scatter_splits_it() {
    let (rows, n) = (6, 3);
    for world in [1, 2, 4] {
        for dtype in DTYPES {
            let out = run_ranks(world, |comm| {
                let r = comm.rank();
                let comm = tp(comm);
                // gather: x_r [2, 3, n] -> [2, 3, n * world]; replicated upstream gradient
                let x = Var::from_tensor(&eighths(rows, n, r, dtype).reshape((2, 3, n))?)?;
                let y = gather_from_tp_region(x.as_tensor(), &comm)?;
                let up = eighths(rows, n * world, 7, dtype).reshape((2, 3, n * world))?;
                let dx = grad_of(&(&y * &up)?.sum_all()?, &x);
                // scatter: replicated z [2, 3, n * world] -> this rank's columns; each rank's
                // upstream gradient differs
                let z = Var::from_tensor(&eighths(rows, n * world, 5, dtype).reshape((
                    2,
                    3,
                    n * world,
                ))?)?;
                let s = scatter_to_tp_region(z.as_tensor(), &comm)?;
                let up_s = eighths(rows, n, 20 + r, dtype).reshape((2, 3, n))?;
                let dz = grad_of(&(&s * &up_s)?.sum_all()?, &z);
                Ok((values(&y), values(&dx), values(&s), values(&dz)))
            });
            let up = values(&eighths(rows, n * world, 7, dtype));
            let z = values(&eighths(rows, n * world, 5, dtype));
            for (r, (y, dx, s, dz)) in out.iter().enumerate() {
                for k in 0..world {
                    assert_eq!(
                        block(y, rows, n, world, k),
                        values(&eighths(rows, n, k, dtype))
                    );
                    assert_eq!(
                        block(dz, rows, n, world, k),
                        values(&eighths(rows, n, 20 + k, dtype))
                    );
                }
                assert_eq!(
                    dx,
                    &block(&up, rows, n, world, r),
                    "gather backward {dtype:?}"
                );
                assert_eq!(
                    s,
                    &block(&z, rows, n, world, r),
                    "scatter forward {dtype:?}"
                );
            }
        }
    }
}

#[test]
fn all_reduce_tensor_reduces_without_a_gradient_link() {
    let out = run_ranks(3, |comm| {
        let r = comm.rank() as f32;
        let comm = tp(comm);
        let x = Var::new(&[r, -r, 2.0 * r], &Device::Cpu)?;
        let max = all_reduce_tensor(x.as_tensor(), kiln_comm::ReduceOp::Max, &comm)?;
        let sum = all_reduce_tensor(x.as_tensor(), kiln_comm::ReduceOp::Sum, &comm)?;
        // no backward path from the result to x
        let grads = (&max + &sum)?.sum_all()?.backward()?;
        Ok((
            max.to_vec1::<f32>()?,
            sum.to_vec1::<f32>()?,
            grads.get(&x).is_none(),
        ))
    });
    for (max, sum, detached) in out {
        assert_eq!(max, [2.0, 0.0, 4.0]);
        assert_eq!(sum, [3.0, -3.0, 6.0]);
        assert!(detached);
    }
}

#[test]
fn scatter_rejects_a_last_dim_the_group_does_not_divide() {
    let out = run_ranks(2, |comm| {
        let comm = tp(comm);
        let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu)?;
        Ok(scatter_to_tp_region(&x, &comm).unwrap_err().to_string())
    });
    assert!(
        out[0].contains("[2, 5]") && out[0].contains("multiple of 2"),
        "{}",
        out[0]
    );
}

fn short() -> Duration {
    Duration::from_secs(10)
}

#[test]
fn a_rank_that_left_fails_the_forward_collective_cleanly() {
    let out = try_run_ranks(2, short(), |comm| {
        if comm.rank() == 1 {
            return Ok(None);
        }
        let comm = tp(comm);
        let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        let err = reduce_from_tp_region(&x, &comm).unwrap_err();
        assert!(matches!(err, ParallelError::Candle(_)), "{err:?}");
        Ok(Some(err.to_string()))
    })
    .unwrap();
    let msg = out[0].as_ref().unwrap();
    assert!(msg.contains("kiln-tp-reduce-from-region"), "{msg}");
    assert!(msg.contains("rank 1 has exited"), "{msg}");
}

#[test]
fn a_rank_that_left_fails_the_backward_collective_cleanly() {
    let out = try_run_ranks(2, short(), |comm| {
        let r = comm.rank();
        let comm = tp(comm);
        let x = Var::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
        let y = copy_to_tp_region(x.as_tensor(), &comm)?;
        if r == 1 {
            return Ok(None);
        }
        let err = y.sum_all()?.backward().unwrap_err();
        Ok(Some(err.to_string()))
    })
    .unwrap();
    let msg = out[0].as_ref().unwrap();
    assert!(msg.contains("kiln-tp-copy-to-region-bwd"), "{msg}");
    assert!(msg.contains("rank 1 has exited"), "{msg}");
}

#[test]
fn ranks_that_disagree_on_the_shape_get_a_mismatch_not_a_hang() {
    let out = try_run_ranks(2, short(), |comm| {
        let len = 3 + comm.rank();
        let comm = tp(comm);
        let x = Tensor::ones(len, DType::F32, &Device::Cpu)?;
        Ok(reduce_from_tp_region(&x, &comm).unwrap_err().to_string())
    })
    .unwrap();
    for msg in out {
        assert!(msg.contains("collective mismatch"), "{msg}");
    }
}

#[test]
fn integer_tensors_are_refused_with_the_op_name() {
    let out = run_ranks(2, |comm| {
        let comm = tp(comm);
        let x = Tensor::new(&[1u32, 2], &Device::Cpu)?;
        Ok(copy_to_tp_region(&x, &comm).unwrap_err().to_string())
    });
    assert!(out[0].contains("kiln-tp-copy-to-region"), "{}", out[0]);
}
