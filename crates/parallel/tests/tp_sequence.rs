//! Sequence parallelism's conjugate ops (the gather, reduce-scatter and scatter of token rows)
//! forward and backward against their definitions, bitwise, on 2 and 4 thread ranks in f32,
//! f64, f16 and bf16 (values are multiples of 1/8, so every sum is exact); and the layers built
//! on them against the unsplit computation: column- then row-parallel linear against the dense
//! pair, the embedding against the dense lookup, the fused head and loss against the
//! vocab-parallel one on the gathered rows.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use kiln_comm::Communicator;
use kiln_parallel::tp::{
    column_parallel_linear_sp, gather_from_sequence_parallel_region, linear,
    reduce_scatter_to_sequence_parallel_region, row_parallel_linear_sp,
    scatter_to_sequence_parallel_region, sequence_parallel_linear_cross_entropy,
    sequence_parallel_rows, shard_column, shard_row, shard_vocab, vocab_parallel_embedding_sp,
    vocab_parallel_linear_cross_entropy, TpComm,
};
use kiln_testkit::{assert_bitwise_eq, assert_close, run_ranks};
use std::sync::Arc;

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// A `[b, s, d]` tensor of multiples of 1/8 in [-5/8, 5/8], different for each `salt`.
fn eighths(dims: (usize, usize, usize), salt: usize, dtype: DType) -> Tensor {
    let n = dims.0 * dims.1 * dims.2;
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7 + (i / dims.2) * 3 + salt * 5) % 11) as f32 / 8.0 - 5.0 / 8.0)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Values from a smooth function of the index (for the layers, compared to a tolerance).
fn smooth(dims: &[usize], salt: f32) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 0.37 + salt).sin() * 0.5)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

fn tp(comm: kiln_comm::ThreadComm) -> TpComm {
    Arc::new(comm)
}

/// This rank's run of the flattened rows of `[b, s, d]`.
fn rows_of(x: &Tensor, tp: usize, rank: usize) -> Tensor {
    let (b, s, d) = x.dims3().unwrap();
    let n = b * s / tp;
    x.reshape((b * s, d))
        .unwrap()
        .narrow(0, rank * n, n)
        .unwrap()
        .reshape((b, s / tp, d))
        .unwrap()
}

/// Every rank's rows one after the other, shaped `dims`.
fn concat_rows(parts: &[Tensor], dims: (usize, usize, usize)) -> Tensor {
    let flat: Vec<Tensor> = parts.iter().map(|p| p.flatten_all().unwrap()).collect();
    Tensor::cat(&flat, 0).unwrap().reshape(dims).unwrap()
}

#[test]
fn the_row_collectives_match_their_definitions_forward_and_backward() {
    let dims = (2, 4, 3);
    for world in [2usize, 4] {
        for dtype in DTYPES {
            let out = run_ranks(world, |comm| {
                let r = comm.rank();
                let comm = tp(comm);
                // gather: every rank's rows in rank order; backward, the summed gradient's rows
                let mine = Var::from_tensor(&rows_of(&eighths(dims, r, dtype), world, r))?;
                let g = gather_from_sequence_parallel_region(&mine, &comm)?;
                let seed = eighths(dims, 10 + r, dtype);
                let dg = (&g * &seed)?.sum_all()?.backward()?;
                // reduce-scatter: this rank's rows of the sum; backward, the gathered gradient
                let whole = Var::from_tensor(&eighths(dims, 20 + r, dtype))?;
                let rs = reduce_scatter_to_sequence_parallel_region(&whole, &comm)?;
                let rs_seed = rows_of(&eighths(dims, 30 + r, dtype), world, r);
                let drs = (&rs * &rs_seed)?.sum_all()?.backward()?;
                // scatter: this rank's rows; backward, the gathered gradient
                let rep = Var::from_tensor(&eighths(dims, 40, dtype))?;
                let sc = scatter_to_sequence_parallel_region(&rep, &comm)?;
                let dsc = (&sc * &rs_seed)?.sum_all()?.backward()?;
                Ok((
                    (g.dims().to_vec(), rs.dims().to_vec(), sc.dims().to_vec()),
                    [
                        values(&g),
                        values(dg.get(&mine).unwrap()),
                        values(&rs),
                        values(drs.get(&whole).unwrap()),
                        values(&sc),
                        values(dsc.get(&rep).unwrap()),
                    ],
                ))
            });
            let sum = |salt: usize| {
                (0..world)
                    .map(|k| eighths(dims, salt + k, DType::F64))
                    .reduce(|a, b| (a + b).unwrap())
                    .unwrap()
            };
            // what every rank's gradient seeds add up to, per op
            let g_seed_sum = sum(10);
            let rs_sum = sum(20);
            let rs_seeds: Vec<Tensor> = (0..world)
                .map(|k| rows_of(&eighths(dims, 30 + k, DType::F64), world, k))
                .collect();
            let rs_seeds_whole = concat_rows(&rs_seeds, dims);
            for (r, (shapes, got)) in out.iter().enumerate() {
                assert_eq!(shapes.0, [2, 4, 3]);
                assert_eq!(shapes.1, [2, 4 / world, 3]);
                assert_eq!(shapes.2, [2, 4 / world, 3]);
                let gathered = concat_rows(
                    &(0..world)
                        .map(|k| rows_of(&eighths(dims, k, DType::F64), world, k))
                        .collect::<Vec<_>>(),
                    dims,
                );
                let want = [
                    values(&gathered),
                    values(&rows_of(&g_seed_sum, world, r)),
                    values(&rows_of(&rs_sum, world, r)),
                    values(&rs_seeds_whole),
                    values(&rows_of(&eighths(dims, 40, DType::F64), world, r)),
                    values(&rs_seeds_whole),
                ];
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(a, b, "world {world} {dtype:?} rank {r}: output {i}");
                }
            }
        }
    }
}

#[test]
fn a_sequence_that_does_not_split_is_an_error_naming_the_shape() {
    let out = run_ranks(2, |comm| {
        let comm = tp(comm);
        let x = eighths((2, 3, 4), 0, DType::F32);
        let rs = reduce_scatter_to_sequence_parallel_region(&x, &comm)
            .unwrap_err()
            .to_string();
        let sc = scatter_to_sequence_parallel_region(&x, &comm)
            .unwrap_err()
            .to_string();
        let rows = sequence_parallel_rows(7, &comm).unwrap_err().to_string();
        let flat = gather_from_sequence_parallel_region(
            &Tensor::zeros(5, DType::F32, &Device::Cpu)?,
            &comm,
        )
        .unwrap_err()
        .to_string();
        Ok((rs, sc, rows, flat))
    });
    let (rs, sc, rows, flat) = &out[0];
    assert!(
        rs.contains("[2, 3, 4]") && rs.contains("multiple of 2"),
        "{rs}"
    );
    assert!(sc.contains("[2, 3, 4]"), "{sc}");
    assert!(rows.contains("7") && rows.contains("degree 2"), "{rows}");
    assert!(flat.contains("[5]"), "{flat}");
}

/// fc2(gelu-free) fc1 on split rows: `row_sp(col_sp(x))` equals the dense pair on this rank's
/// rows; the input gradient is the dense one's rows, each weight's the dense one's shard, and
/// the replicated bias gets the whole dense gradient on every rank.
#[test]
fn column_then_row_parallel_on_split_rows_equal_the_dense_pair() {
    let (b, s, d, f) = (2, 8, 6, 12);
    let x = smooth(&[b, s, d], 0.1);
    let w1 = smooth(&[f, d], 0.7);
    let b1 = smooth(&[f], 1.3);
    let w2 = smooth(&[d, f], 2.1);
    let b2 = smooth(&[d], 2.9);
    let seed = smooth(&[b, s, d], 3.7);
    let (xv, w1v, b1v, w2v, b2v) = (
        Var::from_tensor(&x).unwrap(),
        Var::from_tensor(&w1).unwrap(),
        Var::from_tensor(&b1).unwrap(),
        Var::from_tensor(&w2).unwrap(),
        Var::from_tensor(&b2).unwrap(),
    );
    let y = linear(&linear(&xv, &w1v, Some(&b1v)).unwrap(), &w2v, Some(&b2v)).unwrap();
    let g = (&y * &seed).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| g.get(v).unwrap().clone();
    for world in [2usize, 4] {
        let out = run_ranks(world, |comm| {
            let r = comm.rank();
            let comm = tp(comm);
            let (w1s, b1s) = shard_column(&w1, Some(&b1), world, r)?;
            let (w2s, _) = shard_row(&w2, None, world, r)?;
            let xs = Var::from_tensor(&rows_of(&x, world, r))?;
            let (w1s, b1s, w2s, b2s) = (
                Var::from_tensor(&w1s)?,
                Var::from_tensor(&b1s.unwrap())?,
                Var::from_tensor(&w2s)?,
                Var::from_tensor(&b2)?,
            );
            let h = column_parallel_linear_sp(&xs, &w1s, Some(&b1s), &comm)?;
            let ys = row_parallel_linear_sp(&h, &w2s, Some(&b2s), &comm)?;
            let gs = (&ys * rows_of(&seed, world, r))?.sum_all()?.backward()?;
            let gr = |v: &Var| f32s(gs.get(v).unwrap());
            Ok((f32s(&ys), [gr(&xs), gr(&w1s), gr(&b1s), gr(&w2s), gr(&b2s)]))
        });
        for (r, (ys, grads)) in out.iter().enumerate() {
            assert_close(ys, &f32s(&rows_of(&y, world, r)), 1e-5, 1e-6);
            let (w1g, b1g) = shard_column(&grad(&w1v), Some(&grad(&b1v)), world, r).unwrap();
            let (w2g, _) = shard_row(&grad(&w2v), None, world, r).unwrap();
            let want = [
                f32s(&rows_of(&grad(&xv), world, r)),
                f32s(&w1g),
                f32s(&b1g.unwrap()),
                f32s(&w2g),
                f32s(&grad(&b2v)),
            ];
            for (i, (a, w)) in grads.iter().zip(&want).enumerate() {
                assert_close(a, w, 1e-5, 1e-6);
                if i == 4 {
                    assert_bitwise_eq(a, &out[0].1[4]);
                }
            }
        }
    }
}

#[test]
fn the_split_embedding_and_head_equal_the_unsplit_ones() {
    let (b, s, d, vocab) = (2, 8, 6, 16);
    let wte = smooth(&[vocab, d], 0.3);
    let ids: Vec<u32> = (0..b * s).map(|i| ((i * 5 + 3) % vocab) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, s), &Device::Cpu).unwrap();
    let targets = ids.flatten_all().unwrap();
    let dense = wte
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((b, s, d))
        .unwrap();
    let h = smooth(&[b * s, d], 1.9);
    for world in [2usize, 4] {
        let out = run_ranks(world, |comm| {
            let r = comm.rank();
            let comm = tp(comm);
            let local = shard_vocab(&wte, world, r)?;
            let emb = vocab_parallel_embedding_sp(&ids, &local, &comm)?;
            // the head on this rank's rows against the vocab-parallel head on every row
            let n = b * s / world;
            let mine = Var::from_tensor(&h.narrow(0, r * n, n)?)?;
            let w = Var::from_tensor(&local)?;
            let loss = sequence_parallel_linear_cross_entropy(&mine, &w, &targets, None, &comm)?;
            let g = loss.backward()?;
            let all = Var::from_tensor(&h)?;
            let w2 = Var::from_tensor(&local)?;
            let loss2 = vocab_parallel_linear_cross_entropy(&all, &w2, &targets, None, &comm)?;
            let g2 = loss2.backward()?;
            Ok((
                f32s(&emb),
                [
                    f32s(&loss),
                    f32s(g.get(&mine).unwrap()),
                    f32s(g.get(&w).unwrap()),
                ],
                [
                    f32s(&loss2),
                    f32s(&g2.get(&all).unwrap().narrow(0, r * n, n)?),
                    f32s(g2.get(&w2).unwrap()),
                ],
            ))
        });
        for (r, (emb, sp, full)) in out.iter().enumerate() {
            assert_bitwise_eq(emb, &f32s(&rows_of(&dense, world, r)));
            for (a, w) in sp.iter().zip(full) {
                assert_bitwise_eq(a, w);
            }
        }
    }
}
