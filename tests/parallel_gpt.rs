//! The GPT model under every parallel strategy, against the single-rank model: tensor parallel
//! against tp=1 (logits, loss, gradients), and the training suite of `common/equivalence.rs`
//! (parameters after training under tp, ZeRO on the real model against plain data parallel,
//! dp x tp with ZeRO-1 and fp16 loss scaling against one rank) on 4 thread ranks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::equivalence::{bound_used, dense_run, flat, loss_and_grads, tokens};

use kiln_comm::ThreadComm;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::tp::TpSplit;
use kiln_testkit::{assert_close, run_ranks};
use std::collections::HashMap;
use std::sync::Arc;

#[test]
fn tensor_parallel_equals_tp1_on_small_cpu() {
    let cfg = GptConfig::small_cpu();
    let opts = GptOptions::seeded(7);
    let (x, y) = tokens(2, 16, cfg.vocab_size, 1);
    let (dense, logits_ref, loss_ref, dense_grads) = dense_run(&cfg, &opts, &x, &y);
    let split: HashMap<String, TpSplit> = dense.param_splits().into_iter().collect();
    for tp in [2usize, 4] {
        let outs = run_ranks(tp, |comm: ThreadComm| {
            let model = Gpt::tensor_parallel(&cfg, &opts, Arc::new(comm))?;
            let logits = flat(&model.forward(&x)?);
            let (l, shard_grads) = loss_and_grads(&model, &x, &y)?;
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
                worst = worst.max(bound_used(got, &want));
            }
            if rank == 0 {
                println!(
                    "tp={tp}: loss {l} vs {loss_ref}; gradients within 1e-5 + 1e-5 |b| (worst \
                     |a - b| / (1e-5 + 1e-5 |b|): {worst:.2})"
                );
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
    assert_eq!(outs[0].len(), 10, "{:?}", outs[0]);
}

/// Sequence parallelism (Megatron-LM): the LayerNorms, residual adds and row-parallel biases
/// on each rank's quarter or half of the token rows, against the unsplit tp = 1 model. The
/// sums over rows of the replicated parameters' gradients run per rank and then over the
/// group, so the match is to a tolerance; those gradients are bitwise the same on every rank.
#[test]
fn sequence_parallel_equals_tp1_on_small_cpu() {
    let cfg = GptConfig::small_cpu();
    let opts = GptOptions::seeded(7);
    let (x, y) = tokens(2, 16, cfg.vocab_size, 1);
    let (x_odd, _) = tokens(2, 15, cfg.vocab_size, 2);
    let (dense, logits_ref, loss_ref, dense_grads) = dense_run(&cfg, &opts, &x, &y);
    let split: HashMap<String, TpSplit> = dense.param_splits().into_iter().collect();
    let logits_odd_ref = flat(&dense.forward(&x_odd).unwrap());
    let sp_opts = opts.clone().with_sequence_parallel(true);
    for tp in [2usize, 4] {
        let outs = run_ranks(tp, |comm: ThreadComm| {
            let model = Gpt::tensor_parallel(&cfg, &sp_opts, Arc::new(comm))?;
            assert!(model.sequence_parallel_group().is_some());
            let hidden = model.embed(&x)?;
            let logits = flat(&model.forward(&x)?);
            let logits_odd = flat(&model.forward(&x_odd)?);
            let (l, shard_grads) = loss_and_grads(&model, &x, &y)?;
            Ok((hidden.dims().to_vec(), logits, logits_odd, l, shard_grads))
        });
        for (rank, (hidden, logits, logits_odd, l, shard_grads)) in outs.iter().enumerate() {
            assert_eq!(hidden, &[2, 16 / tp, cfg.d_model], "this rank's token rows");
            assert_close(logits, &logits_ref, 1e-5, 1e-5);
            assert_close(logits_odd, &logits_odd_ref, 1e-5, 1e-5);
            assert!(
                (l - loss_ref).abs() <= 1e-5 * loss_ref.abs(),
                "tp={tp}: loss {l} vs {loss_ref}"
            );
            let mut worst = 0.0f64;
            let on_rank0 = &outs[0].4;
            assert_eq!(shard_grads.len(), dense_grads.len());
            assert_eq!(on_rank0.len(), dense_grads.len());
            for (i, ((name, got), (dname, dg))) in shard_grads.iter().zip(&dense_grads).enumerate()
            {
                assert_eq!(name, dname);
                let want = flat(&split[name].shard(dg, tp, rank).unwrap());
                assert_close(got, &want, 1e-5, 1e-5);
                worst = worst.max(bound_used(got, &want));
                if split[name] == TpSplit::Replicated {
                    assert_eq!(
                        got, &on_rank0[i].1,
                        "{name}: rank {rank} differs from rank 0"
                    );
                }
            }
            if rank == 0 {
                println!(
                    "sequence parallel tp={tp}: loss {l} vs {loss_ref}; gradients within 1e-5 + \
                     1e-5 |b| (worst |a - b| / (1e-5 + 1e-5 |b|): {worst:.2})"
                );
            }
        }
    }
}

/// What sequence parallelism cannot run says so: a loss over a length the ranks cannot split,
/// layers built without it under a model that asks for it, a context the ranks cannot split.
#[test]
fn sequence_parallel_errors_name_the_sizes_and_the_layer() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(1).with_sequence_parallel(true);
    let (x, y) = tokens(2, 15, cfg.vocab_size, 3);
    let outs = run_ranks(2, |comm: ThreadComm| {
        let tp: Arc<dyn kiln_comm::Communicator> = Arc::new(comm);
        let model = Gpt::tensor_parallel(&cfg, &opts, tp.clone())?;
        let odd = model.loss(&x, &y).unwrap_err().to_string();
        let plain = kiln_model::TensorParallelFactory::new(tp.clone(), cfg.n_heads);
        let layers = Gpt::tensor_parallel_with_factory(&cfg, &opts, tp.clone(), &plain)
            .unwrap_err()
            .to_string();
        let short = GptConfig {
            n_ctx: 31,
            ..cfg.clone()
        };
        let ctx = Gpt::tensor_parallel(&short, &opts, tp)
            .unwrap_err()
            .to_string();
        Ok((odd, layers, ctx))
    });
    let (odd, layers, ctx) = &outs[0];
    assert!(
        odd.contains("sequence length 15") && odd.contains("degree 2"),
        "{odd}"
    );
    assert!(
        layers.contains("h.0.attn.c_attn") && layers.contains("with_sequence_parallel"),
        "{layers}"
    );
    assert!(
        ctx.contains("n_ctx 31") && ctx.contains("degree 2"),
        "{ctx}"
    );
    println!("{odd}\n{layers}\n{ctx}");
}
