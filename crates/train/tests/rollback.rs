//! Issue 8's breaker rollback test with kiln-ckpt and kiln-data: the samples of step 30 are
//! poisoned (a data transform replaces their targets with noise), the loss spikes, the
//! circuit breaker rolls back to the step-25 checkpoint and skips those samples, and training
//! goes on: the final loss is finite and below the loss at step 25. The skipped sample ids
//! are in the next checkpoints (breaker and loader state), and a run resumed from one of them
//! never meets the poisoned samples again, even in the next epoch where the plain order would
//! draw them, and reproduces the original run bitwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{test_dir, tiny_config};
use kiln_ckpt::decode_rank_file;
use kiln_data::{
    DataLoader, LoaderConfig, LoaderState, SampleId, SampleRng, SampleView, Transform,
};
use kiln_monitor::{read_jsonl, BreakerState, EventKind};
use kiln_train::{
    encode_sample_id, prepare_sources, run_threads_with, RunConfig, TrainSummary, Trainer,
};
use std::collections::BTreeSet;
use std::sync::Arc;

/// Replaces the targets of the chosen samples with noise.
struct Poison(BTreeSet<SampleId>);

impl Transform for Poison {
    fn name(&self) -> &str {
        "poison"
    }

    fn apply(&self, s: &mut SampleView<'_>, _rng: &mut SampleRng) -> kiln_data::Result<()> {
        if self.0.contains(&s.id) {
            for (i, t) in s.targets.iter_mut().enumerate() {
                *t = ((s.id.index as usize * 7919 + i * 104_729) % 512) as u32;
            }
        }
        Ok(())
    }
}

const POISONED_STEP: u64 = 30;
const STEPS: u64 = 60;

fn config(root: &std::path::Path) -> RunConfig {
    let mut c = tiny_config("rollback", root, "shakespeare_15k", 15_000);
    c.apply_overrides(&[
        ("dp", "2"),
        ("zero", "1"),
        ("steps", &STEPS.to_string()),
        ("ckpt_every", "5"),
        ("checkpoint.keep_last", "0"),
        ("metrics.tensorboard", "off"),
        ("metrics.png", "off"),
    ])
    .unwrap();
    c.checkpoint.dir = Some(root.join("ckpt"));
    c
}

/// The global batches of the first `n` steps in the plain order (no sample skipped): the
/// sample ids of each step, in the order every data-parallel rank draws them.
fn plain_order(cfg: &RunConfig, n: u64) -> (Vec<Vec<SampleId>>, u64) {
    let comm = kiln_comm::ThreadComm::group(1, Default::default())
        .unwrap()
        .remove(0);
    let sources = prepare_sources(cfg, &comm).unwrap();
    let global = cfg.parallel.dp * cfg.train.rank_batch();
    let lc = LoaderConfig {
        seed: cfg.seed,
        workers: 0,
        ..LoaderConfig::new(cfg.train.seq_len, global)
    };
    let mut loader = DataLoader::new(sources.train, None, lc).unwrap();
    let per_epoch = loader.batches_per_epoch().unwrap();
    let batches = (0..n)
        .map(|_| loader.next_batch().unwrap().sample_ids)
        .collect();
    (batches, per_epoch)
}

fn run(cfg: &RunConfig, poison: &BTreeSet<SampleId>) -> (TrainSummary, Option<LoaderState>) {
    let mut out = run_threads_with(cfg, |ctx| {
        let t = Trainer::builder(ctx.config.clone())
            .transform(Arc::new(Poison(poison.clone())))
            .build(ctx.comm)?;
        let loader_at_start = t.loader().loader_state();
        Ok((t.run()?, loader_at_start))
    })
    .unwrap();
    let (s, l) = out.swap_remove(0);
    (s, Some(l))
}

fn step_part<T: serde::de::DeserializeOwned>(dir: &std::path::Path, step: u64, part: &str) -> T {
    let bytes = std::fs::read(dir.join(format!("step-{step:08}/rank-00001.safetensors"))).unwrap();
    let st = decode_rank_file(&bytes).unwrap();
    // each component keeps its state under its own name (loader, breaker)
    st.part(part).unwrap().meta(part).unwrap()
}

#[test]
fn poisoned_batch_rolls_back_skips_and_resume_honours_the_skip() {
    let root = test_dir("rollback");
    let cfg = config(&root);
    let (order, per_epoch) = plain_order(&cfg, STEPS);
    let poisoned: BTreeSet<SampleId> = order[POISONED_STEP as usize - 1].iter().copied().collect();
    let recurs: Vec<u64> = (POISONED_STEP as usize..STEPS as usize)
        .filter(|&i| order[i].iter().any(|id| poisoned.contains(id)))
        .map(|i| i as u64 + 1)
        .collect();
    println!(
        "{per_epoch} steps per epoch; poisoned samples {poisoned:?}; the plain order draws them \
         again at steps {recurs:?}"
    );
    assert!(
        per_epoch < STEPS - POISONED_STEP,
        "the run must reach the next epoch"
    );
    assert!(
        recurs.iter().any(|&s| s > 35),
        "the plain order must meet them after step 35"
    );

    let (a, _) = run(&cfg, &poisoned);
    let loss_at =
        |s: &TrainSummary, step: u64| s.losses.iter().find(|(k, _)| *k == step).unwrap().1;
    println!(
        "rollbacks {:?}; loss at 25 {}, at 30 after the rollback {}, final {:?}",
        a.rollbacks,
        loss_at(&a, 25),
        loss_at(&a, 30),
        a.final_loss
    );

    // one rollback, from step 30 to the step-25 checkpoint, skipping exactly the poisoned ids
    assert_eq!(a.rollbacks.len(), 1, "{:?}", a.rollbacks);
    let rb = &a.rollbacks[0];
    assert_eq!((rb.at_step, rb.to_step), (POISONED_STEP, 25));
    let mut skipped = rb.skipped_samples.clone();
    skipped.sort_unstable();
    let want: Vec<u64> = poisoned.iter().map(|&id| encode_sample_id(id)).collect();
    assert_eq!(skipped, want);
    // training went on to the end, finite and below the loss at step 25
    assert_eq!(a.steps, STEPS);
    assert_eq!(a.losses.len() as u64, STEPS);
    let last = a.final_loss.unwrap();
    assert!(last.is_finite() && last < loss_at(&a, 25), "{last}");

    // the JSONL tells the story: the spike's alert and the rollback at step 30, then the
    // replayed steps 26..30 (30 + 30 + 5 step records)
    let (records, events) = read_jsonl(a.outputs.jsonl.as_ref().unwrap()).unwrap();
    assert_eq!(records.len() as u64, STEPS + 5);
    let spike = records.iter().find(|r| r.step == POISONED_STEP).unwrap();
    let replayed = records.iter().rfind(|r| r.step == POISONED_STEP).unwrap();
    println!(
        "step 30: loss {:?} on the poisoned batch, {:?} after the rollback",
        spike.loss, replayed.loss
    );
    assert!(spike.loss.unwrap() > 1.15 * replayed.loss.unwrap());
    assert!(events
        .iter()
        .any(|e| e.kind == EventKind::Rollback && e.step == POISONED_STEP));
    assert!(events
        .iter()
        .any(|e| e.kind == EventKind::Alert && e.step == POISONED_STEP));

    // the skip is in the checkpoints written after the rollback: breaker and loader state
    let ckpt = root.join("ckpt");
    let breaker: BreakerState = step_part(&ckpt, 35, "breaker");
    assert_eq!(breaker.rollbacks, 1);
    let mut ids = breaker.skipped[0].sample_ids.clone();
    ids.sort_unstable();
    assert_eq!(ids, want);
    let loader: LoaderState = step_part(&ckpt, 35, "loader");
    assert!(poisoned.iter().all(|&id| loader.skip.contains(id)));
    let before: LoaderState = step_part(&ckpt, 25, "loader");
    assert!(poisoned.iter().all(|&id| !before.skip.contains(id)));

    // resume from step 35 with the poison still in the data: the skip is honoured in the next
    // epoch (no second spike, no rollback) and the run equals the original bitwise
    let mut resume = cfg.clone();
    resume.output_dir = root.join("out-resumed");
    resume.checkpoint.every_steps = 0;
    resume.checkpoint.resume_step = Some(35);
    let (b, loader_at_start) = run(&resume, &poisoned);
    assert_eq!(b.resumed_from, Some(35));
    assert!(b.rollbacks.is_empty(), "{:?}", b.rollbacks);
    let l = loader_at_start.unwrap();
    assert!(poisoned.iter().all(|&id| l.skip.contains(id)));
    assert_eq!(b.losses.len() as u64, STEPS - 35);
    for ((sa, la), (sb, lb)) in a.losses[35..].iter().zip(&b.losses) {
        assert_eq!(sa, sb);
        assert_eq!(la.to_bits(), lb.to_bits(), "step {sa}: {la} vs {lb}");
    }
}
