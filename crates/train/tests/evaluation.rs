//! Evaluation and weight access under every data-parallel layout: the validation loss after 4
//! steps is bitwise the same under plain data parallelism and ZeRO-3 (whose model variables
//! hold no trained weights until `materialize_weights` gathers them), and equals the one-rank
//! run's to rounding.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_params_bitwise, test_dir, tiny_config};
use kiln_train::{run_threads_with, RunConfig, Trainer};

type Params = Vec<(String, Vec<f32>)>;

/// Trains 4 steps; returns the validation loss, the dense parameters and the model's own
/// variables before and after `materialize_weights` (rank 0).
fn eval_after_4(cfg: &RunConfig) -> (f64, Params, Params, Params) {
    let mut out = run_threads_with(cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        for _ in 0..4 {
            t.train_step()?;
        }
        let v = t.evaluate()?.expect("validation data");
        let vars = |t: &Trainer| -> Params {
            t.model()
                .named_parameters()
                .into_iter()
                .map(|(n, v)| (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                .collect()
        };
        let before = vars(&t);
        t.materialize_weights()?;
        let after = vars(&t);
        let mut dense = t.dense_parameters()?;
        // named_parameters order: sort both by name
        dense.sort_by(|a, b| a.0.cmp(&b.0));
        Ok((v, dense, before, after))
    })
    .unwrap();
    let (v, dense, mut before, mut after) = out.swap_remove(0);
    before.sort_by(|a, b| a.0.cmp(&b.0));
    after.sort_by(|a, b| a.0.cmp(&b.0));
    (v, dense, before, after)
}

#[test]
fn validation_loss_is_the_same_under_every_stage() {
    let root = test_dir("evaluation");
    let base = |dp: usize, zero: u8| {
        let mut c = tiny_config("evaluation", &root, "shakespeare_200k", 200_000);
        c.parallel.dp = dp;
        c.parallel.zero = kiln_state::ZeroStage::from_number(zero).unwrap();
        c.train.micro_batch = 4 / dp;
        c.train.accumulation = 1; // ZeRO-2/3 reduce every micro-batch: bitwise only without
        c.train.steps = 4;
        c.optim.schedule.warmup_steps = 2;
        c.eval.batches = 3;
        c
    };
    let (plain, p_plain, _, _) = eval_after_4(&base(2, 0));
    let (zero3, p_zero3, before, after) = eval_after_4(&base(2, 3));
    let (one, _, _, _) = eval_after_4(&base(1, 0));
    println!("validation loss after 4 steps: dp=2 {plain}, dp=2 ZeRO-3 {zero3}, dp=1 {one}");
    assert_eq!(plain.to_bits(), zero3.to_bits());
    assert!((plain - one).abs() <= 1e-6 * one, "{plain} vs {one}");
    assert!(plain < 512f64.ln(), "the model learned something: {plain}");
    assert_params_bitwise(&p_zero3, &p_plain);
    // ZeRO-3: the model's variables are stale until materialized, then the trained weights
    assert!(before.iter().zip(&p_zero3).any(|(a, b)| a.1 != b.1));
    assert_params_bitwise(&after, &p_zero3);
}
