//! The GPT model under every parallel strategy, against the single-rank model: tensor parallel
//! against tp=1 (logits, loss, gradients), and the training suite of `common/equivalence.rs`
//! (parameters after training under tp, ZeRO on the real model against plain data parallel,
//! dp x tp with ZeRO-1 and fp16 loss scaling against one rank) on 4 thread ranks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::equivalence::{flat, tokens};

use candle_core::Tensor;
use kiln_comm::ThreadComm;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::tp::TpSplit;
use kiln_testkit::{assert_close, run_ranks};
use std::sync::Arc;

#[test]
fn tensor_parallel_equals_tp1_on_small_cpu() {
    let cfg = GptConfig::small_cpu();
    let opts = GptOptions::seeded(7);
    let (x, y) = tokens(2, 16, cfg.vocab_size, 1);
    let dense = Gpt::new(&cfg, &opts).unwrap();
    let split: std::collections::HashMap<String, TpSplit> =
        dense.param_splits().into_iter().collect();
    let logits_ref = flat(&dense.forward(&x).unwrap());
    let loss = dense.loss(&x, &y).unwrap();
    let loss_ref = loss.to_scalar::<f32>().unwrap();
    let grads = loss.backward().unwrap();
    let dense_grads: Vec<(String, Tensor)> = dense
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).unwrap().clone()))
        .collect();
    for tp in [2usize, 4] {
        let outs = run_ranks(tp, |comm: ThreadComm| {
            let model = Gpt::tensor_parallel(&cfg, &opts, Arc::new(comm))?;
            let logits = flat(&model.forward(&x)?);
            let loss = model.loss(&x, &y)?;
            let l = loss.to_scalar::<f32>()?;
            let g = loss.backward()?;
            let shard_grads: Vec<(String, Vec<f32>)> = model
                .named_parameters()
                .into_iter()
                .map(|(n, v)| (n, flat(g.get(v.as_tensor()).unwrap())))
                .collect();
            Ok((logits, l, shard_grads))
        });
        for (rank, (logits, l, shard_grads)) in outs.iter().enumerate() {
            assert_close(logits, &logits_ref, 1e-5, 1e-5);
            assert!(
                (l - loss_ref).abs() <= 1e-5 * loss_ref.abs(),
                "tp={tp}: loss {l} vs {loss_ref}"
            );
            assert_eq!(shard_grads.len(), dense_grads.len());
            let mut worst = 0.0f64;
            for ((name, got), (dname, dg)) in shard_grads.iter().zip(&dense_grads) {
                assert_eq!(name, dname);
                let want = flat(&split[name].shard(dg, tp, rank).unwrap());
                assert_close(got, &want, 1e-5, 1e-5);
                worst = worst.max(kiln_testkit::max_rel_diff(got, &want));
            }
            if rank == 0 {
                println!("tp={tp}: loss {l} vs {loss_ref}; gradients within 1e-5 (worst relative {worst:e})");
            }
        }
    }
}

/// The training equivalences (tp against tp = 1, ZeRO against plain data parallel, dp x tp
/// fp16 against one rank), the same suite `mpi_equivalence.rs` runs on MPI processes.
#[test]
fn equivalence_suite_on_thread_ranks() {
    let outs = run_ranks(4, |comm: ThreadComm| {
        common::equivalence::suite_on(Arc::new(comm))
    });
    for line in &outs[0] {
        println!("{line}");
    }
    assert_eq!(outs[0].len(), 6, "{:?}", outs[0]);
}
