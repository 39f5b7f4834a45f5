//! The data-side capabilities of the trainer, live: a mixture schedule over two corpora with
//! its realised proportions and the drift monitor (metrics, alert, bitwise resume), the
//! perplexity filter's counts, the loader options of `RunConfig.data`, and the dynamic batch
//! chosen from a memory budget.
//!
//! The tests run in parallel, so each prepares a corpus of its own name: two preparations of
//! one corpus in one cache folder at the same time would race on its files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_params_bitwise, test_dir, tiny_config};
use kiln_data::{MixturePoint, MixtureSchedule};
use kiln_monitor::StepMetrics;
use kiln_train::{run_threads_with, RunConfig, SkipWindows, TrainSummary, Trainer};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

type Params = Vec<(String, Vec<f32>)>;

/// `bytes` bytes of whole lines of the repository's `file` from offset `from`, as
/// `<dir>/<name>.txt`; returns `dir` (shared by the corpora of one test).
fn corpus(dir: &Path, name: &str, file: &str, from: usize, bytes: usize) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data")
        .join(file);
    let text = std::fs::read_to_string(src).unwrap();
    let start = from + text[from..].find('\n').unwrap() + 1;
    let mut end = (start + bytes).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let end = start + text[start..end].rfind('\n').unwrap() + 1;
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("{name}.txt"));
    if std::fs::read_to_string(&path).ok().as_deref() != Some(&text[start..end]) {
        std::fs::write(&path, &text[start..end]).unwrap();
    }
}

/// Two corpora of different style (Shakespeare and Austen), 120 KB each.
fn two_corpora() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-train-data/two");
    corpus(&dir, "plays", "shakespeare.txt", 500_000, 120_000);
    corpus(&dir, "novels", "austen.txt", 300_000, 120_000);
    dir
}

fn mixed_config(name: &str, root: &Path) -> RunConfig {
    let mut c = tiny_config(name, root, "unused", 1000);
    c.data.data_dir = two_corpora();
    c.data.corpora = vec!["plays".into(), "novels".into()];
    c.data.mixture = MixtureSchedule::new(vec![
        MixturePoint {
            step: 1,
            weights: vec![1.0, 1.0],
        },
        MixturePoint {
            step: 13,
            weights: vec![0.0, 1.0],
        },
    ])
    .unwrap();
    c.data.drift.window = 8;
    c.train.steps = 24;
    c.parallel.dp = 2;
    c.checkpoint.every_steps = 8;
    c.checkpoint.keep_last = 0;
    c.checkpoint.async_save = false;
    c
}

/// Runs `cfg` on its thread ranks: rank 0's summary, parameters and step records.
fn run(cfg: &RunConfig) -> (TrainSummary, Params, Vec<StepMetrics>) {
    let mut out = run_threads_with(cfg, |ctx| {
        let records = Rc::new(RefCell::new(Vec::new()));
        let r = records.clone();
        let mut t = Trainer::builder(ctx.config.clone())
            .on_step(move |m| r.borrow_mut().push(m.clone()))
            .build(ctx.comm)?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        let params = t.dense_parameters()?;
        let s = t.finish()?;
        let recs = records.borrow().clone();
        Ok((s, params, recs))
    })
    .unwrap();
    out.swap_remove(0)
}

fn extra(m: &StepMetrics, key: &str) -> f64 {
    *m.extra
        .get(key)
        .unwrap_or_else(|| panic!("step {} has no {key}", m.step))
}

#[test]
fn mixture_schedule_and_drift_are_live_and_resume_bitwise() {
    let root = test_dir("mixture_drift");
    let cfg = mixed_config("mixture_drift", &root);
    let (full, params, recs) = run(&cfg);
    assert_eq!(full.steps, 24);

    // realised mixture: 12 steps half and half (about), then 12 steps of novels only
    let samples: Vec<u64> = full.source_samples.iter().map(|(_, n)| *n).collect();
    let per_step = (cfg.train.rank_batch() * cfg.parallel.dp) as u64;
    assert_eq!(samples.iter().sum::<u64>(), 24 * per_step);
    let plays = samples[0] as f64 / (24 * per_step) as f64;
    println!(
        "realised mixture {:?}; plays {plays:.3} (expected about 0.25)",
        full.source_samples
    );
    assert!((0.15..0.35).contains(&plays), "{plays}");
    let (mix12, mix24) = (extra(&recs[11], "mix/plays"), extra(&recs[23], "mix/plays"));
    assert!((0.3..0.7).contains(&mix12), "{mix12}");
    assert_eq!(mix24, mix12 / 2.0, "no plays after step 12");
    assert!((extra(&recs[23], "mix/plays") + extra(&recs[23], "mix/novels") - 1.0).abs() < 1e-12);

    // drift: a metric every step; the switch to one corpus moves the window away from the
    // reference (both corpora, equal weights) and raises the alert, which was quiet before
    let kl: Vec<f64> = recs.iter().map(|m| extra(m, "drift_kl")).collect();
    println!("drift KL by step: {kl:.3?}");
    let before = kl[7..12].iter().cloned().fold(0.0, f64::max);
    let after = kl[19..24].iter().cloned().fold(f64::INFINITY, f64::min);
    let (last_kl, threshold) = full.drift.unwrap();
    println!(
        "KL full windows before the switch <= {before:.4}, after >= {after:.4}; threshold \
         {threshold:.4}, alerts {}",
        full.drift_alerts
    );
    assert_eq!(last_kl, kl[23]);
    assert!(
        after > before,
        "KL {after} after the switch vs {before} before"
    );
    let first_alert = recs
        .iter()
        .position(|m| extra(m, "drift_kl") > threshold && m.step >= 8)
        .map(|i| recs[i].step);
    println!("first step above the threshold: {first_alert:?}");
    assert!(
        before < threshold,
        "the calibrated threshold is quiet before the switch"
    );
    assert!(
        full.drift_alerts >= 1 && first_alert > Some(12),
        "{first_alert:?}"
    );
    // same seed and config: bitwise the same; resume from step 8: bitwise the continuation,
    // drift and mixture metrics included
    let mut again_cfg = cfg.clone();
    again_cfg.output_dir = root.join("again");
    let (again, params2, _) = run(&again_cfg);
    assert_eq!(again.losses, full.losses);
    assert_params_bitwise(&params, &params2);
    let mut resumed_cfg = cfg.clone();
    resumed_cfg.checkpoint.resume_step = Some(16);
    let (resumed, params3, recs3) = run(&resumed_cfg);
    assert_eq!(resumed.resumed_from, Some(16));
    assert_params_bitwise(&params, &params3);
    assert_eq!(&full.losses[16..], &resumed.losses[..]);
    assert_eq!(resumed.source_samples, full.source_samples);
    assert_eq!(
        recs[16..].len(),
        recs3.len(),
        "step records after the resume"
    );
    for (a, b) in recs[16..].iter().zip(&recs3) {
        for key in ["drift_kl", "mix/plays", "mix/novels"] {
            assert_eq!(
                extra(a, key).to_bits(),
                extra(b, key).to_bits(),
                "{key} at step {}",
                a.step
            );
        }
    }
}

#[test]
fn perplexity_filter_counts_reach_the_summary() {
    let root = test_dir("quality");
    let mut cfg = tiny_config("quality", &root, "shakespeare_120k", 120_000);
    cfg.data.quality = Some(kiln_data::QualityConfig {
        drop_fraction: 0.05,
        ..kiln_data::QualityConfig::default()
    });
    cfg.train.steps = 2;
    cfg.optim.schedule.warmup_steps = 1;
    let (s, _, _) = run(&cfg);
    let (name, q) = &s.quality[0];
    println!("quality filter on {name}: {q:?}");
    assert_eq!(name, "shakespeare_120k");
    assert!(
        q.docs_dropped > 0 && q.docs_kept > q.docs_dropped * 10,
        "{q:?}"
    );
    assert!(q.tokens_dropped > 0);
}

#[test]
fn loader_options_and_skip_windows_reach_the_loader() {
    let root = test_dir("loader_options");
    let mut cfg = tiny_config("loader_options", &root, "shakespeare_120k_loader", 120_000);
    cfg.train.steps = 3;
    cfg.optim.schedule.warmup_steps = 1;
    cfg.data.stall_timeout_s = 7.5;
    cfg.data.cache_chunks = 3;
    cfg.data.cache_chunk_tokens = 4096;
    cfg.data.skip = vec![SkipWindows {
        corpus: "shakespeare_120k_loader".into(),
        start: 0,
        end: 1_000_000,
    }];
    // every window skipped: the loader has nothing to give, and says so
    let err = run_threads_with(&cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        let lc = t.loader().config().clone();
        assert_eq!(lc.stall_timeout, std::time::Duration::from_secs_f64(7.5));
        assert_eq!((lc.cache_chunks, lc.chunk_tokens), (3, 4096));
        t.train_step()?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    println!("all windows skipped: {err}");
    assert!(
        err.contains("0 of its") && err.contains("not skipped"),
        "{err}"
    );
    // a few windows skipped: the loader's skip set holds them (the loader's own tests prove it
    // never yields a skipped window), and training goes on
    cfg.data.skip[0].end = 40;
    let states = run_threads_with(&cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        for _ in 0..3 {
            t.train_step()?;
        }
        Ok(t.loader().loader_state())
    })
    .unwrap();
    let ranges: Vec<_> = states[0].skip.ranges(0).collect();
    assert_eq!(ranges, vec![0..40]);
    let mut bad = cfg.clone();
    bad.data.skip[0].corpus = "nope".into();
    let e = Trainer::builder(bad)
        .build(
            kiln_comm::ThreadComm::group(1, Default::default())
                .unwrap()
                .remove(0),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("RunConfig.data.skip[0].corpus") && e.contains("nope"),
        "{e}"
    );
}

#[test]
fn dynamic_batch_picks_the_micro_batch_and_keeps_the_trajectory() {
    let root = test_dir("dynamic_batch");
    let mut cfg = tiny_config("dynamic_batch", &root, "shakespeare_120k_dynamic", 120_000);
    cfg.train.steps = 4;
    cfg.optim.schedule.warmup_steps = 1;
    cfg.train.micro_batch = 4;
    cfg.train.accumulation = 1;
    // a budget that fits a micro-batch of 2 but not 4 (the estimate of kiln-memory)
    let plan = |mb: u64| {
        kiln_memory::MemoryPlan {
            shape: cfg.gpt_config().unwrap().shape(),
            precision: kiln_memory::MemPrecision::F32,
            stage: kiln_memory::ZeroStage::Replicated,
            dp: 1,
            tp: 1,
            micro_batch: mb,
            recompute: kiln_memory::RecomputePolicy::None,
            bucket_bytes: cfg.parallel.bucket_bytes() as u64,
            sequence_parallel: false,
        }
        .estimate()
        .unwrap()
        .total()
    };
    let budget = (plan(2) + plan(4)) / 2;
    let mut dynamic = cfg.clone();
    dynamic.train.dynamic_batch = Some(kiln_train::DynamicBatchSection {
        budget_mib: budget as f64 / (1u64 << 20) as f64,
    });
    let chosen = run_threads_with(&dynamic, |ctx| {
        let t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        Ok((t.config().train.micro_batch, t.config().train.accumulation))
    })
    .unwrap()[0];
    println!("budget {budget} B: micro-batch {} x {}", chosen.0, chosen.1);
    assert_eq!(chosen, (2, 2));
    // the same as configuring micro-batch 2 x 2 by hand, bitwise
    let (d, pd, _) = run(&dynamic);
    let mut manual = cfg.clone();
    manual.train.micro_batch = 2;
    manual.train.accumulation = 2;
    let (m, pm, _) = run(&manual);
    assert_eq!(d.losses, m.losses);
    assert_params_bitwise(&pd, &pm);
    // a budget below micro-batch 1 is an error naming the field
    let mut tight = cfg.clone();
    tight.train.dynamic_batch = Some(kiln_train::DynamicBatchSection { budget_mib: 0.001 });
    let e = Trainer::builder(tight)
        .build(
            kiln_comm::ThreadComm::group(1, Default::default())
                .unwrap()
                .remove(0),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("RunConfig.train.dynamic_batch"), "{e}");
}
