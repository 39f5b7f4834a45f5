//! Issue 9's acceptance test: 30 steps of the `tiny` GPT through `Trainer` with every part
//! switched on under dp=2 x tp=2 (ZeRO-1, fp16 with dynamic loss scaling, activation
//! checkpointing, warmup + cosine, clipping, checkpoints every 10 steps, spike detectors with the
//! circuit breaker, JSONL + TensorBoard + PNG, evaluation), then a resume from the step-20
//! checkpoint that must reproduce steps 21 to 30 bitwise: losses, final parameters, and the
//! bytes of the step-30 checkpoint.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_params_bitwise, test_dir, tiny_config};
use kiln_ckpt::{LocalFs, Manifest, Storage};
use kiln_monitor::read_jsonl;
use kiln_train::{run_threads_with, RunConfig, TrainSummary, Trainer};
use std::time::Instant;

type Params = Vec<(String, Vec<f32>)>;

/// Runs `cfg` on its dp x tp thread ranks; rank 0's summary and dense parameters.
fn run(cfg: &RunConfig) -> (TrainSummary, Params) {
    let mut out = run_threads_with(cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        let params = t.dense_parameters()?;
        Ok((t.finish()?, params))
    })
    .unwrap();
    out.swap_remove(0)
}

fn step30_shas(dir: &std::path::Path) -> Vec<String> {
    let fs = LocalFs::new(dir).unwrap();
    let m = Manifest::from_json(&fs.get("step-00000030/manifest.json").unwrap()).unwrap();
    m.files.iter().map(|f| f.sha256.clone()).collect()
}

#[test]
fn thirty_steps_with_every_part_then_bitwise_resume() {
    let root = test_dir("all_parts");
    let mut cfg = tiny_config("all_parts", &root, "shakespeare_200k", 200_000);
    cfg.apply_overrides(&[
        ("dp", "2"),
        ("tp", "2"),
        ("zero", "1"),
        ("precision", "f16"),
        ("recompute", "every_block"),
        ("steps", "30"),
        ("warmup", "5"),
        ("optim.schedule.decay", "cosine"),
        ("clip", "1.0"),
        ("ckpt_every", "10"),
        ("checkpoint.keep_last", "0"),
        ("checkpoint.async_save", "true"),
        ("eval_every", "10"),
        ("eval_batches", "2"),
        ("metrics.jsonl", "on"),
        ("metrics.tensorboard", "on"),
        ("metrics.png", "on"),
        ("metrics.console", "on"),
        ("monitor.detectors", "on"),
        ("metrics.update_norms_every", "3"),
    ])
    .unwrap();
    cfg.checkpoint.dir = Some(root.join("ckpt"));

    let t0 = Instant::now();
    let (s1, p1) = run(&cfg);
    let wall1 = t0.elapsed().as_secs_f64();
    let losses: Vec<f32> = s1.losses.iter().map(|(_, l)| *l).collect();
    println!(
        "30 steps dp=2 x tp=2 ZeRO-1 fp16: {wall1:.1} s, losses {:?} .. {:?}, val {:?}, {:.0} tokens/s",
        &losses[..3],
        &losses[27..],
        s1.val_losses,
        s1.tokens_per_s
    );

    // the loss decreases: the last five steps well below the first five
    assert_eq!(s1.losses.len(), 30);
    assert!(s1.rollbacks.is_empty(), "{:?}", s1.rollbacks);
    let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = losses[25..].iter().sum::<f32>() / 5.0;
    assert!(
        last < first - 0.5,
        "loss did not decrease: {first} -> {last}"
    );
    assert!(first > 6.0 && first < 6.6, "starts near ln(512): {first}");
    assert_eq!(s1.val_losses.len(), 3);
    assert!(s1.val_losses[2].1 < s1.val_losses[0].1);

    // checkpoints exist and are complete
    let ckpt = root.join("ckpt");
    assert_eq!(s1.checkpoints, [10, 20, 30]);
    for step in [10, 20, 30] {
        let d = ckpt.join(format!("step-{step:08}"));
        assert!(d.join("manifest.json").is_file(), "{}", d.display());
        for r in 0..4 {
            assert!(d.join(format!("rank-{r:05}.safetensors")).is_file());
        }
    }

    // the JSONL has 30 step records with every metric
    let jsonl = s1.outputs.jsonl.clone().unwrap();
    let (records, events) = read_jsonl(&jsonl).unwrap();
    assert_eq!(records.len(), 30);
    for (i, m) in records.iter().enumerate() {
        assert_eq!(m.step, i as u64 + 1);
        let stepped = !matches!(
            m.scaler_event,
            Some(kiln_monitor::ScalerEvent::Skipped | kiln_monitor::ScalerEvent::BackedOff)
        );
        let mut have = vec![
            ("time", m.time.is_some()),
            ("epoch", m.epoch.is_some()),
            ("loss", m.loss.is_some_and(f64::is_finite)),
            ("lr", m.lr.is_some()),
            ("loss_scale", m.loss_scale.is_some()),
            ("scaler_event", m.scaler_event.is_some()),
            ("tokens_per_s", m.tokens_per_s.is_some_and(|v| v > 0.0)),
            ("samples_per_s", m.samples_per_s.is_some_and(|v| v > 0.0)),
            ("model_flops_per_s", m.model_flops_per_s.is_some()),
            ("mfu", m.mfu.is_some_and(|v| v > 0.0 && v < 1.0)),
            ("step_time_s", m.step_time_s.is_some()),
            ("data_wait_s", m.data_wait_s.is_some()),
            ("comm_s", m.comm_s.is_some()),
            ("optimizer_s", m.optimizer_s.is_some()),
            ("step_time_min_s", m.step_time_min_s.is_some()),
            ("step_time_max_s", m.step_time_max_s.is_some()),
            ("straggler_rank", m.straggler_rank.is_some()),
            ("rank_step_time_s", m.rank_step_time_s.len() == 4),
            ("skipped_steps", m.skipped_steps.is_some()),
            ("mem_rss_bytes", m.mem_rss_bytes.is_some()),
            ("mem_peak_bytes", m.mem_peak_bytes.is_some()),
            ("tokens_seen", m.tokens_seen == Some(m.step * 8 * 32)),
            ("samples_seen", m.samples_seen == Some(m.step * 8)),
            ("compute_s", m.extra.contains_key("compute_s")),
        ];
        if stepped {
            have.push(("grad_norm", m.grad_norm.is_some()));
            have.push(("grad_norm_clipped", m.grad_norm_clipped.is_some()));
        }
        if m.step % 10 == 0 {
            have.push(("ckpt_time_s", m.ckpt_time_s.is_some()));
            have.push(("val_loss", m.extra.contains_key("val_loss")));
        }
        let missing: Vec<&str> = have.iter().filter(|(_, ok)| !ok).map(|(n, _)| *n).collect();
        assert!(missing.is_empty(), "step {}: missing {missing:?}", m.step);
        // the update norms on the applied steps `metrics.update_norms_every` (3) names, only
        let due = stepped && m.step % 3 == 0;
        assert_eq!(
            (
                m.param_norm.is_some_and(|v| v > 0.0),
                m.update_param_ratio.is_some()
            ),
            (due, due),
            "step {}: param_norm {:?}, update_param_ratio {:?}",
            m.step,
            m.param_norm,
            m.update_param_ratio
        );
        assert_eq!(
            m.loss.unwrap() as f32,
            losses[i],
            "the JSONL holds the exact loss"
        );
    }
    assert!(events
        .iter()
        .any(|e| e.message.contains("checkpoint of step 30")));

    // TensorBoard event file and PNG plot
    let tb = s1.outputs.tensorboard.clone().unwrap();
    let tb_files: Vec<_> = std::fs::read_dir(&tb).unwrap().collect();
    assert_eq!(tb_files.len(), 1);
    let png = std::fs::read(s1.outputs.png.clone().unwrap()).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 5_000);

    // resume from the step-20 checkpoint: steps 21..30 again, bitwise
    let shas_before = step30_shas(&ckpt);
    let mut resume = cfg.clone();
    resume.output_dir = root.join("out-resumed");
    resume.checkpoint.resume_step = Some(20);
    let t1 = Instant::now();
    let (s2, p2) = run(&resume);
    println!(
        "resumed from step 20: {:.1} s for 10 steps",
        t1.elapsed().as_secs_f64()
    );
    assert_eq!(s2.resumed_from, Some(20));
    assert_eq!(s2.losses.len(), 10);
    for ((sa, la), (sb, lb)) in s1.losses[20..].iter().zip(&s2.losses) {
        assert_eq!(sa, sb);
        assert_eq!(la.to_bits(), lb.to_bits(), "step {sa}: {la} vs {lb}");
    }
    assert_params_bitwise(&p2, &p1);
    assert_eq!(s2.val_losses.last(), s1.val_losses.last());
    // the resumed run rewrote the step-30 checkpoint with identical bytes: every part of
    // the state (weights, moments, scaler, loader, breaker, counters) is the same
    assert_eq!(step30_shas(&ckpt), shas_before);
}
