//! The Llama layout under tensor, sequence and data parallelism, against the single-rank
//! model, as `parallel_gpt.rs` checks GPT: logits, loss and gradients at tp = 2 and 4 with and
//! without sequence parallelism (at tp = 4 the preset's 2 key/value heads are replicated, each
//! on 2 ranks), parameters after 5 training steps under tp, and ZeRO-1/2/3 bitwise equal to
//! plain data parallelism.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::equivalence::{bound_used, dense_run, flat, loss_and_grads, tokens};

use kiln_comm::ThreadComm;
use kiln_model::{kv_replicated, Gpt, GptConfig, GptOptions};
use kiln_parallel::tp::TpSplit;
use kiln_testkit::{assert_close, run_ranks};
use std::collections::HashMap;
use std::sync::Arc;

#[test]
fn llama_tensor_parallel_equals_tp1_on_the_cpu_preset() {
    let cfg = GptConfig::llama_cpu();
    assert_eq!((cfg.n_heads, cfg.kv_heads()), (8, 2));
    let opts = GptOptions::seeded(7);
    let (x, y) = tokens(2, 16, cfg.vocab_size, 1);
    let (_, logits_ref, loss_ref, dense_grads) = dense_run(&cfg, &opts, &x, &y);
    for (tp, sp) in [(2usize, false), (4, false), (2, true), (4, true)] {
        assert_eq!(kv_replicated(8, 2, tp).unwrap(), tp == 4);
        let opts = opts.clone().with_sequence_parallel(sp);
        let outs = run_ranks(tp, |comm: ThreadComm| {
            let model = Gpt::tensor_parallel(&cfg, &opts, Arc::new(comm))?;
            let logits = flat(&model.forward(&x)?);
            let (l, grads) = loss_and_grads(&model, &x, &y)?;
            let splits: HashMap<String, TpSplit> = model.param_splits().into_iter().collect();
            Ok((logits, l, grads, splits))
        });
        let case = format!("tp={tp}{}", if sp { " sequence-parallel" } else { "" });
        for (rank, (logits, l, grads, splits)) in outs.iter().enumerate() {
            assert_close(logits, &logits_ref, 1e-5, 1e-5);
            assert!(
                (l - loss_ref).abs() <= 1e-5 * loss_ref.abs(),
                "{case}: loss {l} vs {loss_ref}"
            );
            assert_eq!(grads.len(), dense_grads.len());
            let mut worst = 0.0f64;
            for ((name, got), (dname, dg)) in grads.iter().zip(&dense_grads) {
                assert_eq!(name, dname);
                let kv = name.contains("k_proj") || name.contains("v_proj");
                if kv {
                    let whole = splits[name] == TpSplit::Replicated;
                    assert_eq!(whole, tp == 4, "{case}: {name} split {:?}", splits[name]);
                }
                let want = flat(&splits[name].shard(dg, tp, rank).unwrap());
                assert_close(got, &want, 1e-5, 1e-5);
                worst = worst.max(bound_used(got, &want));
                if splits[name] == TpSplit::Replicated {
                    // the replicas' gradients are the same on every rank
                    let on_rank0 = &outs[0].2.iter().find(|(n, _)| n == name).unwrap().1;
                    assert_eq!(got, on_rank0, "{case}: {name}: rank {rank} differs from 0");
                }
            }
            if rank == 0 {
                println!(
                    "llama_cpu {case}: loss {l} vs {loss_ref}; gradients within 1e-5 + 1e-5 |b| \
                     (worst |a - b| / (1e-5 + 1e-5 |b|): {worst:.2})"
                );
            }
        }
    }
}

/// Training under tensor parallelism against tp = 1, and ZeRO against plain data parallel,
/// with the shared suite's bounds.
#[test]
fn llama_training_under_tp_and_zero_equals_one_rank() {
    let outs = run_ranks(4, |comm: ThreadComm| {
        let world: Arc<dyn kiln_comm::Communicator> = Arc::new(comm);
        let mut done = common::equivalence::tensor_parallel_training(
            &world,
            "llama_cpu",
            &GptConfig::llama_cpu(),
        )?;
        done.extend(common::equivalence::zero_equals_plain(
            &world,
            &GptConfig::llama_tiny(),
        )?);
        Ok(done)
    });
    for line in &outs[0] {
        println!("{line}");
    }
    assert_eq!(outs[0].len(), 5, "{:?}", outs[0]);
}

/// A degree that neither divides the key/value heads nor is a multiple of them is an error
/// naming both numbers, as is one that does not divide the query heads.
#[test]
fn llama_tensor_parallel_degrees_that_do_not_fit_are_named() {
    let mut cfg = GptConfig::llama_tiny();
    (cfg.n_heads, cfg.n_kv_heads, cfg.d_model) = (6, Some(3), 96);
    let outs = run_ranks(2, |comm: ThreadComm| {
        Ok(
            Gpt::tensor_parallel(&cfg, &GptOptions::seeded(1), Arc::new(comm))
                .unwrap_err()
                .to_string(),
        )
    });
    assert!(
        outs[0].contains("degree (2)") && outs[0].contains("n_kv_heads 3"),
        "{}",
        outs[0]
    );
    let e = kv_replicated(8, 2, 3).unwrap_err().to_string();
    assert!(e.contains("(3) must divide n_heads (8)"), "{e}");
}
