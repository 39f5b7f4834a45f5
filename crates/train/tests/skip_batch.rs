//! A detector's verdict judged before the update: a user detector (replacing the configured
//! ones through the builder) reports a gradient-norm spike at step 5, the breaker answers
//! "skip the batch", and the step leaves every parameter and the optimizer untouched
//! (bitwise), does not advance the learning-rate schedule, and is counted as skipped.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_params_bitwise, test_dir, tiny_config};
use kiln_monitor::{Detector, DetectorSet, Metric, StepMetrics, Verdict};
use kiln_train::{run_threads_with, Trainer};
use std::collections::BTreeMap;

/// Reports a gradient-norm spike at one step.
struct SpikeAt(u64);

impl Detector for SpikeAt {
    fn name(&self) -> &'static str {
        "spike_at"
    }

    fn observe(&mut self, m: &StepMetrics) -> Option<Verdict> {
        (m.step == self.0).then(|| Verdict::Spike {
            metric: Metric::GradNorm,
            value: m.grad_norm.unwrap_or(0.0),
            median: 0.0,
            robust_sd: 0.0,
            threshold: 0.0,
        })
    }
}

#[test]
fn a_skipped_batch_changes_nothing() {
    let root = test_dir("skip_batch");
    let mut cfg = tiny_config("skip_batch", &root, "shakespeare_200k", 200_000);
    cfg.apply_overrides(&[("dp", "2"), ("zero", "2"), ("steps", "7")])
        .unwrap();
    let out = run_threads_with(&cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone())
            .detectors(DetectorSet::new().with(SpikeAt(5)))
            .build(ctx.comm)?;
        let mut params = BTreeMap::new();
        let mut records = Vec::new();
        while t.step() < ctx.config.train.steps {
            records.push(t.train_step()?);
            params.insert(t.step(), t.dense_parameters()?);
        }
        let optimizer_steps = t.progress().optimizer_steps;
        let summary = t.finish()?;
        Ok((params, records, optimizer_steps, summary))
    })
    .unwrap();
    let (params, records, optimizer_steps, summary) = &out[0];
    assert_params_bitwise(&params[&5], &params[&4]);
    let moved = params[&6]
        .iter()
        .zip(&params[&5])
        .any(|((_, a), (_, b))| a != b);
    assert!(moved, "step 6 trains again");
    assert_eq!(*optimizer_steps, 6);
    assert_eq!(summary.skipped_steps, 1);
    assert_eq!(records[4].skipped_steps, Some(1));
    // the schedule did not advance on the skipped step: step 6 uses step 5's learning rate
    assert_eq!(records[5].lr, records[4].lr);
    assert_ne!(records[4].lr, records[3].lr);
    // every rank took the same decision
    for (p, _, o, _) in &out[1..] {
        assert_params_bitwise(&p[&7], &params[&7]);
        assert_eq!(o, optimizer_steps);
    }
}
