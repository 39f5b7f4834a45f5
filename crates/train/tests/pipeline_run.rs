//! The trainer under pipeline parallelism (`tiny` with 4 blocks, 2 micro-batches of 4
//! sequences per step, f32): a pp = 2 run with 1F1B trains; its checkpoint of step 6 continues
//! at pp = 4 (ZB-H1) bitwise as the uninterrupted pp = 2 run (a split pipeline computes what
//! one stage does), and at pp = 1 (the unsplit engine, which sums the tied embedding's two
//! uses per micro-batch rather than per step) within the rounding that order brings. The
//! loaded parameters equal the saved ones bitwise. Bad pipeline settings are errors naming the
//! factor and the rule.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_params_bitwise, max_param_diff, test_dir, tiny_config};
use kiln_parallel::pipeline::ScheduleKind;
use kiln_train::{run_threads_with, RunConfig, TrainSummary, Trainer};
use std::collections::BTreeMap;

type Params = Vec<(String, Vec<f32>)>;

fn run(cfg: &RunConfig, stops: &[u64]) -> (TrainSummary, Params, BTreeMap<u64, Params>) {
    let mut out = run_threads_with(cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        let at_load = t.dense_parameters()?;
        let mut at = BTreeMap::new();
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
            if stops.contains(&t.step()) {
                at.insert(t.step(), t.dense_parameters()?);
            }
        }
        Ok((t.finish()?, at_load, at))
    })
    .unwrap();
    out.swap_remove(0)
}

/// By name: a pipeline lists the parameters in the model's order, the unsplit engine in its
/// layout's.
fn sorted(mut p: Params) -> Params {
    p.sort_by(|a, b| a.0.cmp(&b.0));
    p
}

fn config(root: &std::path::Path, pp: usize, kind: ScheduleKind) -> RunConfig {
    let mut c = tiny_config("pipeline", root, "shakespeare_200k", 200_000);
    c.model.n_layers = Some(4);
    c.parallel.pp = pp;
    c.parallel.pp_schedule = kind;
    c.train.micro_batch = 4;
    c.train.accumulation = 2;
    c.train.steps = 12;
    let kiln_optim::OptimizerConfig::AdamW(adamw) = &mut c.optim.optimizer else {
        panic!("the default optimizer is AdamW")
    };
    // as crates/train/tests/reshard.rs: rounding noise stays noise
    adamw.eps = 1e-3;
    c.checkpoint.keep_last = 0;
    c.checkpoint.async_save = false;
    c.metrics.jsonl = false;
    c.metrics.tensorboard = false;
    c.metrics.png = false;
    c
}

#[test]
fn a_pp2_checkpoint_continues_at_pp4_bitwise_and_at_pp1() {
    let root = test_dir("pipeline_run");
    let mut saved = config(&root, 2, ScheduleKind::OneFOneB);
    saved.checkpoint.every_steps = 6;
    saved.checkpoint.dir = Some(root.join("pp2"));
    let (reference, _, at) = run(&saved, &[6, 12]);
    let losses: Vec<f32> = reference.losses.iter().map(|(_, l)| *l).collect();
    assert_eq!(losses.len(), 12);
    assert!(
        losses[11] < losses[0] - 0.3,
        "the pp=2 run did not train: {losses:?}"
    );

    // pp = 4 with another schedule: bitwise
    let mut c = config(&root, 4, ScheduleKind::ZbH1);
    c.checkpoint.dir = Some(root.join("pp2"));
    c.checkpoint.resume_step = Some(6);
    let (s, loaded, end) = run(&c, &[12]);
    assert_params_bitwise(&loaded, &at[&6]);
    assert_eq!(s.resumed_from, Some(6));
    assert_eq!(s.losses.len(), 6);
    for ((sa, la), (sb, lb)) in reference.losses[6..].iter().zip(&s.losses) {
        assert_eq!(sa, sb);
        assert_eq!(la.to_bits(), lb.to_bits(), "pp=4: step {sa}: {lb} vs {la}");
    }
    assert_params_bitwise(&end[&12], &at[&12]);

    // pp = 1: the unsplit engine, to rounding
    let mut c = config(&root, 1, ScheduleKind::OneFOneB);
    c.checkpoint.dir = Some(root.join("pp2"));
    c.checkpoint.resume_step = Some(6);
    let (s, loaded, end) = run(&c, &[12]);
    assert_params_bitwise(&sorted(loaded), &sorted(at[&6].clone()));
    assert_eq!(s.resumed_from, Some(6));
    let mut worst = 0.0f64;
    for ((sa, la), (sb, lb)) in reference.losses[6..].iter().zip(&s.losses) {
        assert_eq!(sa, sb);
        let rel = (*la as f64 - *lb as f64).abs() / (*la as f64).abs();
        worst = worst.max(rel);
    }
    let (abs, name, _) = max_param_diff(&sorted(end[&12].clone()), &sorted(at[&12].clone()));
    println!(
        "pp=2 -> pp=4 (zb_h1): steps 7-12 bitwise; pp=2 -> pp=1: losses within {worst:.2e} \
         relative, parameters at step 12 within {abs:.2e} (worst {name})"
    );
    assert!(worst <= 1e-6, "pp=1 losses differ by {worst:e}");
    assert!(abs <= 1e-6, "pp=1 parameters differ by {abs:e} ({name})");
}

#[test]
fn bad_pipeline_settings_name_the_factor_and_the_rule() {
    let root = test_dir("pipeline_bad");
    let err = |f: &dyn Fn(&mut RunConfig)| {
        let mut c = config(&root, 2, ScheduleKind::OneFOneB);
        f(&mut c);
        c.validate().unwrap_err().to_string()
    };
    let e = err(&|c| c.parallel.pp = 5);
    assert!(
        e.contains("pipeline_parallel_degree (5) must not exceed n_layers (4)"),
        "{e}"
    );
    let e = err(&|c| {
        c.parallel.pp_schedule = ScheduleKind::GPipe;
        c.parallel.virtual_stages = 2;
    });
    assert!(e.contains("virtual"), "{e}");
    assert!(e.contains("gpipe"), "{e}");
    let e = err(&|c| {
        c.parallel.pp_schedule = ScheduleKind::Interleaved;
        c.parallel.virtual_stages = 2;
        c.train.accumulation = 3;
    });
    assert!(e.contains("micro"), "{e}");
    let e = err(&|c| {
        c.model.n_layers = Some(6);
        c.parallel.pp_schedule = ScheduleKind::Interleaved;
        c.parallel.virtual_stages = 2;
    });
    assert!(
        e.contains("pp (2) x virtual_stages (2) = 4 must divide the model's n_layers (6)"),
        "{e}"
    );
    let e = err(&|c| c.parallel.zero = kiln_state::ZeroStage::Zero3);
    assert!(e.contains("ZeRO stages 0 to 2"), "{e}");
    let e = err(&|c| c.parallel.virtual_stages = 0);
    assert!(e.contains("parallel.virtual_stages"), "{e}");
    let e = err(&|c| {
        c.parallel.pp = 1;
        c.parallel.virtual_stages = 2;
    });
    assert!(e.contains("need a pipeline"), "{e}");
    println!("errors checked");
}
