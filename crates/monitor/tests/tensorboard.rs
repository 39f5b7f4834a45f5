//! TensorBoard read-back: write an event file, read it with TensorBoard's own
//! `EventAccumulator` (Python) and with a TFRecord reader here, and compare values and steps.
//!
//! The Python half needs `pip install tensorboard`; where `python3` or the module is missing
//! it prints why it skips, except under `CI=true` (`.ci/run` installs it), where that fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_monitor::{masked_crc32c, Event, EventKind, MetricSink, StepMetrics, TensorBoardSink};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-monitor-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The scalars the test writes: tag -> [(step, value)].
fn write_run(dir: &Path) -> (PathBuf, BTreeMap<String, Vec<(u64, f32)>>) {
    let mut sink = TensorBoardSink::create(dir).unwrap();
    let mut expected: BTreeMap<String, Vec<(u64, f32)>> = BTreeMap::new();
    for step in 0..50u64 {
        let loss = 10.0 * (-(step as f64) / 20.0).exp() + 2.0;
        let lr = 3e-4 * (step as f64 + 1.0) / 50.0;
        let mut m = StepMetrics {
            loss: Some(loss),
            lr: Some(lr),
            tokens_per_s: Some(3000.0 + step as f64),
            ..StepMetrics::new(step)
        };
        m.source_loss.insert("web".into(), loss + 0.5);
        if step % 10 == 0 {
            m.grad_norm = Some(1.0 / (step as f64 + 1.0));
        }
        sink.record(&m).unwrap();
        m.for_each_scalar(|p, n, v| {
            expected
                .entry(format!("{p}{n}"))
                .or_default()
                .push((step, v as f32));
        });
    }
    sink.event(&Event::new(EventKind::Rollback, 30, "test"))
        .unwrap();
    expected.insert("events/rollback".into(), vec![(30, 1.0)]);
    let path = sink.path().to_path_buf();
    sink.close().unwrap();
    (path, expected)
}

/// Reads TFRecords back, checking both CRCs of every record; returns the payloads.
fn read_records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let len_bytes = &bytes[i..i + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap());
        assert_eq!(
            len_crc,
            masked_crc32c(len_bytes),
            "length crc of record at {i}"
        );
        let data = &bytes[i + 12..i + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked_crc32c(data), "data crc of record at {i}");
        out.push(data.to_vec());
        i += 16 + len;
    }
    assert_eq!(i, bytes.len());
    out
}

#[test]
fn records_are_framed_with_valid_crcs() {
    let dir = temp_dir("tb-frame");
    let (path, _) = write_run(&dir);
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let recs = read_records(&path);
    // file_version + 50 records + 1 event
    assert_eq!(recs.len(), 52);
    // first record: wall_time (0x09 + 8 bytes), step 0 (0x10 0x00), file_version (0x1a)
    assert_eq!(recs[0][0], 0x09);
    assert_eq!(&recs[0][9..12], &[0x10, 0x00, 0x1a]);
    assert!(recs[0].ends_with(b"brain.Event:2"));
    std::fs::remove_dir_all(&dir).unwrap();
}

const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator
acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
out = {t: [[e.step, e.value, e.wall_time] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
print(json.dumps(out))
"#;

#[test]
fn tensorboard_reads_the_scalars_back() {
    let Some(python) = kiln_testkit::Python::require(
        "tensorboard_reads_the_scalars_back",
        &["tensorboard.backend.event_processing.event_accumulator"],
    ) else {
        return;
    };
    let dir = temp_dir("tb-read");
    let (path, expected) = write_run(&dir);
    let out = python.run(
        "TensorBoard's EventAccumulator",
        ["-c", READER, path.to_str().unwrap()],
    );
    let got: BTreeMap<String, Vec<(u64, f64, f64)>> = serde_json::from_str(&out).unwrap();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "tags differ"
    );
    for (tag, want) in &expected {
        let have = &got[tag];
        assert_eq!(have.len(), want.len(), "{tag}: number of points");
        for ((s, v, wall), (ws, wv)) in have.iter().zip(want) {
            assert_eq!(s, ws, "{tag}: step");
            // TensorBoard stores float32: the values must match bitwise
            assert_eq!(*v as f32, *wv, "{tag} at step {s}");
            assert!(*wall > 1.6e9, "{tag}: wall time {wall}");
        }
    }
    println!(
        "tensorboard read back {} tags, {} points",
        got.len(),
        got.values().map(Vec::len).sum::<usize>()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
