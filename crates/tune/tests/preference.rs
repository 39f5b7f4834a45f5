//! Preference learning: the DPO loss and its gradient against the closed form, per-sequence
//! log-probabilities against an f64 log-softmax, DPO under tensor parallelism against tp = 1,
//! DPO that resumes bitwise, and DPO and the reward model raising preference
//! accuracy on held-out pairs of the synthetic "repeat the last word" set. DPO under tensor
//! parallelism, DPO's and the reward model's learning run on a grouped-query Llama too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use kiln_ckpt::{CheckpointConfig, Checkpointer, Layout, LoadOptions, LocalFs, RankState};
use kiln_ckpt::{ReshardRequest, Stateful};
use kiln_comm::{Communicator, ThreadComm};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::{DataParallel, DataParallelConfig, ZeroStage};
use kiln_precision::NoScaler;
use kiln_testkit::{assert_close, run_ranks};
use kiln_tune::{
    dpo_loss, last_word_pairs, model_log_probs, preference_batch, DpoConfig, DpoObjective,
    DpoStats, ExampleLoader, PreferencePair, RewardModel, IGNORE_INDEX,
};
use std::sync::Arc;

const CTX: usize = 8;

/// A loss, its named gradients and the logits.
type Run = (f32, Vec<(String, Vec<f32>)>, Vec<f32>);

fn opts(seed: u64) -> GptOptions {
    GptOptions {
        ignore_index: Some(IGNORE_INDEX),
        ..GptOptions::seeded(seed)
    }
}

#[test]
fn dpo_loss_and_gradient_match_the_closed_form() {
    let dev = Device::Cpu;
    let pc = Var::new(&[-3.0f64, -1.5, -4.0], &dev).unwrap();
    let pr = Var::new(&[-2.0f64, -2.5, -4.0], &dev).unwrap();
    let rc = Tensor::new(&[-2.5f64, -2.0, -3.0], &dev).unwrap();
    let rr = Tensor::new(&[-2.2f64, -2.0, -5.0], &dev).unwrap();
    for (beta, eps) in [(0.5, 0.0), (0.1, 0.2)] {
        let cfg = DpoConfig {
            beta,
            label_smoothing: eps,
        };
        let loss = dpo_loss(pc.as_tensor(), pr.as_tensor(), &rc, &rr, &cfg).unwrap();
        let g = loss.backward().unwrap();
        let (pcv, prv) = (pc.to_vec1::<f64>().unwrap(), pr.to_vec1::<f64>().unwrap());
        let (rcv, rrv) = (rc.to_vec1::<f64>().unwrap(), rr.to_vec1::<f64>().unwrap());
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let mut want = 0.0;
        let mut dpc = Vec::new();
        for i in 0..3 {
            let z = beta * ((pcv[i] - rcv[i]) - (prv[i] - rrv[i]));
            want += -(1.0 - eps) * sig(z).ln() - eps * sig(-z).ln();
            // d/dz of -(1-eps) log s(z) - eps log s(-z) = -(1-eps)(1-s(z)) + eps s(z)
            dpc.push((-(1.0 - eps) * (1.0 - sig(z)) + eps * sig(z)) * beta / 3.0);
        }
        want /= 3.0;
        let got = loss.to_scalar::<f64>().unwrap();
        assert!((got - want).abs() < 1e-14, "beta {beta}: {got} vs {want}");
        let gpc = g.get(pc.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        let gpr = g.get(pr.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        for i in 0..3 {
            assert!((gpc[i] - dpc[i]).abs() < 1e-14, "{} vs {}", gpc[i], dpc[i]);
            assert!((gpr[i] + dpc[i]).abs() < 1e-14, "{} vs {}", gpr[i], -dpc[i]);
        }
        println!("beta {beta}, eps {eps}: DPO loss {got:.12} and gradients equal the closed form");
    }
    let bad = DpoConfig {
        beta: 0.0,
        ..Default::default()
    };
    let model = Gpt::new(&GptConfig::tiny(), &opts(1)).unwrap();
    let e = DpoObjective::new(&model, bad).unwrap_err().to_string();
    assert!(e.contains("dpo.beta"), "{e}");
}

#[test]
fn sequence_log_probs_equal_an_f64_log_softmax() {
    let cfg = GptConfig::tiny();
    let model = Gpt::new(
        &cfg,
        &opts(2)
            .with_param_dtype(DType::F64)
            .with_compute_dtype(DType::F64),
    )
    .unwrap();
    let pairs = last_word_pairs(3, 16, 4, 1).unwrap();
    let refs: Vec<&PreferencePair> = pairs.iter().collect();
    let b = preference_batch(&refs, CTX, &Device::Cpu).unwrap();
    let got = model_log_probs(&model, &b.inputs, &b.targets).unwrap();
    let logits = model.forward(&b.inputs).unwrap();
    let (rows, t, v) = logits.dims3().unwrap();
    let l: Vec<f64> = logits.flatten_all().unwrap().to_vec1().unwrap();
    let y: Vec<u32> = b.targets.flatten_all().unwrap().to_vec1().unwrap();
    for r in 0..rows {
        let mut want = 0.0f64;
        for j in 0..t {
            let tgt = y[r * t + j];
            if tgt == IGNORE_INDEX {
                continue;
            }
            let row = &l[(r * t + j) * v..(r * t + j + 1) * v];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            want += row[tgt as usize] - lse;
        }
        assert!(
            (f64::from(got[r]) - want).abs() < 1e-5 * want.abs(),
            "row {r}: {} vs {want}",
            got[r]
        );
    }
}

/// Trains with DPO for `steps` steps on `dp` thread ranks (4 pairs per rank per step) and
/// returns, per rank, held-out statistics before and after and the first and last training
/// statistics.
fn dpo_run(
    cfg: &GptConfig,
    steps: u64,
    dp: usize,
    lr: f32,
) -> (DpoStats, DpoStats, DpoStats, DpoStats) {
    let train = last_word_pairs(2048, 16, 4, 10).unwrap();
    let held_out = last_word_pairs(256, 16, 4, 20).unwrap();
    let outs = run_ranks(dp, |comm: ThreadComm| {
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let mut reference = Gpt::new(cfg, &opts(1))?;
        reference.freeze(|_| true);
        let policy = Gpt::new(cfg, &opts(1))?;
        let dpo = DpoObjective::new(&policy, DpoConfig::default())?;
        let hrefs: Vec<&PreferencePair> = held_out.iter().collect();
        let hb = preference_batch(&hrefs, CTX, &Device::Cpu)?;
        let h_ref = model_log_probs(&reference, &hb.inputs, &hb.targets)?;
        let evaluate = |_: &Gpt| -> anyhow::Result<DpoStats> { Ok(dpo.evaluate(&hb, &h_ref)?) };
        let before = evaluate(&policy)?;
        let dpc = DataParallelConfig {
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let mut engine = DataParallel::new(&policy.segment_param_lists(), &*world, dpc)?
            .with_param_splits(&policy.param_splits())?;
        let mut loader = ExampleLoader::new(train.len(), dp, world.rank(), 8 / dp, 3)?;
        let (mut first, mut last) = (DpoStats::default(), DpoStats::default());
        for s in 0..steps {
            let idx = loader.next_indices()?;
            let refs: Vec<&PreferencePair> = idx.iter().map(|&i| &train[i]).collect();
            let b = preference_batch(&refs, CTX, &Device::Cpu)?;
            let ref_lp = model_log_probs(&reference, &b.inputs, &b.targets)?;
            let mb = DpoObjective::micro_batch(&b, &ref_lp)?;
            engine.step(&dpo, &[mb], lr, &mut NoScaler)?;
            let st = dpo.take_stats().all_reduce(&*world)?;
            if s == 0 {
                first = st;
            }
            last = st;
        }
        let after = evaluate(&policy)?;
        Ok((before, after, first, last))
    });
    outs[0]
}

#[test]
fn dpo_raises_preference_accuracy_in_100_steps() {
    dpo_learns(&GptConfig::tiny(), 100, 3e-3);
}

#[test]
fn dpo_on_a_llama_raises_preference_accuracy_in_200_steps() {
    // the tiny Llama needs a lower rate than the tiny GPT on this set: at 3e-3 it stalls near
    // 60% (margin 0.1); at 1e-3 it is at 78% after 100 steps and 94.5% after 200
    dpo_learns(&GptConfig::llama_tiny(), 200, 1e-3);
}

/// `steps` DPO steps at dp = 2: held-out reward and policy accuracy from a tie to over 90%.
fn dpo_learns(cfg: &GptConfig, steps: u64, lr: f32) {
    let (before, after, first, last) = dpo_run(cfg, steps, 2, lr);
    println!(
        "{}: DPO, {steps} steps at dp=2, 256 held-out pairs: reward accuracy {:.1}% -> {:.1}%, policy \
         accuracy {:.1}% -> {:.1}%, margin {:.3} -> {:.3}; training loss {:.4} -> {:.4}",
        cfg.describe(),
        100.0 * before.reward_accuracy(),
        100.0 * after.reward_accuracy(),
        100.0 * before.policy_accuracy(),
        100.0 * after.policy_accuracy(),
        before.margin(),
        after.margin(),
        first.mean_loss(),
        last.mean_loss()
    );
    // the policy starts as the reference: every margin 0, a tie, 50%
    assert_eq!(before.reward_accuracy(), 0.5);
    assert!(
        (0.35..0.65).contains(&before.policy_accuracy()),
        "{before:?}"
    );
    assert!((first.mean_loss() - 2f64.ln()).abs() < 1e-6, "{first:?}");
    assert!(after.reward_accuracy() > 0.9, "{after:?}");
    assert!(after.policy_accuracy() > 0.9, "{after:?}");
    assert!(after.margin() > 0.1, "{after:?}");
}

#[test]
fn dpo_under_tensor_parallelism_equals_tp1() {
    dpo_tp_equals_tp1(&GptConfig::tiny());
    dpo_tp_equals_tp1(&GptConfig::llama_tiny());
}

/// DPO's loss, logits and every gradient at tp = 2 (with recomputation) within 1e-5 of tp = 1.
fn dpo_tp_equals_tp1(cfg: &GptConfig) {
    let pairs = last_word_pairs(4, 16, 4, 7).unwrap();
    let refs: Vec<&PreferencePair> = pairs.iter().collect();
    let b = preference_batch(&refs, CTX, &Device::Cpu).unwrap();
    // a reference that differs from the policy, so the margins are not zero
    let reference = Gpt::new(cfg, &opts(8)).unwrap();
    let ref_lp = model_log_probs(&reference, &b.inputs, &b.targets).unwrap();
    let mb = DpoObjective::micro_batch(&b, &ref_lp).unwrap();
    let run = |model: &Gpt| -> anyhow::Result<Run> {
        let dpo = DpoObjective::new(model, DpoConfig::default())?;
        let mut grads = kiln_memory::CollectGrads::default();
        let mut provider = kiln_memory::StaticParams::new(
            model
                .segment_param_lists()
                .into_iter()
                .map(kiln_memory::SegmentParams::new)
                .collect(),
        );
        let out = kiln_memory::Executor::new(kiln_memory::RecomputePolicy::EveryBlock).run(
            &dpo,
            &mb,
            &mut provider,
            &mut grads,
            1.0,
        )?;
        let g = grads
            .into_grads()
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        let logits = model.forward(&b.inputs)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((out.loss.to_scalar::<f32>()?, g, logits))
    };
    let dense = Gpt::new(cfg, &opts(4)).unwrap();
    let (loss1, grads1, logits1) = run(&dense).unwrap();
    let splits: std::collections::HashMap<_, _> = dense.param_splits().into_iter().collect();
    let shapes: std::collections::HashMap<String, Vec<usize>> = dense
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.dims().to_vec()))
        .collect();
    run_ranks(2, |comm: ThreadComm| {
        let tp: Arc<dyn Communicator> = Arc::new(comm);
        let model = Gpt::tensor_parallel(cfg, &opts(4), tp.clone())?;
        let (loss, grads, logits) = run(&model)?;
        assert!(
            (loss - loss1).abs() <= 1e-5 * loss1.abs(),
            "{loss} vs {loss1}"
        );
        assert_close(&logits, &logits1, 1e-5, 1e-5);
        let want: std::collections::HashMap<_, _> = grads1.iter().cloned().collect();
        for (n, g) in &grads {
            let full = Tensor::from_vec(want[n].clone(), shapes[n].as_slice(), &Device::Cpu)?;
            let shard: Vec<f32> = splits[n]
                .shard(&full, 2, tp.rank())?
                .flatten_all()?
                .to_vec1()?;
            assert_close(g, &shard, 1e-5, 1e-5);
        }
        Ok(())
    });
    println!(
        "{}: DPO at tp=2 with activation recompute: loss {loss1} and every gradient as tp=1",
        cfg.describe()
    );
}

#[test]
fn dpo_resumes_bitwise() {
    let cfg = GptConfig::tiny();
    let train = last_word_pairs(256, 16, 4, 10).unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-dpo-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |steps: u64, save_at: Option<u64>, resume: bool| -> Vec<f32> {
        let out = run_ranks(2, |comm: ThreadComm| {
            let world: Arc<dyn Communicator> = Arc::new(comm);
            let mut reference = Gpt::new(&cfg, &opts(1))?;
            reference.freeze(|_| true);
            let policy = Gpt::new(&cfg, &opts(1))?;
            let dpo = DpoObjective::new(&policy, DpoConfig::default())?;
            let dpc = DataParallelConfig {
                stage: ZeroStage::Zero1,
                ..Default::default()
            };
            let mut engine = DataParallel::new(&policy.segment_param_lists(), &*world, dpc)?
                .with_param_splits(&policy.param_splits())?;
            let mut loader = ExampleLoader::new(train.len(), 2, world.rank(), 2, 3)?;
            let mut step = kiln_ckpt::Step(0);
            let layout = Layout::new(2, 1, ZeroStage::Zero1)?;
            let storage = Arc::new(LocalFs::new(dir.clone())?);
            let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(layout, "dpo"))?;
            if resume {
                let req = ReshardRequest::new(layout).component("engine", &engine);
                let l = ckpt.load_latest_resharded(&*world, &req)?.loaded.unwrap();
                l.state.restore_all(
                    &mut [
                        ("engine", &mut engine),
                        ("loader", &mut loader),
                        ("step", &mut step),
                    ],
                    LoadOptions::default(),
                )?;
            }
            while step.0 < steps {
                let idx = loader.next_indices()?;
                let refs: Vec<&PreferencePair> = idx.iter().map(|&i| &train[i]).collect();
                let b = preference_batch(&refs, CTX, &Device::Cpu)?;
                let ref_lp = model_log_probs(&reference, &b.inputs, &b.targets)?;
                let mb = DpoObjective::micro_batch(&b, &ref_lp)?;
                engine.step(&dpo, &[mb], 3e-3, &mut NoScaler)?;
                step.0 += 1;
                if save_at == Some(step.0) {
                    let st = RankState::capture_all(&[
                        ("engine", &engine as &dyn Stateful),
                        ("loader", &loader),
                        ("step", &step),
                    ])?;
                    ckpt.save(&*world, step.0, &st)?;
                }
            }
            Ok(engine
                .full_params()?
                .into_iter()
                .flat_map(|(_, v)| v)
                .collect::<Vec<f32>>())
        });
        out.into_iter().next().unwrap()
    };
    let straight = run(6, Some(3), false);
    let resumed = run(6, None, true);
    assert!(straight
        .iter()
        .zip(&resumed)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    println!("DPO at dp=2 ZeRO-1 resumed from step 3 of 6: bitwise the uninterrupted run");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_reward_model_learns_the_preference() {
    reward_model_learns(&GptConfig::tiny());
}

#[test]
fn a_llama_reward_model_learns_the_preference() {
    reward_model_learns(&GptConfig::llama_tiny());
}

/// 100 Bradley-Terry steps at dp = 2: held-out accuracy from chance to over 90%.
fn reward_model_learns(cfg: &GptConfig) {
    let train = last_word_pairs(2048, 16, 4, 30).unwrap();
    let held_out = last_word_pairs(256, 16, 4, 40).unwrap();
    let hrefs: Vec<&PreferencePair> = held_out.iter().collect();
    let hb = preference_batch(&hrefs, CTX, &Device::Cpu).unwrap();
    let outs = run_ranks(2, |comm: ThreadComm| {
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let rm = RewardModel::new(Gpt::new(cfg, &opts(1))?, 1)?;
        let before = rm.evaluate(&hb)?;
        let dpc = DataParallelConfig {
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let mut engine = DataParallel::new(&rm.segment_param_lists(), &*world, dpc)?
            .with_param_splits(&rm.param_splits())?;
        let mut loader = ExampleLoader::new(train.len(), 2, world.rank(), 8, 3)?;
        let mut last = None;
        for _ in 0..100 {
            let idx = loader.next_indices()?;
            let refs: Vec<&PreferencePair> = idx.iter().map(|&i| &train[i]).collect();
            let b = preference_batch(&refs, CTX, &Device::Cpu)?;
            let mb = RewardModel::micro_batch(&b)?;
            engine.step(&rm, &[mb], 1e-3, &mut NoScaler)?;
            last = Some(rm.take_stats().all_reduce(&*world)?);
        }
        let after = rm.evaluate(&hb)?;
        Ok((before, after, last.unwrap()))
    });
    let (before, after, last) = outs[0];
    println!(
        "{}: reward model, 100 steps at dp=2, 256 held-out pairs: accuracy {:.1}% -> {:.1}%, \
         Bradley-Terry loss {:.4} -> {:.4} (last training batch {:.4})",
        cfg.describe(),
        100.0 * before.accuracy(),
        100.0 * after.accuracy(),
        before.mean_loss(),
        after.mean_loss(),
        last.mean_loss()
    );
    assert!((0.3..0.7).contains(&before.accuracy()), "{before:?}");
    assert!(after.accuracy() > 0.9, "{after:?}");
}

/// The objectives read their per-example tensors by name: a micro-batch without the
/// reference's log-probabilities (DPO) or the last positions (reward model) is an error naming
/// the missing tensor, and one of the wrong shape an error naming the expected shape.
#[test]
fn a_missing_or_misshapen_named_tensor_is_an_error_naming_it() {
    let cfg = GptConfig::tiny();
    let pairs = last_word_pairs(2, 16, 4, 7).unwrap();
    let refs: Vec<&PreferencePair> = pairs.iter().collect();
    let b = preference_batch(&refs, CTX, &Device::Cpu).unwrap();
    let policy = Gpt::new(&cfg, &opts(7)).unwrap();
    let run = |model: &dyn kiln_memory::SegmentedModel, mb: &kiln_memory::MicroBatch| {
        let mut provider = kiln_memory::StaticParams::new(
            policy
                .segment_param_lists()
                .into_iter()
                .map(kiln_memory::SegmentParams::new)
                .collect(),
        );
        kiln_memory::Executor::default()
            .run(
                model,
                mb,
                &mut provider,
                &mut kiln_memory::CollectGrads::default(),
                1.0,
            )
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let bare = kiln_memory::MicroBatch::new(b.inputs.clone(), b.targets.clone()).unwrap();
    let dpo = DpoObjective::new(&policy, DpoConfig::default()).unwrap();
    let e = run(&dpo, &bare);
    assert!(
        e.contains("`reference_log_probs`") && e.contains("only inputs, targets"),
        "{e}"
    );
    let rows = b.inputs.dim(0).unwrap();
    let wrong = bare
        .clone()
        .with(
            kiln_tune::REFERENCE_LOG_PROBS,
            Tensor::zeros(rows, DType::F64, &Device::Cpu).unwrap(),
        )
        .unwrap();
    let e = run(&dpo, &wrong);
    assert!(
        e.contains("reference_log_probs") && e.contains("f32"),
        "{e}"
    );
    let rm = RewardModel::new(Gpt::new(&cfg, &opts(7)).unwrap(), 1).unwrap();
    let mut provider = kiln_memory::StaticParams::new(
        rm.segment_param_lists()
            .into_iter()
            .map(kiln_memory::SegmentParams::new)
            .collect(),
    );
    let e = kiln_memory::Executor::default()
        .run(
            &rm,
            &bare,
            &mut provider,
            &mut kiln_memory::CollectGrads::default(),
            1.0,
        )
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`last_positions`"), "{e}");
}
