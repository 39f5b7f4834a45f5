//! LoRA against the model it adapts: the base at initialisation, merged against unmerged,
//! frozen parameters that never move (and hold no gradient or optimizer state, as kiln-memory's
//! estimate says), adapter-only checkpoints that resume bitwise, the adapter file read back at
//! another tensor-parallel degree and by Python's `safetensors`, tensor parallel against
//! tp = 1, and dropout that a recomputed forward draws again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{batch, flat, python_json};

use candle_core::{Device, Tensor};
use kiln_ckpt::{CheckpointConfig, Checkpointer, Layout, LoadOptions, LocalFs, RankState};
use kiln_ckpt::{ReshardRequest, Stateful};
use kiln_comm::{Communicator, ThreadComm};
use kiln_memory::{MemPrecision, MemoryPlan, MicroBatch, RecomputePolicy, ZeroStage};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::{DataParallel, DataParallelConfig};
use kiln_precision::NoScaler;
use kiln_testkit::{assert_close, run_ranks};
use kiln_tune::{is_adapter_param, lora_gpt, LoraConfig, LoraTarget};
use std::sync::Arc;

fn all_targets(rank: usize) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        dropout: 0.0,
        targets: LoraTarget::ALL.to_vec(),
    }
}

/// Gives every adapter B (and A) deterministic non-zero values, so the adapters change the
/// output.
fn perturb(lora: &kiln_tune::Lora, seed: u32) {
    for (i, (_, v)) in lora.parameters().iter().enumerate() {
        let n = v.elem_count();
        let vals: Vec<f32> = (0..n)
            .map(|j| {
                let h = (j as u32 ^ (i as u32 * 0x9E37 + seed)).wrapping_mul(2654435761);
                (h >> 8) as f32 / (1u32 << 24) as f32 * 0.1 - 0.05
            })
            .collect();
        v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap())
            .unwrap();
    }
}

#[test]
fn at_initialisation_the_adapted_model_is_its_base_bitwise() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(11);
    let (model, lora) = lora_gpt(&cfg, &opts, &all_targets(4), None).unwrap();
    let base = Gpt::new(&cfg, &opts).unwrap();
    let (x, _) = batch(2, 16, cfg.vocab_size, 0);
    let a = flat(&model.forward(&x).unwrap());
    let b = flat(&base.forward(&x).unwrap());
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    // the base weights are the dense model's, the adapters the only trainable tensors
    assert_eq!(lora.num_layers(), 2 * 4);
    for (n, v) in base.named_parameters() {
        let got = model.parameter(&n).unwrap();
        assert_eq!(flat(got.as_tensor()), flat(v.as_tensor()), "{n}");
        assert!(model.is_frozen(&n), "{n} should be frozen");
    }
    let trainable: Vec<String> = model
        .trainable_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(trainable.iter().all(|n| is_adapter_param(n)));
    // per block: q, k, v and o with A [4, 128] and B [128, 4]; fc1 B [512, 4]; fc2 A [4, 512]
    let per_block = 4 * (4 * 128 + 128 * 4) + (4 * 128 + 512 * 4) + (4 * 512 + 128 * 4);
    assert_eq!(model.num_trainable_parameters(), 2 * per_block);
    println!(
        "LoRA r=4 on every projection: {} trainable of {} parameters, logits bitwise the base's",
        model.num_trainable_parameters(),
        model.num_parameters()
    );
}

#[test]
fn merged_equals_unmerged_and_unmerge_restores_the_base() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(5);
    let (model, lora) = lora_gpt(&cfg, &opts, &all_targets(4), None).unwrap();
    let base_before: Vec<(String, Vec<f32>)> = model
        .named_parameters()
        .into_iter()
        .filter(|(n, _)| !is_adapter_param(n))
        .map(|(n, v)| (n, flat(v.as_tensor())))
        .collect();
    perturb(&lora, 1);
    let (x, _) = batch(2, 16, cfg.vocab_size, 3);
    let unmerged = flat(&model.forward(&x).unwrap());
    let base = Gpt::new(&cfg, &opts).unwrap();
    let moved = kiln_testkit::max_rel_diff(&unmerged, &flat(&base.forward(&x).unwrap()));
    assert!(
        moved > 1e-3,
        "the adapters should change the logits: {moved}"
    );
    lora.merge().unwrap();
    assert!(lora.merge().is_err(), "merging twice is an error");
    let merged = flat(&model.forward(&x).unwrap());
    assert_close(&merged, &unmerged, 1e-5, 1e-5);
    lora.unmerge().unwrap();
    let again = flat(&model.forward(&x).unwrap());
    assert_close(&again, &unmerged, 1e-5, 1e-5);
    for (n, before) in &base_before {
        let now = flat(model.parameter(n).unwrap().as_tensor());
        assert_close(&now, before, 1e-6, 0.0);
    }
    let worst = merged
        .iter()
        .zip(&unmerged)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!("merged vs unmerged logits: worst difference {worst:.1e} (bound 1e-5)");
}

fn engine_for(model: &Gpt, comm: &dyn Communicator, stage: ZeroStage) -> DataParallel {
    let dpc = DataParallelConfig {
        stage,
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    DataParallel::new(&model.segment_param_lists(), comm, dpc)
        .unwrap()
        .with_param_splits(&model.param_splits())
        .unwrap()
}

#[test]
fn frozen_parameters_never_move_and_hold_no_optimizer_state() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(2);
    let comm = ThreadComm::group(1, Default::default()).unwrap().remove(0);
    let (model, lora) = lora_gpt(&cfg, &opts, &all_targets(8), None).unwrap();
    let frozen_before: Vec<(String, Vec<f32>)> = model
        .named_parameters()
        .into_iter()
        .filter(|(n, _)| model.is_frozen(n))
        .map(|(n, v)| (n, flat(v.as_tensor())))
        .collect();
    let mut engine = engine_for(&model, &comm, ZeroStage::Replicated);
    let names: Vec<&str> = engine
        .layout()
        .params()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert!(names.iter().all(|n| is_adapter_param(n)), "{names:?}");
    let (x, y) = batch(4, 32, cfg.vocab_size, 1);
    let mut losses = Vec::new();
    for _ in 0..8 {
        let r = engine
            .step(
                &model,
                &[MicroBatch::new(x.clone(), y.clone()).unwrap()],
                1e-2,
                &mut NoScaler,
            )
            .unwrap();
        losses.push(r.loss);
    }
    assert!(
        losses[7] < losses[0] - 0.05,
        "the adapters should fit the batch: {losses:?}"
    );
    for (n, before) in &frozen_before {
        let now = flat(model.parameter(n).unwrap().as_tensor());
        assert_eq!(now.len(), before.len(), "frozen {n}: length");
        assert!(
            now.iter()
                .zip(before)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "frozen {n} moved"
        );
    }
    let moved = lora
        .parameters()
        .iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .all(|(_, v)| flat(v.as_tensor()).iter().any(|&b| b != 0.0));
    assert!(moved, "every B should have left zero");

    // memory: the engine against kiln-memory's estimate, for LoRA and for full fine-tuning
    let trainable = model.num_trainable_parameters() as u64;
    let frozen = (model.num_parameters() - model.num_trainable_parameters()) as u64;
    assert_eq!(frozen, cfg.param_count());
    let plan = MemoryPlan {
        shape: cfg.shape(),
        precision: MemPrecision::F32,
        stage: ZeroStage::Replicated,
        dp: 1,
        tp: 1,
        micro_batch: 4,
        recompute: RecomputePolicy::None,
        bucket_bytes: 25 << 20,
        sequence_parallel: false,
    };
    let est = plan.estimate_frozen(frozen, trainable).unwrap();
    let (w, g, o) = engine.model_state_bytes();
    let frozen_bytes: u64 = frozen_before.iter().map(|(_, v)| v.len() as u64 * 4).sum();
    assert_eq!(w + frozen_bytes, est.weights);
    assert_eq!(g, est.grads);
    assert_eq!(o, est.optimizer);
    let full_model = Gpt::new(&cfg, &opts).unwrap();
    let full = engine_for(&full_model, &comm, ZeroStage::Replicated);
    let (fw, fg, fo) = full.model_state_bytes();
    let full_est = plan.estimate().unwrap();
    assert_eq!(
        (fw, fg, fo),
        (full_est.weights, full_est.grads, full_est.optimizer)
    );
    let saving = (fw + fg + fo) as f64 / (w + frozen_bytes + g + o) as f64;
    // the figure the README and docs/post-training.md give, to their two decimals
    assert!(
        (saving - 3.59).abs() < 0.005,
        "LoRA r=8 on every projection of tiny: model states {saving:.4}x smaller than full \
         fine-tuning, the docs say 3.59x"
    );
    println!(
        "LoRA r=8: losses {:.4} -> {:.4}; model states {} B against {} B for full fine-tuning \
         ({saving:.2}x less), as estimated",
        losses[0],
        losses[7],
        w + frozen_bytes + g + o,
        fw + fg + fo
    );
}

#[test]
fn adapter_only_checkpoints_resume_bitwise() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(9);
    let dir = std::env::temp_dir().join(format!("kiln-lora-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |steps: u64, save_at: Option<u64>, resume: bool| -> Vec<(String, Vec<f32>)> {
        let out = run_ranks(2, |comm: ThreadComm| {
            let world: Arc<dyn Communicator> = Arc::new(comm);
            let (model, lora) = lora_gpt(&cfg, &opts, &all_targets(4), None)?;
            let mut engine = engine_for(&model, &*world, ZeroStage::Zero2);
            let layout = Layout::new(2, 1, ZeroStage::Zero2)?;
            let storage = Arc::new(LocalFs::new(dir.join("ckpt"))?);
            let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(layout, "tiny-lora"))?;
            let mut step = kiln_ckpt::Step(0);
            if resume {
                let req = ReshardRequest::new(layout).component("engine", &engine);
                let l = ckpt.load_latest_resharded(&*world, &req)?.loaded.unwrap();
                // the checkpoint holds the adapters and nothing of the frozen base
                let names: Vec<String> = l
                    .state
                    .part("engine")
                    .unwrap()
                    .names()
                    .map(String::from)
                    .collect();
                assert!(!names.is_empty());
                assert!(
                    names.iter().all(|n| n.contains("lora_")),
                    "a non-adapter tensor in the checkpoint: {names:?}"
                );
                l.state.restore_all(
                    &mut [("engine", &mut engine), ("step", &mut step)],
                    LoadOptions::default(),
                )?;
            }
            while step.0 < steps {
                let (x, y) = batch(4, 16, cfg.vocab_size, step.0 as usize);
                let r = world.rank();
                let xb = x.narrow(0, 2 * r, 2)?;
                let yb = y.narrow(0, 2 * r, 2)?;
                lora.set_step(step.0);
                engine.step(&model, &[MicroBatch::new(xb, yb)?], 5e-3, &mut NoScaler)?;
                step.0 += 1;
                if save_at == Some(step.0) {
                    let st = RankState::capture_all(&[
                        ("engine", &engine as &dyn Stateful),
                        ("step", &step),
                    ])?;
                    ckpt.save(&*world, step.0, &st)?;
                }
            }
            Ok(lora
                .parameters()
                .into_iter()
                .map(|(n, v)| (n, flat(v.as_tensor())))
                .collect::<Vec<_>>())
        });
        out.into_iter().next().unwrap()
    };
    let straight = run(6, Some(3), false);
    let resumed = run(6, None, true);
    assert_eq!(straight.len(), resumed.len(), "adapters after the resume");
    for ((n, a), (rn, b)) in straight.iter().zip(&resumed) {
        assert_eq!(n, rn);
        assert_eq!(a.len(), b.len(), "{n}: length");
        assert!(
            a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{n}: resumed differs"
        );
    }
    let files: u64 = walk(&dir.join("ckpt/step-00000003"));
    println!("adapter-only checkpoint: {files} bytes for dp=2 ZeRO-2; resume from step 3 bitwise");
    let _ = std::fs::remove_dir_all(&dir);
}

fn walk(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(&e.path())
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

#[test]
fn tensor_parallel_lora_equals_tp1_and_the_adapter_file_reshards() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(4);
    let lc = all_targets(4);
    let (x, y) = batch(2, 16, cfg.vocab_size, 5);
    let (dense, dense_lora) = lora_gpt(&cfg, &opts, &lc, None).unwrap();
    perturb(&dense_lora, 7);
    let want_logits = flat(&dense.forward(&x).unwrap());
    let loss = dense.loss(&x, &y).unwrap();
    let grads = loss.backward().unwrap();
    let dense_grads: Vec<(String, Tensor)> = dense_lora
        .parameters()
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).unwrap().clone()))
        .collect();
    let dir = std::env::temp_dir().join(format!("kiln-lora-adapter-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dense_lora.save_adapter(&dir).unwrap();
    run_ranks(2, |comm: ThreadComm| {
        let tp: Arc<dyn Communicator> = Arc::new(comm);
        let (model, lora) = lora_gpt(&cfg, &opts, &lc, Some(tp.clone()))?;
        // the tp = 1 adapter file, each rank taking its shard
        lora.load_adapter(&dir)?;
        let logits = flat(&model.forward(&x)?);
        assert_close(&logits, &want_logits, 1e-5, 1e-5);
        let loss = model.loss(&x, &y)?;
        let g = loss.backward()?;
        let (params, splits) = (lora.parameters(), lora.param_splits());
        assert_eq!(params.len(), splits.len());
        assert_eq!(params.len(), dense_grads.len());
        for (((n, v), (sn, split)), (dn, dg)) in params.iter().zip(splits).zip(&dense_grads) {
            assert_eq!(n, dn);
            assert_eq!(n, &sn);
            let want = flat(&split.shard(dg, 2, tp.rank())?);
            assert_close(&flat(g.get(v.as_tensor()).unwrap()), &want, 1e-5, 1e-5);
        }
        // gathered back whole, the adapters are the file's
        let whole = lora.adapter_tensors()?;
        let (_, ref_lora) = lora_gpt(&cfg, &opts, &lc, None)?;
        ref_lora.load_adapter(&dir)?;
        assert_eq!(whole.len(), ref_lora.parameters().len());
        for ((n, t), (_, v)) in whole.iter().zip(ref_lora.parameters()) {
            assert_eq!(t.to_vec::<f32>()?, flat(v.as_tensor()), "{n}");
        }
        Ok(())
    });
    // a wrong rank in the file is refused by name
    let (_, other) = lora_gpt(&cfg, &opts, &all_targets(2), None).unwrap();
    let e = other.load_adapter(&dir).unwrap_err().to_string();
    assert!(e.contains("rank: 2") && e.contains("rank: 4"), "{e}");
    python_reads_adapter(&dir, &dense_lora);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Python's `safetensors` reads the adapter file with the same names, shapes and values.
fn python_reads_adapter(dir: &std::path::Path, lora: &kiln_tune::Lora) {
    let script = r#"
import sys, json
from safetensors.numpy import load_file
t = load_file(sys.argv[1])
print(json.dumps({k: [list(v.shape), float(v.astype("float64").sum())] for k, v in t.items()}))
"#;
    let path = dir.join(kiln_tune::lora::ADAPTER_WEIGHTS_FILE);
    let Some(read) =
        python_json::<std::collections::BTreeMap<String, (Vec<usize>, f64)>>(script, &path)
    else {
        return;
    };
    assert_eq!(read.len(), lora.parameters().len());
    for (n, v) in lora.parameters() {
        let (shape, sum) = &read[&n];
        assert_eq!(shape, &v.dims().to_vec(), "{n}");
        let want: f64 = flat(v.as_tensor()).iter().map(|&x| x as f64).sum();
        assert!(
            (sum - want).abs() <= 1e-9 * want.abs().max(1.0),
            "{n}: {sum} vs {want}"
        );
    }
    println!("Python's safetensors read {} adapter tensors", read.len());
}

#[test]
fn dropout_masks_are_drawn_again_by_a_recomputed_forward() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(6);
    let lc = LoraConfig {
        dropout: 0.2,
        ..all_targets(4)
    };
    let comm = ThreadComm::group(1, Default::default()).unwrap().remove(0);
    let (x, y) = batch(2, 16, cfg.vocab_size, 2);
    let mut results = Vec::new();
    for policy in [RecomputePolicy::None, RecomputePolicy::EveryBlock] {
        let (model, lora) = lora_gpt(&cfg, &opts, &lc, None).unwrap();
        perturb(&lora, 3);
        lora.set_step(12);
        let dpc = DataParallelConfig {
            recompute: policy,
            ..Default::default()
        };
        let mut engine = DataParallel::new(&model.segment_param_lists(), &comm, dpc).unwrap();
        let r = engine
            .step(
                &model,
                &[MicroBatch::new(x.clone(), y.clone()).unwrap()],
                1e-2,
                &mut NoScaler,
            )
            .unwrap();
        let params: Vec<f32> = lora
            .parameters()
            .iter()
            .flat_map(|(_, v)| flat(v.as_tensor()))
            .collect();
        results.push((r.loss, r.grad_norm, params));
    }
    assert_eq!(results[0].0.to_bits(), results[1].0.to_bits());
    assert_eq!(results[0].1, results[1].1);
    assert_eq!(results[0].2.len(), results[1].2.len());
    assert!(results[0]
        .2
        .iter()
        .zip(&results[1].2)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    // and dropout is on: the loss differs from the run without it
    let (model, lora) = lora_gpt(&cfg, &opts, &all_targets(4), None).unwrap();
    perturb(&lora, 3);
    let plain = model.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_ne!(plain.to_bits(), results[0].0.to_bits());
    println!(
        "dropout 0.2: loss {} with and without activation recomputation (no dropout: {plain})",
        results[0].0
    );
}

#[test]
fn bad_configurations_name_the_field() {
    let cfg = GptConfig::tiny();
    let opts = GptOptions::seeded(1);
    for (lc, field) in [
        (
            LoraConfig {
                rank: 0,
                ..Default::default()
            },
            "lora.rank",
        ),
        (
            LoraConfig {
                dropout: 1.0,
                ..Default::default()
            },
            "lora.dropout",
        ),
        (
            LoraConfig {
                alpha: f64::NAN,
                ..Default::default()
            },
            "lora.alpha",
        ),
        (
            LoraConfig {
                targets: vec![LoraTarget::Q, LoraTarget::Q],
                ..Default::default()
            },
            "lora.targets",
        ),
    ] {
        let e = lora_gpt(&cfg, &opts, &lc, None).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
}

/// LoRA on every projection of the Llama layout (q, k and v of grouped-query attention, o,
/// the gate and up halves of the fused SwiGLU projection, down): the base at initialisation,
/// merged against unmerged, and tp = 2 against tp = 1.
#[test]
fn lora_on_llama_projections_equals_its_references() {
    let cfg = GptConfig::llama_tiny();
    let opts = GptOptions::seeded(9);
    let lc = LoraConfig {
        targets: vec![
            LoraTarget::Q,
            LoraTarget::K,
            LoraTarget::V,
            LoraTarget::O,
            LoraTarget::Gate,
            LoraTarget::Up,
            LoraTarget::Down,
        ],
        ..all_targets(4)
    };
    let (model, lora) = lora_gpt(&cfg, &opts, &lc, None).unwrap();
    let base = Gpt::new(&cfg, &opts).unwrap();
    let (x, y) = batch(2, 16, cfg.vocab_size, 2);
    let a = flat(&model.forward(&x).unwrap());
    assert_eq!(a, flat(&base.forward(&x).unwrap()), "at initialisation");
    // per block: q and o [128 -> 128], k and v [128 -> 64], the gate and up halves [128 -> 352],
    // down [352 -> 128]; A [4, in], B [out, 4]
    let ab = |i: usize, o: usize| 4 * i + o * 4;
    let per_block = ab(128, 128) + 2 * ab(128, 64) + ab(128, 128) + 2 * ab(128, 352) + ab(352, 128);
    assert_eq!(model.num_trainable_parameters(), 2 * per_block);
    perturb(&lora, 3);
    let unmerged = flat(&model.forward(&x).unwrap());
    assert!(kiln_testkit::max_rel_diff(&unmerged, &a) > 1e-3);
    lora.merge().unwrap();
    assert_close(&flat(&model.forward(&x).unwrap()), &unmerged, 1e-5, 1e-5);
    lora.unmerge().unwrap();
    let loss = model.loss(&x, &y).unwrap();
    let grads = loss.backward().unwrap();
    let dense_grads: Vec<(String, Tensor)> = lora
        .parameters()
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).unwrap().clone()))
        .collect();
    let dense_params: Vec<Vec<f32>> = lora
        .parameters()
        .iter()
        .map(|(_, v)| flat(v.as_tensor()))
        .collect();
    let dims: Vec<Vec<usize>> = lora
        .parameters()
        .iter()
        .map(|(_, v)| v.dims().to_vec())
        .collect();
    run_ranks(2, |comm: ThreadComm| {
        let tp: Arc<dyn Communicator> = Arc::new(comm);
        let (m, l) = lora_gpt(&cfg, &opts, &lc, Some(tp.clone()))?;
        // this rank's shard of the perturbed dense adapters
        for (((_, v), split), (vals, d)) in l
            .parameters()
            .iter()
            .zip(l.param_splits())
            .zip(dense_params.iter().zip(&dims))
        {
            let full = Tensor::from_vec(vals.clone(), d.as_slice(), &Device::Cpu)?;
            v.set(&split.1.shard(&full, 2, tp.rank())?)?;
        }
        assert_close(&flat(&m.forward(&x)?), &unmerged, 1e-5, 1e-5);
        let g = m.loss(&x, &y)?.backward()?;
        for (((n, v), (_, split)), (dn, dg)) in l
            .parameters()
            .iter()
            .zip(l.param_splits())
            .zip(&dense_grads)
        {
            assert_eq!(n, dn);
            let want = flat(&split.shard(dg, 2, tp.rank())?);
            assert_close(&flat(g.get(v.as_tensor()).unwrap()), &want, 1e-5, 1e-5);
        }
        Ok(())
    });
    // over 4 ranks the 2 key/value heads are replicated: adapters on them are refused by name
    let outs = run_ranks(4, |comm: ThreadComm| {
        let tp: Arc<dyn Communicator> = Arc::new(comm);
        Ok(lora_gpt(&cfg, &opts, &lc, Some(tp))
            .unwrap_err()
            .to_string())
    });
    assert!(
        outs[0].contains("h.0.attn.k_proj") && outs[0].contains("replicated"),
        "{}",
        outs[0]
    );
}
