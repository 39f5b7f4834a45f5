//! Sink tests: the JSONL log read back, console lines, the fan-out, and the plot's pixels.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_monitor::{
    read_jsonl, Action, ConsoleSink, Event, EventKind, JsonlSink, MetricSink, MonitorError,
    MultiSink, PlotSink, StepMetrics, Verdict,
};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-monitor-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn record(step: u64) -> StepMetrics {
    StepMetrics {
        time: Some(1.7e9 + step as f64),
        loss: Some(4.0 / (1.0 + step as f64 / 10.0)),
        lr: Some(1e-3 * (1.0 - step as f64 / 200.0)),
        grad_norm: Some(1.0 + (step as f64 * 0.7).sin().abs()),
        // noisy, as measured throughput is (a sawtooth at the pixel scale)
        tokens_per_s: Some(3500.0 + 50.0 * ((step * 7919 % 101) as f64 / 101.0)),
        ..StepMetrics::new(step)
    }
}

#[test]
fn jsonl_round_trips_records_and_events() {
    let dir = temp_dir("jsonl");
    let path = dir.join("sub/run.jsonl");
    let mut sink = JsonlSink::create(&path).unwrap();
    let mut written = Vec::new();
    for s in 0..20 {
        let mut m = record(s);
        if s == 7 {
            m.loss = Some(f64::NAN);
        }
        sink.record(&m).unwrap();
        written.push(m);
    }
    let v = Verdict::NonFinite {
        metric: kiln_monitor::Metric::Loss,
        value: f64::NAN,
    };
    let alert = Event::alert(7, &v);
    let skip = Event::for_action(7, &Action::SkipBatch).unwrap();
    sink.events(&[alert.clone(), skip.clone()]).unwrap();
    sink.close().unwrap();
    assert!(matches!(
        sink.record(&record(21)),
        Err(MonitorError::Closed { sink: "jsonl" })
    ));

    // appending continues the same log
    let mut more = JsonlSink::append(&path).unwrap();
    more.record(&record(20)).unwrap();
    more.close().unwrap();
    written.push(record(20));

    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 23);
    assert!(text.lines().nth(7).unwrap().contains(r#""loss":"NaN""#));
    let event_line = text.lines().nth(20).unwrap();
    assert!(
        event_line.starts_with(r#"{"event":"alert","step":7,"#),
        "{event_line}"
    );

    let (steps, events) = read_jsonl(&path).unwrap();
    assert_eq!(steps.len(), 21);
    for (a, b) in steps.iter().zip(&written) {
        assert_eq!(
            serde_json::to_string(a).unwrap(),
            serde_json::to_string(b).unwrap()
        );
    }
    assert!(steps[7].loss.unwrap().is_nan());
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].kind, EventKind::Alert);
    assert!(matches!(events[0].verdict, Some(Verdict::NonFinite { value, .. }) if value.is_nan()));
    assert_eq!(events[1], skip);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

#[test]
fn console_prints_every_nth_step_and_every_event() {
    let out = Shared::default();
    let mut c = ConsoleSink::lines(out.clone(), 10);
    assert!(!c.is_bar());
    for s in 0..=25 {
        let m = StepMetrics {
            step: s,
            loss: Some(2.0 + s as f64 / 100.0),
            lr: Some(3e-4),
            tokens_per_s: Some(3600.4),
            step_time_s: Some(0.2504),
            mfu: Some(0.1234),
            ..StepMetrics::default()
        };
        c.record(&m).unwrap();
    }
    let mut e = Event::new(EventKind::Rollback, 25, "rolling back to step 20");
    e.time = None;
    c.event(&e).unwrap();
    c.close().unwrap();
    let text = out.text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "step 0 | loss 2.0000 | lr 3.00e-4 | 3600 tok/s | 250.4 ms/step | mfu 12.3%",
            "step 10 | loss 2.1000 | lr 3.00e-4 | 3600 tok/s | 250.4 ms/step | mfu 12.3%",
            "step 20 | loss 2.2000 | lr 3.00e-4 | 3600 tok/s | 250.4 ms/step | mfu 12.3%",
            "[rollback] step 25: rolling back to step 20",
        ]
    );
}

struct Broken;

impl Write for Broken {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::Error::other("disk full"))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Err(std::io::Error::other("disk full"))
    }
}

#[test]
fn multi_sink_reaches_every_sink_despite_a_failure() {
    let a = Shared::default();
    let b = Shared::default();
    let mut multi = MultiSink::new()
        .with(JsonlSink::from_writer(a.clone()))
        .with(JsonlSink::from_writer(Broken))
        .with(JsonlSink::from_writer(b.clone()));
    assert_eq!(multi.len(), 3);
    let err = multi.record(&record(1)).unwrap_err();
    assert!(err.to_string().contains("disk full"), "{err}");
    let _ = multi.flush();
    let expected = format!("{}\n", serde_json::to_string(&record(1)).unwrap());
    assert_eq!(a.text(), expected);
    assert_eq!(b.text(), expected);
}

/// True when `px` is `rgb` blended over white with an opacity of at least 0.2.
fn is_tint(px: &[u8], rgb: [u8; 3]) -> bool {
    let ch = (0..3).max_by_key(|&i| 255 - rgb[i] as i32).unwrap();
    let a = (255.0 - px[ch] as f64) / (255.0 - rgb[ch] as f64);
    (0.2..=1.0).contains(&a)
        && (0..3).all(|i| {
            let want = a * rgb[i] as f64 + (1.0 - a) * 255.0;
            (px[i] as f64 - want).abs() <= 4.0
        })
}

/// Counts pixels of `rgb` (or tints of it, with `tints`) in each quadrant of the image.
fn count(buf: &[u8], (w, h): (u32, u32), rgb: [u8; 3], tints: bool) -> [usize; 4] {
    let mut c = [0; 4];
    for y in 0..h {
        for x in 0..w {
            let i = ((y * w + x) * 3) as usize;
            let px = &buf[i..i + 3];
            if px == rgb || (tints && is_tint(px, rgb)) {
                let q = (y >= h / 2) as usize * 2 + (x >= w / 2) as usize;
                c[q] += 1;
            }
        }
    }
    c
}

fn quadrant_counts(buf: &[u8], size: (u32, u32), rgb: [u8; 3]) -> [usize; 4] {
    count(buf, size, rgb, false)
}

#[test]
fn plot_draws_each_metric_in_its_panel() {
    let dir = temp_dir("plot");
    let path = dir.join("plots/run.png");
    let (w, h) = (800u32, 600u32);
    let mut p = PlotSink::with_size(&path, w, h);
    // more points than pixel columns, and a noisy tokens/s: what a real run gives
    for s in 0..1000 {
        p.record(&record(s)).unwrap();
    }
    // a rollback: steps 800.. replayed, the old ones drawn grey
    let rb = Action::Rollback {
        to_step: 800,
        skip_samples: vec![1],
    };
    p.event(&Event::for_action(850, &rb).unwrap()).unwrap();
    for s in 800..1000 {
        let mut m = record(s);
        m.loss = m.loss.map(|l| l * 0.9);
        p.record(&m).unwrap();
    }
    assert_eq!(p.len(), 1000);
    let mut buf = vec![0u8; (w * h * 3) as usize];
    p.render_rgb(&mut buf).unwrap();
    // series colours: loss top-left, lr top-right, grad norm bottom-left, tokens/s bottom-right;
    // each drawn in its own panel only
    let colours = [
        [31, 119, 180],
        [44, 160, 44],
        [255, 127, 14],
        [148, 103, 189],
    ];
    for (q, rgb) in colours.iter().enumerate() {
        let c = count(&buf, (w, h), *rgb, true);
        assert!(
            c[q] > 300,
            "series {q} has only {} pixels in its panel: {c:?}",
            c[q]
        );
        for (o, &n) in c.iter().enumerate() {
            if o != q {
                assert_eq!(n, 0, "series {q} drawn in panel {o}: {c:?}");
            }
        }
    }
    // the grey replaced points appear in the loss panel only
    let grey = quadrant_counts(&buf, (w, h), [150, 150, 150]);
    assert!(grey[0] > 0, "{grey:?}");
    // text is drawn: dark glyph pixels in every panel
    for q in 0..4 {
        assert!(quadrant_counts(&buf, (w, h), [0, 0, 0])[q] > 100);
    }

    p.close().unwrap();
    let png = std::fs::read(&path).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    assert_eq!(u32::from_be_bytes(png[16..20].try_into().unwrap()), w);
    assert_eq!(u32::from_be_bytes(png[20..24].try_into().unwrap()), h);
    assert!(matches!(
        p.record(&record(0)),
        Err(MonitorError::Closed { sink: "plot" })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plot_without_data_still_renders() {
    let p = PlotSink::with_size("unused.png", 400, 300);
    let mut buf = vec![0u8; 400 * 300 * 3];
    p.render_rgb(&mut buf).unwrap();
    assert!(p.is_empty());
    assert!(p.render_rgb(&mut buf[..10]).is_err());
}
