//! The vocab-parallel embedding, its tied head and the vocab-parallel cross-entropy at tp = 1,
//! 2 and 4 against the dense computation: a plain `index_select` lookup and a log-softmax NLL
//! written with candle ops, differentiated by candle's autograd.
//!
//! Tolerances: the embedding output is bitwise equal (each row is one rank's row plus zeros).
//! The loss is compared within 1e-6 relative and the logits gradient within 1e-6 absolute for
//! f32 (the cross-entropy reduces rows in f64, the dense reference in f32), 1e-12 for f64; the
//! tied-model gradients within 1e-5 + 1e-5 relative.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var, D};
use kiln_comm::Communicator;
use kiln_parallel::tp::{
    linear_cross_entropy, shard_vocab, vocab_parallel_cross_entropy, vocab_parallel_embedding,
    vocab_parallel_linear_cross_entropy, vocab_parallel_logits, with_matmul_precision,
    MatmulPrecision, TpComm, VocabParallelEmbedding,
};
use kiln_parallel::ParallelError;
use kiln_testkit::{assert_bitwise_eq, assert_close, run_ranks, try_run_ranks};
use std::sync::Arc;
use std::time::Duration;

/// Uniform values in [-scale, scale) from a counter-based hash of (seed, index).
fn uniform(dims: &[usize], seed: u64, scale: f64) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n as u64)
        .map(|i| {
            let mut z = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9))
                .wrapping_add(0x94D0_49BB_1331_11EB);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn tp(comm: kiln_comm::ThreadComm) -> TpComm {
    Arc::new(comm)
}

fn grad(g: &candle_core::backprop::GradStore, v: &Var) -> Tensor {
    g.get(v).expect("a gradient").clone()
}

/// Dense mean NLL of `log_softmax(logits)` at the targets not equal to `ignore`, with plain
/// candle ops in the logits' dtype.
fn dense_nll(logits: &Tensor, targets: &[u32], ignore: Option<u32>) -> Tensor {
    let (n, v) = logits.dims2().unwrap();
    let counted: Vec<bool> = targets.iter().map(|&t| Some(t) != ignore).collect();
    let count = counted.iter().filter(|&&c| c).count();
    let onehot: Vec<f64> = (0..n * v)
        .map(|i| f64::from(u8::from(counted[i / v] && targets[i / v] as usize == i % v)))
        .collect();
    let weight: Vec<f64> = counted.iter().map(|&c| f64::from(u8::from(c))).collect();
    let dt = logits.dtype();
    let onehot = Tensor::from_vec(onehot, (n, v), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let weight = Tensor::from_vec(weight, (n, 1), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let max = logits.max_keepdim(D::Minus1).unwrap().detach();
    let lse = (logits
        .broadcast_sub(&max)
        .unwrap()
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap()
        + &max)
        .unwrap();
    let total = ((&lse * &weight).unwrap().sum_all().unwrap()
        - (logits * &onehot).unwrap().sum_all().unwrap())
    .unwrap();
    (total / count.max(1) as f64).unwrap()
}

/// Targets over a vocabulary of 16 touching every rank's slice, two of them the ignore index 5.
const TARGETS: [u32; 7] = [0, 5, 15, 7, 5, 8, 3];

fn cross_entropy_case(dtype: DType, loss_rtol: f64, grad_atol: f64) {
    let v = 16;
    let logits = uniform(&[TARGETS.len(), v], 1, 4.0)
        .to_dtype(dtype)
        .unwrap();
    let lv = Var::from_tensor(&logits).unwrap();
    let loss = dense_nll(lv.as_tensor(), &TARGETS, Some(5));
    let dlogits = grad(&loss.backward().unwrap(), &lv);
    let loss = f64s(&loss)[0];
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| {
            let r = comm.rank();
            let comm = tp(comm);
            let local = Var::from_tensor(&logits.narrow(1, r * v / world, v / world)?)?;
            let targets = Tensor::new(&TARGETS, &Device::Cpu)?;
            let l = vocab_parallel_cross_entropy(local.as_tensor(), &targets, Some(5), &comm)?;
            let g = l.backward()?;
            Ok((l, grad(&g, &local)))
        });
        for (r, (l, g)) in outs.iter().enumerate() {
            let want_dtype = if dtype == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            assert_eq!(l.dtype(), want_dtype);
            assert_eq!(g.dtype(), dtype);
            let got = f64s(l)[0];
            println!("{dtype:?} tp {world}: loss {got} vs dense {loss}");
            assert_close(&[got], &[loss], 0.0, loss_rtol);
            let want = dlogits.narrow(1, r * v / world, v / world).unwrap();
            assert_close(&f64s(g), &f64s(&want), grad_atol, 0.0);
        }
    }
}

#[test]
fn cross_entropy_matches_the_dense_log_softmax_nll_in_f32() {
    cross_entropy_case(DType::F32, 1e-6, 1e-6);
}

#[test]
fn cross_entropy_matches_the_dense_log_softmax_nll_in_f64() {
    cross_entropy_case(DType::F64, 1e-12, 1e-12);
}

#[test]
fn cross_entropy_on_half_logits_matches_the_f32_computation_of_the_same_values() {
    // the loss is reduced in f64 from the half values, so it matches f32 on the upcast values;
    // the gradient is rounded to the half dtype: within 2e-3 of gradients below 1/5
    for dtype in [DType::F16, DType::BF16] {
        let v = 16;
        let logits = uniform(&[TARGETS.len(), v], 2, 4.0)
            .to_dtype(dtype)
            .unwrap();
        let up = Var::from_tensor(&logits.to_dtype(DType::F32).unwrap()).unwrap();
        let loss = dense_nll(up.as_tensor(), &TARGETS, Some(5));
        let dlogits = grad(&loss.backward().unwrap(), &up);
        let outs = run_ranks(2, |comm| {
            let r = comm.rank();
            let comm = tp(comm);
            let local = Var::from_tensor(&logits.narrow(1, r * v / 2, v / 2)?)?;
            let targets = Tensor::new(&TARGETS, &Device::Cpu)?;
            let l = vocab_parallel_cross_entropy(local.as_tensor(), &targets, Some(5), &comm)?;
            let g = l.backward()?;
            Ok((f64s(&l)[0], grad(&g, &local)))
        });
        for (r, (l, g)) in outs.iter().enumerate() {
            assert_eq!(g.dtype(), dtype);
            assert_close(&[*l], &f64s(&loss), 0.0, 1e-6);
            let want = dlogits.narrow(1, r * v / 2, v / 2).unwrap();
            assert_close(&f64s(g), &f64s(&want), 2e-3, 0.0);
        }
    }
}

#[test]
fn all_ignored_targets_give_zero_loss_and_zero_gradient() {
    let outs = run_ranks(2, |comm| {
        let comm = tp(comm);
        let local = Var::from_tensor(&uniform(&[3, 4], 3, 2.0).to_dtype(DType::F32)?)?;
        let targets = Tensor::new(&[7u32, 7, 7], &Device::Cpu)?;
        let l = vocab_parallel_cross_entropy(local.as_tensor(), &targets, Some(7), &comm)?;
        let g = grad(&l.backward()?, &local);
        Ok((l.to_scalar::<f32>()?, f64s(&g)))
    });
    for (l, g) in outs {
        assert_eq!(l, 0.0);
        assert!(g.iter().all(|&x| x == 0.0));
    }
}

/// The bits of every element, whatever the float dtype.
fn bits(t: &Tensor) -> Vec<u64> {
    f64s(t).iter().map(|v| v.to_bits()).collect()
}

/// The dtypes and matmul precisions the fused head is checked at: f32 at both precisions, f64
/// and bf16.
const HEAD_CASES: [(DType, MatmulPrecision); 4] = [
    (DType::F32, MatmulPrecision::Highest),
    (DType::F32, MatmulPrecision::Bf16),
    (DType::F64, MatmulPrecision::Highest),
    (DType::BF16, MatmulPrecision::Highest),
];

/// The fused vocab-parallel head and cross-entropy of `x` and `w` (this rank's rows), target 5
/// ignored.
fn fused_head(x: &Var, w: &Var, targets: &Tensor, comm: &TpComm) -> kiln_parallel::Result<Tensor> {
    vocab_parallel_linear_cross_entropy(x.as_tensor(), w.as_tensor(), targets, Some(5), comm)
}

/// The fused head and cross-entropy gives bitwise the loss and the gradients of `x` and of
/// the weight that the two ops give: tp 1 and 2, f32 at both matmul precisions, f64 and bf16,
/// an ignored target, and a loss scaled before the backward (an incoming gradient of 4).
#[test]
fn fused_head_cross_entropy_is_bitwise_the_two_ops() {
    let (n, v, d) = (TARGETS.len(), 64, 24);
    let x0 = uniform(&[n, d], 11, 1.0);
    let w0 = uniform(&[v, d], 12, 1.0);
    for (dtype, precision) in HEAD_CASES {
        for world in [1, 2] {
            let outs = run_ranks(world, |comm| {
                let comm = tp(comm);
                let targets = Tensor::new(&TARGETS, &Device::Cpu)?;
                let x = Var::from_tensor(&x0.to_dtype(dtype)?)?;
                let local = shard_vocab(&w0, comm.world_size(), comm.rank())?;
                let w = Var::from_tensor(&local.to_dtype(dtype)?)?;
                let run = |fused: bool| -> kiln_parallel::Result<Vec<Vec<u64>>> {
                    let l = with_matmul_precision(precision, || {
                        if fused {
                            fused_head(&x, &w, &targets, &comm)
                        } else {
                            let logits =
                                vocab_parallel_logits(x.as_tensor(), w.as_tensor(), &comm)?;
                            vocab_parallel_cross_entropy(&logits, &targets, Some(5), &comm)
                        }
                    })?;
                    let g = (&l * 4.0)?.backward()?;
                    Ok(vec![bits(&l), bits(&grad(&g, &x)), bits(&grad(&g, &w))])
                };
                Ok((run(true)?, run(false)?))
            });
            for (r, (fused, two_ops)) in outs.iter().enumerate() {
                for (what, (f, t)) in ["loss", "dx", "dw"].iter().zip(fused.iter().zip(two_ops)) {
                    assert_eq!(f, t, "{what}: {dtype:?} {precision:?} tp {world} rank {r}");
                }
            }
        }
    }
}

/// The head and cross-entropy over a whole vocabulary, with no communicator, is bitwise the
/// fused vocab-parallel op on one rank (loss, gradients of `x` and of the weight, the cases
/// above), and its loss and gradients match the dense log-softmax NLL of `x w^T` written with
/// candle ops: within 1e-6 relative (loss) and 1e-5 absolute (gradients) in f32, 1e-12 and
/// 1e-10 in f64.
#[test]
fn whole_vocabulary_head_cross_entropy_is_the_one_rank_fused_op_and_the_dense_nll() {
    let (n, v, d) = (TARGETS.len(), 64, 24);
    let x0 = uniform(&[n, d], 21, 1.0);
    let w0 = uniform(&[v, d], 22, 1.0);
    let targets = Tensor::new(&TARGETS, &Device::Cpu).unwrap();
    for (dtype, precision) in HEAD_CASES {
        let x = Var::from_tensor(&x0.to_dtype(dtype).unwrap()).unwrap();
        let w = Var::from_tensor(&w0.to_dtype(dtype).unwrap()).unwrap();
        let comm = tp(kiln_comm::ThreadComm::group(1, Default::default())
            .unwrap()
            .remove(0));
        let run = |whole: bool| -> Vec<Tensor> {
            let l = with_matmul_precision(precision, || {
                if whole {
                    linear_cross_entropy(x.as_tensor(), w.as_tensor(), &targets, Some(5))
                } else {
                    fused_head(&x, &w, &targets, &comm)
                }
            })
            .unwrap();
            let g = (&l * 4.0).unwrap().backward().unwrap();
            vec![l, grad(&g, &x), grad(&g, &w)]
        };
        let (whole, one_rank) = (run(true), run(false));
        for (what, (a, b)) in ["loss", "dx", "dw"].iter().zip(whole.iter().zip(&one_rank)) {
            assert_eq!(bits(a), bits(b), "{what}: {dtype:?} {precision:?}");
        }
        if precision != MatmulPrecision::Highest || dtype == DType::BF16 {
            continue;
        }
        let (loss_rtol, grad_atol) = if dtype == DType::F64 {
            (1e-12, 1e-10)
        } else {
            (1e-6, 1e-5)
        };
        let logits = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let dense = dense_nll(&logits, &TARGETS, Some(5));
        let g = (&dense * 4.0).unwrap().backward().unwrap();
        println!(
            "{dtype:?}: loss {} vs dense {}",
            f64s(&whole[0])[0],
            f64s(&dense)[0]
        );
        assert_close(&f64s(&whole[0]), &f64s(&dense), 0.0, loss_rtol);
        assert_close(&f64s(&whole[1]), &f64s(&grad(&g, &x)), grad_atol, 0.0);
        assert_close(&f64s(&whole[2]), &f64s(&grad(&g, &w)), grad_atol, 0.0);
    }
}

/// The whole-vocabulary head refuses the same bad inputs, naming them.
#[test]
fn whole_vocabulary_head_cross_entropy_rejects_bad_shapes() {
    let w = uniform(&[16, 8], 1, 1.0);
    let targets = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    let err = linear_cross_entropy(&uniform(&[3, 9], 2, 1.0), &w, &targets, None).unwrap_err();
    assert!(err.to_string().contains("LM head input"), "{err}");
    let err = linear_cross_entropy(&uniform(&[4, 8], 3, 1.0), &w, &targets, None).unwrap_err();
    assert!(err.to_string().contains("cross-entropy targets"), "{err}");
    let far = Tensor::new(&[1u32, 99, 3], &Device::Cpu).unwrap();
    let err = linear_cross_entropy(&uniform(&[3, 8], 4, 1.0), &w, &far, None).unwrap_err();
    assert!(err.to_string().contains("99 at position 1"), "{err}");
}

/// Inputs of the wrong shape are errors naming them, before any product runs.
#[test]
fn fused_head_cross_entropy_rejects_bad_shapes() {
    let comm = tp(kiln_comm::ThreadComm::group(1, Default::default())
        .unwrap()
        .remove(0));
    let w = uniform(&[16, 8], 1, 1.0);
    let targets = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    let wide = uniform(&[3, 9], 2, 1.0);
    let err = vocab_parallel_linear_cross_entropy(&wide, &w, &targets, None, &comm).unwrap_err();
    assert!(err.to_string().contains("LM head input"), "{err}");
    let x = uniform(&[4, 8], 3, 1.0);
    let err = vocab_parallel_linear_cross_entropy(&x, &w, &targets, None, &comm).unwrap_err();
    assert!(err.to_string().contains("cross-entropy targets"), "{err}");
    let x = uniform(&[3, 8], 4, 1.0);
    let far = Tensor::new(&[1u32, 99, 3], &Device::Cpu).unwrap();
    let err = vocab_parallel_linear_cross_entropy(&x, &w, &far, None, &comm).unwrap_err();
    assert!(err.to_string().contains("99 at position 1"), "{err}");
}

#[test]
fn embedding_matches_a_dense_lookup() {
    let (v, d) = (16, 6);
    let wte = uniform(&[v, d], 4, 1.0).to_dtype(DType::F32).unwrap();
    let ids: Vec<u32> = vec![0, 15, 4, 4, 9, 12, 3, 8, 1, 15];
    let up = uniform(&[2, 5, d], 5, 1.0).to_dtype(DType::F32).unwrap();
    let wv = Var::from_tensor(&wte).unwrap();
    let ids_t = Tensor::from_vec(ids.clone(), (2, 5), &Device::Cpu).unwrap();
    let emb = wv
        .as_tensor()
        .index_select(&ids_t.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((2, 5, d))
        .unwrap();
    let dw = grad(
        &(&emb * &up).unwrap().sum_all().unwrap().backward().unwrap(),
        &wv,
    );
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| {
            let layer = VocabParallelEmbedding::from_full(&wte, tp(comm))?;
            assert_eq!(layer.vocab(), v);
            let e = layer.forward(&ids_t)?;
            let g = grad(&(&e * &up)?.sum_all()?.backward()?, layer.weight());
            Ok((e, g, layer.vocab_range()))
        });
        for (r, (e, g, range)) in outs.iter().enumerate() {
            assert_eq!(*range, r * v / world..(r + 1) * v / world);
            assert_eq!(e.dims(), [2, 5, d]);
            let e32: Vec<f32> = f64s(e).iter().map(|&x| x as f32).collect();
            let want: Vec<f32> = f64s(&emb).iter().map(|&x| x as f32).collect();
            assert_bitwise_eq(&e32, &want);
            let rows = dw.narrow(0, r * v / world, v / world).unwrap();
            assert_close(&f64s(g), &f64s(&rows), 1e-6, 0.0);
        }
    }
}

#[test]
fn tied_embedding_and_head_match_the_dense_model() {
    // ids -> embedding -> tanh(1.5 h) -> tied head -> cross-entropy: the embedding's gradient
    // gathers both uses, so the head's input gradient must have been summed by f
    let (v, d) = (16, 8);
    let wte = uniform(&[v, d], 6, 1.0).to_dtype(DType::F32).unwrap();
    let ids: Vec<u32> = vec![1, 14, 6, 9, 2, 11, 5, 0, 15, 8];
    let targets: Vec<u32> = vec![14, 6, 9, 2, 11, 5, 0, 15, 8, 3];
    let ids_t = Tensor::from_vec(ids.clone(), 10, &Device::Cpu).unwrap();
    let tgt_t = Tensor::from_vec(targets.clone(), 10, &Device::Cpu).unwrap();
    let wv = Var::from_tensor(&wte).unwrap();
    let h = wv.as_tensor().index_select(&ids_t, 0).unwrap();
    let z = (h * 1.5).unwrap().tanh().unwrap();
    let logits = z.matmul(&wv.as_tensor().t().unwrap()).unwrap();
    let loss = dense_nll(&logits, &targets, None);
    let dw = grad(&loss.backward().unwrap(), &wv);
    let loss = f64s(&loss)[0];
    for world in [1, 2, 4] {
        let outs = run_ranks(world, |comm| {
            let comm = tp(comm);
            let local = Var::from_tensor(&shard_vocab(&wte, comm.world_size(), comm.rank())?)?;
            let h = vocab_parallel_embedding(&ids_t, local.as_tensor(), &comm)?;
            let z = (h * 1.5)?.tanh()?;
            let logits = vocab_parallel_logits(&z, local.as_tensor(), &comm)?;
            let l = vocab_parallel_cross_entropy(&logits, &tgt_t, None, &comm)?;
            let g = grad(&l.backward()?, &local);
            Ok((f64s(&l)[0], g))
        });
        for (r, (l, g)) in outs.iter().enumerate() {
            assert_close(&[*l], &[loss], 0.0, 1e-6);
            let rows = dw.narrow(0, r * v / world, v / world).unwrap();
            assert_close(&f64s(g), &f64s(&rows), 1e-5, 1e-5);
        }
    }
}

#[test]
fn ids_and_targets_outside_the_vocabulary_are_errors() {
    let outs = run_ranks(2, |comm| {
        let comm = tp(comm);
        let wte = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?;
        let ids = Tensor::new(&[1u32, 8], &Device::Cpu)?;
        let e1 = vocab_parallel_embedding(&ids, &wte, &comm)
            .unwrap_err()
            .to_string();
        let logits = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
        let e2 = vocab_parallel_cross_entropy(&logits, &ids, None, &comm)
            .unwrap_err()
            .to_string();
        let e3 = vocab_parallel_cross_entropy(&logits, &ids, Some(8), &comm)
            .map(|_| ())
            .map_err(|e| e.to_string());
        let short = Tensor::new(&[1u32], &Device::Cpu)?;
        let e4 = vocab_parallel_cross_entropy(&logits, &short, None, &comm)
            .unwrap_err()
            .to_string();
        Ok((e1, e2, e3, e4))
    });
    let (e1, e2, e3, e4) = &outs[0];
    assert!(
        e1.contains("vocabulary size 8") && e1.contains("8 at position 1"),
        "{e1}"
    );
    assert!(
        e2.contains("vocabulary size 8") && e2.contains("8 at position 1"),
        "{e2}"
    );
    assert!(
        e3.is_ok(),
        "an ignored out-of-range target is allowed: {e3:?}"
    );
    assert!(e4.contains("[2]") && e4.contains("[1]"), "{e4}");
}

#[test]
fn a_rank_that_left_fails_the_cross_entropy_with_a_comm_error() {
    let out = try_run_ranks(2, Duration::from_secs(10), |comm| {
        if comm.rank() == 1 {
            return Ok(None);
        }
        let comm = tp(comm);
        let logits = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
        let targets = Tensor::new(&[1u32, 2], &Device::Cpu)?;
        let err = vocab_parallel_cross_entropy(&logits, &targets, None, &comm).unwrap_err();
        Ok(Some(err))
    })
    .unwrap();
    let err = out[0].as_ref().unwrap();
    assert!(
        matches!(
            err,
            ParallelError::Comm(kiln_comm::CommError::RankGone { gone: 1, .. })
        ),
        "{err:?}"
    );
}
