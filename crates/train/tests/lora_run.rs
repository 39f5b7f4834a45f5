//! LoRA through the reference trainer (`RunConfig.model.lora`, set from the command-line form):
//! a run started from a trained checkpoint at dp=2 x tp=2 trains the adapters only (on every
//! rank, each rank's tensor-parallel shard of every base parameter stays bitwise the
//! checkpoint's tensor cut the same way), every rank file of every checkpoint holds the adapters
//! and no base parameter, and a resume continues bitwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::{Device, Tensor};
use common::{test_dir, tiny_config};
use kiln_parallel::tp::TpSplit;
use kiln_train::{run_threads_with, Pretrained, Trainer};
use std::collections::{BTreeSet, HashMap};

#[test]
fn a_lora_run_trains_the_adapters_only_and_resumes() {
    let root = test_dir("lora_run");
    // the base: 10 steps of plain training
    let mut base = tiny_config("lora_base", &root.join("base"), "shakespeare_200k", 200_000);
    base.train.steps = 10;
    base.checkpoint.every_steps = 10;
    run_threads_with(&base, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        t.finish()
    })
    .unwrap();
    let base_ckpt = base.checkpoint_dir();
    let pre = Pretrained::load(&base_ckpt).unwrap();

    let mut cfg = tiny_config("lora", &root.join("lora"), "shakespeare_200k", 200_000);
    cfg.apply_overrides(&[
        (
            "model.lora",
            r#"{"rank": 4, "alpha": 8, "targets": ["q", "v", "fc2"]}"#,
        ),
        ("dp", "2"),
        ("tp", "2"),
        ("steps", "8"),
    ])
    .unwrap();
    cfg.model.init_from = Some(base_ckpt.clone());
    cfg.train.micro_batch = 2;
    cfg.checkpoint.every_steps = 4;
    cfg.validate().unwrap();
    let lora = cfg.model.lora.clone().unwrap();
    assert_eq!(lora.rank, 4);
    // every rank: its adapters (whole, gathered over tp), and its shard of every frozen
    // parameter with the split and tp rank to cut the checkpoint's whole tensor the same way
    let run = |cfg: &kiln_train::RunConfig| {
        run_threads_with(cfg, |ctx| {
            let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
            while t.step() < ctx.config.train.steps {
                t.train_step()?;
            }
            let names: Vec<String> = t
                .engine()
                .layout()
                .params()
                .iter()
                .map(|p| p.name.clone())
                .collect();
            let dense = t.dense_parameters()?;
            let splits: HashMap<String, TpSplit> =
                t.model().all_param_splits().into_iter().collect();
            let frozen: Vec<Frozen> = t
                .model()
                .named_parameters()
                .into_iter()
                .filter(|(n, _)| t.model().is_frozen(n))
                .map(|(n, v)| Frozen {
                    split: splits[&n],
                    values: v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
                    name: n,
                })
                .collect();
            let dims = t.dims();
            let rank = RankRun {
                rank: t.rank(),
                tp_rank: dims.tp_rank(t.rank()),
                names,
                adapters: dense,
                frozen,
            };
            Ok((t.finish()?, rank))
        })
        .unwrap()
    };
    let ranks = run(&cfg);
    assert_eq!(ranks.len(), 4, "dp=2 x tp=2 ranks");
    let summary = &ranks[0].0;
    let names = &ranks[0].1.names;
    assert!(
        names.iter().all(|n| kiln_tune::is_adapter_param(n)),
        "{names:?}"
    );
    // q, v and fc2 of 2 blocks, an A and a B each
    assert_eq!(names.len(), 2 * 3 * 2);
    let l = &summary.losses;
    assert_eq!(l.len(), 8);
    // the base is the checkpoint's, bitwise, on every rank: each rank's tensor-parallel shard of
    // every base parameter against the checkpoint's whole tensor cut the same way
    let whole: HashMap<_, _> = pre.params.iter().cloned().collect();
    let base_names: BTreeSet<&String> = whole.keys().collect();
    let mut compared = 0;
    for (_, r) in &ranks {
        let frozen_names: BTreeSet<&String> = r.frozen.iter().map(|f| &f.name).collect();
        assert_eq!(
            frozen_names, base_names,
            "rank {}: the frozen parameters are the base's",
            r.rank
        );
        for f in &r.frozen {
            let w = &whole[&f.name];
            let full =
                Tensor::from_vec(w.to_vec::<f32>().unwrap(), w.shape(), &Device::Cpu).unwrap();
            let want: Vec<f32> = f
                .split
                .shard(&full, 2, r.tp_rank)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(
                f.values.len(),
                want.len(),
                "rank {} (tp rank {}): {} ({:?}) has {} values, its shard of the checkpoint's {}",
                r.rank,
                r.tp_rank,
                f.name,
                f.split,
                f.values.len(),
                want.len()
            );
            if let Some(i) = (0..want.len()).find(|&i| f.values[i].to_bits() != want[i].to_bits()) {
                panic!(
                    "rank {} (tp rank {}): {} ({:?}) moved: element {i} is {:e}, the checkpoint's {:e}",
                    r.rank, r.tp_rank, f.name, f.split, f.values[i], want[i]
                );
            }
            compared += 1;
        }
    }
    let split = ranks[0]
        .1
        .frozen
        .iter()
        .filter(|f| f.split != TpSplit::Replicated)
        .count();
    assert!(split > 0, "no tensor-parallel-split base parameter");
    assert_eq!(compared, 4 * base_names.len());

    // the checkpoints hold the adapters only: every rank file's engine part holds only adapter
    // tensors (ZeRO-1 gives each data-parallel rank its share of them: all of them over the
    // ranks), and no tensor of any part is a base parameter's
    let latest = kiln_ckpt::LATEST_FILE;
    assert!(cfg.checkpoint_dir().join(latest).is_file());
    for step in [4u64, 8] {
        let dir = cfg.checkpoint_dir().join(format!("step-{step:08}"));
        let mut saved = BTreeSet::new();
        for rank in 0..4 {
            let bytes = std::fs::read(dir.join(format!("rank-{rank:05}.safetensors")))
                .unwrap_or_else(|e| panic!("checkpoint {step} rank {rank}: {e}"));
            let state = kiln_ckpt::decode_rank_file(&bytes).unwrap();
            for (part, sd) in state.parts() {
                for (name, _) in sd.iter() {
                    let base = base_names
                        .iter()
                        .find(|b| name.split('/').any(|c| c == b.as_str()));
                    assert!(
                        base.is_none(),
                        "checkpoint {step} rank {rank}: {part}/{name} holds the base parameter {}",
                        base.unwrap()
                    );
                    if part == "engine" {
                        // `<param | exp_avg | exp_avg_sq>/<parameter>`
                        let param = name.split_once('/').map_or(name, |(_, p)| p);
                        assert!(
                            names.iter().any(|a| a == param),
                            "checkpoint {step} rank {rank}: engine/{name} is not an adapter's"
                        );
                        saved.insert(param.to_string());
                    }
                }
            }
        }
        let want: BTreeSet<String> = names.iter().cloned().collect();
        assert_eq!(
            saved, want,
            "checkpoint {step}: the adapters over the ranks"
        );
    }

    // a resume from step 4 continues bitwise
    let mut again = cfg.clone();
    again.checkpoint.resume = true;
    again.checkpoint.resume_step = Some(4);
    let resumed_ranks = run(&again);
    assert_eq!(resumed_ranks.len(), 4);
    let resumed = &resumed_ranks[0].0;
    assert_eq!(resumed.resumed_from, Some(4));
    let (adapters, adapters2) = (&ranks[0].1.adapters, &resumed_ranks[0].1.adapters);
    assert_eq!(
        adapters.len(),
        adapters2.len(),
        "adapter count after the resume"
    );
    for ((n, a), (n2, b)) in adapters.iter().zip(adapters2) {
        assert_eq!(n, n2);
        assert_eq!(a.len(), b.len(), "{n}: length");
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n}"
        );
    }
    assert_eq!(resumed.losses.len(), 4, "steps 5-8 after the resume");
    for ((s, a), (s2, b)) in l[4..].iter().zip(&resumed.losses) {
        assert_eq!(s, s2);
        assert_eq!(a.to_bits(), b.to_bits(), "step {s}");
    }
    println!(
        "LoRA through the trainer at dp=2 x tp=2: {} adapter tensors train; {} base tensors \
         ({split} of them tensor-parallel split) bitwise the checkpoint's on all 4 ranks; \
         checkpoints hold adapters only; losses {:?}; the resume from step 4 is bitwise",
        names.len(),
        base_names.len(),
        l
    );
}

/// One rank's shard of a frozen base parameter.
struct Frozen {
    name: String,
    split: TpSplit,
    values: Vec<f32>,
}

/// What one rank of the LoRA run holds at its end.
struct RankRun {
    rank: usize,
    tp_rank: usize,
    /// The engine's parameters (the adapters).
    names: Vec<String>,
    /// The adapters, whole.
    adapters: Vec<(String, Vec<f32>)>,
    frozen: Vec<Frozen>,
}
