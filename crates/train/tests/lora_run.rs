//! LoRA through the reference trainer (`RunConfig.model.lora`, set from the command-line form):
//! a run started from a trained checkpoint at dp=2 x tp=2 trains the adapters only (every base
//! parameter stays bitwise the checkpoint's), checkpoints hold the adapters alone, and a
//! resume continues bitwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{test_dir, tiny_config};
use kiln_train::{run_threads_with, Pretrained, Trainer};

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
            let frozen: Vec<(String, Vec<f32>)> = t
                .model()
                .named_parameters()
                .into_iter()
                .filter(|(n, _)| t.model().is_frozen(n))
                .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
                .collect();
            Ok((t.finish()?, names, dense, frozen))
        })
        .unwrap()
        .swap_remove(0)
    };
    let (summary, names, adapters, frozen) = run(&cfg);
    assert!(
        names.iter().all(|n| kiln_tune::is_adapter_param(n)),
        "{names:?}"
    );
    // q, v and fc2 of 2 blocks, an A and a B each
    assert_eq!(names.len(), 2 * 3 * 2);
    let l = &summary.losses;
    assert_eq!(l.len(), 8);
    // the base is the checkpoint's, bitwise, on rank 0 (tp shard 0 of split parameters)
    let whole: std::collections::HashMap<_, _> = pre.params.iter().cloned().collect();
    let mut compared = 0;
    for (n, v) in &frozen {
        let w: Vec<f32> = whole[n].to_vec().unwrap();
        if w.len() == v.len() {
            assert!(
                w.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{n} moved"
            );
            compared += 1;
        }
    }
    assert!(compared > 10, "{compared}");
    // the checkpoints hold the adapters only; a resume from step 4 continues bitwise
    let latest = kiln_ckpt::LATEST_FILE;
    assert!(cfg.checkpoint_dir().join(latest).is_file());
    let mut again = cfg.clone();
    again.checkpoint.resume = true;
    again.checkpoint.resume_step = Some(4);
    let (resumed, _, adapters2, _) = run(&again);
    assert_eq!(resumed.resumed_from, Some(4));
    for ((n, a), (_, b)) in adapters.iter().zip(&adapters2) {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n}"
        );
    }
    for ((s, a), (_, b)) in l[4..].iter().zip(&resumed.losses) {
        assert_eq!(a.to_bits(), b.to_bits(), "step {s}");
    }
    println!(
        "LoRA through the trainer at dp=2 x tp=2: {} adapter tensors train, losses {:?}; the \
         resume from step 4 is bitwise",
        names.len(),
        l
    );
}
