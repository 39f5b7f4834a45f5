//! Column- and row-parallel layers, a two-layer MLP and a causal attention block at tp = 1, 2
//! and 4 against the dense computation (whole weights, plain candle ops and autograd): the
//! outputs, the gradient of the input and the gradients of every shard against the matching
//! slice of the dense gradient.
//!
//! Tolerance for f32: |tp - dense| <= 1e-5 + 1e-5 |dense| element-wise (row-parallel sums and
//! the f all-reduce add partial products in another order than one dense matmul). At tp = 1 the
//! ops are the identity and everything is bitwise equal to the dense computation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var, D};
use kiln_comm::Communicator;
use kiln_memory::ModelShape;
use kiln_parallel::tp::{
    shard_column, shard_qkv, shard_row, ColumnParallelLinear, RowParallelLinear, TpComm, TpSplit,
};
use kiln_parallel::ParallelDims;
use kiln_testkit::{assert_bitwise_eq, assert_close, run_ranks, worst_diff};
use std::sync::Arc;

const ATOL: f64 = 1e-5;
const RTOL: f64 = 1e-5;

/// Uniform values in [-scale, scale) from a counter-based hash of (seed, index).
fn uniform(dims: &[usize], seed: u64, scale: f32) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let mut z = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9))
                .wrapping_add(0x94D0_49BB_1331_11EB);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// A weight `[out, in]` scaled by `1/sqrt(in)` and a bias `[out]`.
fn layer(out: usize, inp: usize, seed: u64) -> (Tensor, Tensor) {
    (
        uniform(&[out, inp], seed, 1.0 / (inp as f32).sqrt()),
        uniform(&[out], seed + 1000, 0.5),
    )
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// `actual` equals `expected` within the tolerance (bitwise when `world` is 1).
fn check(actual: &Tensor, expected: &Tensor, world: usize, what: &str) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes differ");
    if world == 1 {
        assert_bitwise_eq(&f32s(actual), &f32s(expected));
    } else {
        let (a, e) = (f32s(actual), f32s(expected));
        let a64: Vec<f64> = a.iter().map(|&v| v.into()).collect();
        let e64: Vec<f64> = e.iter().map(|&v| v.into()).collect();
        if let Some(w) = worst_diff(&a64, &e64, ATOL, RTOL) {
            println!("{what}, tp {world}: worst abs diff {:e}", w.abs);
        }
        assert_close(&a, &e, ATOL, RTOL);
    }
}

/// Dense `x W^T + b`: the one-rank linear op, bias added inside the product (what a
/// column-parallel layer computes on its rows, and a row-parallel one with one rank; with more
/// it adds the bias after the all-reduce, within the tolerance); the op itself is checked against candle's
/// composite matmul + broadcast add in its unit tests.
fn dense(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    kiln_parallel::tp::linear(x, w, Some(b)).unwrap()
}

fn grad(g: &candle_core::backprop::GradStore, v: &Var) -> Tensor {
    g.get(v).expect("a gradient").clone()
}

fn tp(comm: kiln_comm::ThreadComm) -> TpComm {
    Arc::new(comm)
}

/// Columns `rank * n / tp ..` of the last dimension.
fn last_slice(t: &Tensor, tp: usize, rank: usize) -> Tensor {
    let n = t.dim(D::Minus1).unwrap() / tp;
    t.narrow(t.rank() - 1, rank * n, n).unwrap()
}

#[test]
fn column_parallel_linear_matches_dense() {
    let (inp, out) = (6, 8);
    let (w, b) = layer(out, inp, 1);
    let x = uniform(&[2, 3, inp], 2, 1.0);
    let up = uniform(&[2, 3, out], 3, 1.0);
    // dense reference
    let xv = Var::from_tensor(&x).unwrap();
    let (wv, bv) = (Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap());
    let y = dense(xv.as_tensor(), wv.as_tensor(), bv.as_tensor());
    let g = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let (dx, dw, db) = (grad(&g, &xv), grad(&g, &wv), grad(&g, &bv));
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| {
            let r = comm.rank();
            let layer = ColumnParallelLinear::from_full(&w, Some(&b), tp(comm))?;
            assert_eq!(
                (
                    layer.in_features(),
                    layer.local_out_features(),
                    layer.out_features()
                ),
                (inp, out / world, out)
            );
            let xv = Var::from_tensor(&x)?;
            let y = layer.forward(xv.as_tensor())?;
            let g = (&y * last_slice(&up, world, r))?.sum_all()?.backward()?;
            let bias = layer.bias().unwrap();
            Ok((y, grad(&g, &xv), grad(&g, layer.weight()), grad(&g, bias)))
        });
        for (r, (y_r, dx_r, dw_r, db_r)) in outs.iter().enumerate() {
            let (dw_want, db_want) = shard_column(&dw, Some(&db), world, r).unwrap();
            check(y_r, &last_slice(&y, world, r), world, "column output");
            check(dx_r, &dx, world, "column input gradient");
            check(dw_r, &dw_want, world, "column weight gradient");
            check(db_r, &db_want.unwrap(), world, "column bias gradient");
        }
    }
}

#[test]
fn row_parallel_linear_matches_dense() {
    let (inp, out) = (8, 5);
    let (w, b) = layer(out, inp, 11);
    let x = uniform(&[2, 3, inp], 12, 1.0);
    let up = uniform(&[2, 3, out], 13, 1.0);
    let xv = Var::from_tensor(&x).unwrap();
    let (wv, bv) = (Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap());
    let y = dense(xv.as_tensor(), wv.as_tensor(), bv.as_tensor());
    let g = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let (dx, dw, db) = (grad(&g, &xv), grad(&g, &wv), grad(&g, &bv));
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| {
            let r = comm.rank();
            let layer = RowParallelLinear::from_full(&w, Some(&b), tp(comm))?;
            assert_eq!(
                (
                    layer.local_in_features(),
                    layer.in_features(),
                    layer.out_features()
                ),
                (inp / world, inp, out)
            );
            let xv = Var::from_tensor(&last_slice(&x, world, r))?;
            let y = layer.forward(xv.as_tensor())?;
            let g = (&y * &up)?.sum_all()?.backward()?;
            let bias = layer.bias().unwrap();
            Ok((y, grad(&g, &xv), grad(&g, layer.weight()), grad(&g, bias)))
        });
        for (r, (y_r, dx_r, dw_r, db_r)) in outs.iter().enumerate() {
            let (dw_want, _) = shard_row(&dw, None, world, r).unwrap();
            check(y_r, &y, world, "row output");
            check(
                dx_r,
                &last_slice(&dx, world, r),
                world,
                "row input gradient",
            );
            check(dw_r, &dw_want, world, "row weight gradient");
            check(db_r, &db, world, "row bias gradient");
        }
    }
}

/// The MLP `fc2(gelu(fc1(x)))` of width `d -> 4d -> d`, dense.
struct Mlp {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

impl Mlp {
    fn new(d: usize, seed: u64) -> Self {
        let (w1, b1) = layer(4 * d, d, seed);
        let (w2, b2) = layer(d, 4 * d, seed + 1);
        Self { w1, b1, w2, b2 }
    }
}

/// Output, input gradient and the gradients of (w1, b1, w2, b2).
type MlpResult = (Tensor, Tensor, [Tensor; 4]);

fn dense_mlp(m: &Mlp, x: &Tensor, up: &Tensor) -> MlpResult {
    let xv = Var::from_tensor(x).unwrap();
    let vars: Vec<Var> = [&m.w1, &m.b1, &m.w2, &m.b2]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let h = dense(xv.as_tensor(), vars[0].as_tensor(), vars[1].as_tensor())
        .gelu()
        .unwrap();
    let y = dense(&h, vars[2].as_tensor(), vars[3].as_tensor());
    let g = (&y * up).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = [0, 1, 2, 3].map(|i| grad(&g, &vars[i]));
    (y, grad(&g, &xv), grads)
}

fn tp_mlp(m: &Mlp, x: &Tensor, up: &Tensor, comm: TpComm) -> anyhow::Result<MlpResult> {
    let fc1 = ColumnParallelLinear::from_full(&m.w1, Some(&m.b1), comm.clone())?;
    let fc2 = RowParallelLinear::from_full(&m.w2, Some(&m.b2), comm)?;
    let xv = Var::from_tensor(x)?;
    let y = fc2.forward(&fc1.forward(xv.as_tensor())?.gelu()?)?;
    let g = (&y * up)?.sum_all()?.backward()?;
    let grads = [
        grad(&g, fc1.weight()),
        grad(&g, fc1.bias().unwrap()),
        grad(&g, fc2.weight()),
        grad(&g, fc2.bias().unwrap()),
    ];
    Ok((y, grad(&g, &xv), grads))
}

fn check_mlp(got: &MlpResult, want: &MlpResult, world: usize, rank: usize) {
    let (y, dx, [dw1, db1, dw2, db2]) = want;
    check(&got.0, y, world, "mlp output");
    check(&got.1, dx, world, "mlp input gradient");
    let (dw1, db1) = shard_column(dw1, Some(db1), world, rank).unwrap();
    let (dw2, _) = shard_row(dw2, None, world, rank).unwrap();
    let [g1, gb1, g2, gb2] = &got.2;
    check(g1, &dw1, world, "fc1 weight gradient");
    check(gb1, &db1.unwrap(), world, "fc1 bias gradient");
    check(g2, &dw2, world, "fc2 weight gradient");
    check(gb2, db2, world, "fc2 bias gradient");
}

#[test]
fn column_then_row_mlp_matches_dense() {
    let d = 8;
    let m = Mlp::new(d, 21);
    let x = uniform(&[2, 5, d], 22, 1.0);
    let up = uniform(&[2, 5, d], 23, 1.0);
    let want = dense_mlp(&m, &x, &up);
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| tp_mlp(&m, &x, &up, tp(comm)));
        for (r, got) in outs.iter().enumerate() {
            check_mlp(got, &want, world, r);
        }
    }
}

#[test]
fn mlp_on_the_tp_groups_of_a_dp_by_tp_grid_matches_dense() {
    // world 4 = dp 2 x tp 2: each data-parallel replica runs its own batch through its own
    // tensor-parallel pair; the collectives must stay inside the pair
    let d = 8;
    let m = Mlp::new(d, 31);
    let shape = ModelShape::gpt(1, d as u64, 2, 8, 16);
    let data = |dp: usize| {
        (
            uniform(&[2, 3, d], 40 + dp as u64, 1.0),
            uniform(&[2, 3, d], 50 + dp as u64, 1.0),
        )
    };
    let outs = run_ranks(4, |comm| {
        let dims = ParallelDims::new(2, 2, 4, &shape)?;
        let groups = dims.build_groups(&comm)?;
        let dp = dims.dp_rank(comm.rank());
        let (x, up) = data(dp);
        Ok((
            dp,
            groups.tp.rank(),
            tp_mlp(&m, &x, &up, Arc::from(groups.tp))?,
        ))
    });
    for (dp, tp_rank, got) in &outs {
        let (x, up) = data(*dp);
        check_mlp(got, &dense_mlp(&m, &x, &up), 2, *tp_rank);
    }
}

#[test]
fn half_precision_mlp_matches_the_dense_half_computation() {
    // weights stay f32 and are cast to the input's dtype; the dense reference computes in the
    // same dtype, so the difference is rounding of partial sums: 2e-2 absolute on O(1) values
    let d = 8;
    let m = Mlp::new(d, 61);
    for dtype in [DType::F16, DType::BF16] {
        let x = uniform(&[2, 3, d], 62, 1.0).to_dtype(dtype).unwrap();
        let up = uniform(&[2, 3, d], 63, 1.0).to_dtype(dtype).unwrap();
        let half = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let mh = Mlp {
            w1: half(&m.w1),
            b1: half(&m.b1),
            w2: half(&m.w2),
            b2: half(&m.b2),
        };
        let (y, dx, _) = dense_mlp(&mh, &x, &up);
        let outs = run_ranks(2, |comm| tp_mlp(&m, &x, &up, tp(comm)));
        for (y_r, dx_r, grads) in &outs {
            assert_eq!(y_r.dtype(), dtype);
            assert_eq!(
                grads[0].dtype(),
                DType::F32,
                "master weights keep their dtype"
            );
            assert_close(&f32s(y_r), &f32s(&y), 2e-2, 2e-2);
            assert_close(&f32s(dx_r), &f32s(&dx), 2e-2, 2e-2);
        }
    }
}

/// Causal multi-head attention on a fused `[q | k | v]` projection of `heads` heads of width
/// `dh`, with plain candle ops (softmax written out, so autograd covers it).
fn attend(qkv: &Tensor, heads: usize, dh: usize) -> Tensor {
    let (b, t, _) = qkv.dims3().unwrap();
    let qkv = qkv
        .reshape((b, t, 3, heads, dh))
        .unwrap()
        .permute((2, 0, 3, 1, 4))
        .unwrap()
        .contiguous()
        .unwrap();
    let (q, k, v) = (
        qkv.get(0).unwrap(),
        qkv.get(1).unwrap(),
        qkv.get(2).unwrap(),
    );
    let scores = (q.matmul(&k.t().unwrap()).unwrap() * (1.0 / (dh as f64).sqrt())).unwrap();
    let mask: Vec<f32> = (0..t * t)
        .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
    let scores = scores.broadcast_add(&mask).unwrap();
    let max = scores.max_keepdim(D::Minus1).unwrap().detach();
    let e = scores.broadcast_sub(&max).unwrap().exp().unwrap();
    let att = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    att.matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((b, t, heads * dh))
        .unwrap()
}

#[test]
fn attention_block_with_head_sharded_qkv_matches_dense() {
    let (n_heads, dh) = (4, 3);
    let d = n_heads * dh;
    let (wq, bq) = layer(3 * d, d, 71);
    let (wo, bo) = layer(d, d, 72);
    let x = uniform(&[2, 5, d], 73, 1.0);
    let up = uniform(&[2, 5, d], 74, 1.0);
    // dense
    let xv = Var::from_tensor(&x).unwrap();
    let vars: Vec<Var> = [&wq, &bq, &wo, &bo]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let qkv = dense(xv.as_tensor(), vars[0].as_tensor(), vars[1].as_tensor());
    let y = dense(
        &attend(&qkv, n_heads, dh),
        vars[2].as_tensor(),
        vars[3].as_tensor(),
    );
    let g = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = grad(&g, &xv);
    let [dwq, dbq, dwo, dbo] = [0, 1, 2, 3].map(|i| grad(&g, &vars[i]));
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| {
            let comm = tp(comm);
            let c_attn =
                ColumnParallelLinear::from_full_qkv(&wq, Some(&bq), n_heads, comm.clone())?;
            let c_proj = RowParallelLinear::from_full(&wo, Some(&bo), comm)?;
            let heads = c_attn.local_out_features() / (3 * dh);
            assert_eq!(heads, n_heads / world);
            let xv = Var::from_tensor(&x)?;
            let local = attend(&c_attn.forward(xv.as_tensor())?, heads, dh);
            let y = c_proj.forward(&local)?;
            let g = (&y * &up)?.sum_all()?.backward()?;
            Ok((
                y,
                grad(&g, &xv),
                [
                    grad(&g, c_attn.weight()),
                    grad(&g, c_attn.bias().unwrap()),
                    grad(&g, c_proj.weight()),
                    grad(&g, c_proj.bias().unwrap()),
                ],
            ))
        });
        for (r, (y_r, dx_r, [gq, gbq, go, gbo])) in outs.iter().enumerate() {
            let (dwq_r, dbq_r) = shard_qkv(&dwq, Some(&dbq), n_heads, world, r).unwrap();
            let (dwo_r, _) = shard_row(&dwo, None, world, r).unwrap();
            check(y_r, &y, world, "attention output");
            check(dx_r, &dx, world, "attention input gradient");
            check(gq, &dwq_r, world, "qkv weight gradient");
            check(gbq, &dbq_r.unwrap(), world, "qkv bias gradient");
            check(go, &dwo_r, world, "out projection weight gradient");
            check(gbo, &dbo, world, "out projection bias gradient");
        }
    }
}

#[test]
fn qkv_shards_hold_whole_heads_of_q_k_and_v() {
    // weight rows numbered 0..3d: rank r must hold q rows, k rows and v rows of its heads
    let (n_heads, dh, tp) = (4, 2, 2);
    let d = n_heads * dh;
    let rows = Tensor::arange(0f32, (3 * d) as f32, &Device::Cpu)
        .unwrap()
        .reshape((3 * d, 1))
        .unwrap()
        .broadcast_as((3 * d, 3))
        .unwrap()
        .contiguous()
        .unwrap();
    let (w1, _) = shard_qkv(&rows, None, n_heads, tp, 1).unwrap();
    let got: Vec<f32> = f32s(&w1.narrow(1, 0, 1).unwrap());
    // heads 2 and 3 of q (rows 4..8), of k (12..16) and of v (20..24)
    let want: Vec<f32> = [4..8, 12..16, 20..24]
        .into_iter()
        .flatten()
        .map(|i| i as f32)
        .collect();
    assert_eq!(got, want);
}

#[test]
fn every_split_round_trips_bitwise() {
    let full2 = uniform(&[24, 12], 81, 1.0);
    let full1 = uniform(&[24], 82, 1.0);
    for split in [
        TpSplit::Replicated,
        TpSplit::Rows,
        TpSplit::Cols,
        TpSplit::Qkv,
    ] {
        for full in [&full2, &full1] {
            for tp in [1, 2, 4] {
                let shards: Vec<Tensor> =
                    (0..tp).map(|r| split.shard(full, tp, r).unwrap()).collect();
                let local = split.local_dims(full.dims(), tp).unwrap();
                for s in &shards {
                    assert_eq!(s.dims(), local.as_slice(), "{split:?} tp {tp}");
                    assert!(s.is_contiguous());
                }
                let back = split.unshard(&shards).unwrap();
                assert_eq!(back.dims(), full.dims());
                assert_bitwise_eq(&f32s(&back), &f32s(full));
            }
        }
    }
}

#[test]
fn bad_splits_name_every_factor() {
    let w = Tensor::zeros((18, 6), DType::F32, &Device::Cpu).unwrap();
    // 3 heads of width 2 cannot be split over 2 ranks
    let e = shard_qkv(&w, None, 3, 2, 0).unwrap_err().to_string();
    assert!(
        e.contains("n_heads (3)")
            && e.contains("tensor_parallel_degree (2)")
            && e.contains("[18, 6]"),
        "{e}"
    );
    let e = TpSplit::Cols.shard(&w, 4, 0).unwrap_err().to_string();
    assert!(e.contains("multiple of 4") && e.contains("[18, 6]"), "{e}");
    let e = TpSplit::Rows.shard(&w, 2, 2).unwrap_err().to_string();
    assert!(e.contains("rank (2)") && e.contains("degree (2)"), "{e}");
    let b = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
    let e = shard_column(&w, Some(&b), 2, 0).unwrap_err().to_string();
    assert!(e.contains("[18]") && e.contains("[5]"), "{e}");
    let e = TpSplit::Rows.unshard(&[]).unwrap_err().to_string();
    assert!(e.contains("at least one shard"), "{e}");
}
