//! Cost of logging every step: microseconds per record for each sink, the detectors and the
//! circuit breaker, and the cross-rank summary, compared with a `small-cpu` training step of
//! about 250 ms (the budget is 1% of it, 2.5 ms).
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_monitor`
//! Prints one JSON line per measurement.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use indicatif::ProgressBar;
use kiln_monitor::{
    BatchInfo, BreakerPolicy, CircuitBreaker, ConsoleSink, DetectorSet, JsonlSink, MetricSink,
    MultiSink, PlotSink, RankStats, RankSummary, ScalerEvent, StepMetrics, TensorBoardSink,
};
use std::time::Instant;

const STEP_S: f64 = 0.250;
const N: u64 = 20_000;

/// A record as a trainer fills it: 20 fields and two per-source losses.
fn record(step: u64) -> StepMetrics {
    let t = step as f64;
    let mut m = StepMetrics {
        epoch: Some(0),
        loss: Some(2.0 + 8.0 * (-t / 2000.0).exp() + 0.01 * (t * 0.37).sin()),
        grad_norm: Some(1.0 + 0.1 * (t * 0.11).cos()),
        grad_norm_clipped: Some(1.0),
        lr: Some(3e-4),
        loss_scale: Some(65536.0),
        scaler_event: Some(ScalerEvent::Stepped),
        tokens_per_s: Some(3600.0 + (t * 0.05).sin()),
        samples_per_s: Some(28.1),
        mfu: Some(0.41),
        step_time_s: Some(0.25),
        data_wait_s: Some(0.001),
        forward_s: Some(0.08),
        backward_s: Some(0.15),
        optimizer_s: Some(0.01),
        param_norm: Some(120.0),
        update_param_ratio: Some(1e-3),
        mem_rss_bytes: Some(800 << 20),
        mem_peak_bytes: Some(900 << 20),
        tokens_seen: Some(step * 1024),
        ..StepMetrics::new(step)
    };
    m.source_loss.insert("web".into(), 2.4);
    m.source_loss.insert("code".into(), 1.9);
    m
}

fn report(what: &str, total_s: f64, n: u64) {
    let us = total_s * 1e6 / n as f64;
    println!(
        "{{\"bench\":\"monitor\",\"what\":\"{what}\",\"records\":{n},\"us_per_record\":{us:.3},\"pct_of_250ms_step\":{:.5}}}",
        100.0 * us * 1e-6 / STEP_S
    );
}

fn bench_sink(what: &str, mut sink: impl MetricSink, records: &[StepMetrics]) {
    let t = Instant::now();
    for m in records {
        sink.record(m).unwrap();
    }
    sink.flush().unwrap();
    report(what, t.elapsed().as_secs_f64(), records.len() as u64);
    sink.close().unwrap();
}

/// The cost of each metric sink per step record; one JSON line per sink.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_monitor")]
struct Args {}

fn main() {
    let Args {} = <Args as clap::Parser>::parse();
    let dir = std::env::temp_dir().join(format!("kiln-bench-monitor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let records: Vec<StepMetrics> = (0..N).map(record).collect();

    bench_sink(
        "jsonl",
        JsonlSink::create(dir.join("run.jsonl")).unwrap().buffered(),
        &records,
    );
    bench_sink(
        "console_lines_every_100",
        ConsoleSink::lines(std::io::sink(), 100),
        &records,
    );
    bench_sink(
        "console_bar_hidden",
        ConsoleSink::with_bar(ProgressBar::hidden(), 1),
        &records,
    );
    bench_sink(
        "tensorboard",
        TensorBoardSink::create(dir.join("tb")).unwrap(),
        &records,
    );
    bench_sink(
        "plot_record",
        PlotSink::new(dir.join("plot_a.png")),
        &records,
    );

    // the plot is drawn once, at the end of a run
    let mut plot = PlotSink::new(dir.join("plot.png"));
    for m in &records {
        plot.record(m).unwrap();
    }
    let t = Instant::now();
    plot.close().unwrap();
    println!(
        "{{\"bench\":\"monitor\",\"what\":\"plot_close_20000_points\",\"ms\":{:.1}}}",
        t.elapsed().as_secs_f64() * 1e3
    );

    let multi = MultiSink::new()
        .with(
            JsonlSink::create(dir.join("multi.jsonl"))
                .unwrap()
                .buffered(),
        )
        .with(ConsoleSink::lines(std::io::sink(), 100))
        .with(TensorBoardSink::create(dir.join("tb_multi")).unwrap())
        .with(PlotSink::new(dir.join("plot_multi.png")));
    let t = Instant::now();
    let mut multi = multi;
    for m in &records {
        multi.record(m).unwrap();
    }
    multi.flush().unwrap();
    report(
        "multi_jsonl_console_tensorboard_plot",
        t.elapsed().as_secs_f64(),
        N,
    );

    let mut detectors = DetectorSet::standard();
    let mut breaker = CircuitBreaker::new(BreakerPolicy::default()).unwrap();
    let ids: Vec<u64> = (0..8).collect();
    let t = Instant::now();
    for m in &records {
        let v = detectors.observe(m);
        let d = breaker.decide(
            m.step,
            &v,
            &BatchInfo {
                sample_ids: &ids,
                last_checkpoint_step: None,
            },
        );
        std::hint::black_box(d);
    }
    report("detectors_and_breaker", t.elapsed().as_secs_f64(), N);

    let reps = 2_000u64;
    let out = kiln_comm::spawn(2, |comm| {
        let t = Instant::now();
        for i in 0..reps {
            let s = RankStats {
                loss: 2.0,
                step_time_s: 0.25 + i as f64 * 1e-9,
                tokens: 1024,
                samples: 8,
            };
            std::hint::black_box(RankSummary::gather(&comm, &s)?);
        }
        Ok::<_, kiln_monitor::MonitorError>(t.elapsed().as_secs_f64())
    })
    .unwrap();
    report("rank_summary_gather_2_thread_ranks", out[0], reps);

    std::fs::remove_dir_all(&dir).unwrap();
}
