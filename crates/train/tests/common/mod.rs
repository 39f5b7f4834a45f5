//! Shared set-up of the trainer tests: a slice of the repository's Shakespeare as the corpus,
//! and the `tiny` run configuration writing under the target's temporary folder.
#![allow(dead_code)]

use kiln_train::RunConfig;
use std::path::{Path, PathBuf};

/// The temporary folder of one test (emptied).
pub fn test_dir(test: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kiln-train")
        .join(test);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    root
}

/// Writes `bytes` bytes of Shakespeare (whole lines, from 1 MB into the file) as
/// `<dir>/<name>.txt` and returns `dir`.
pub fn write_corpus(name: &str, bytes: usize) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt");
    let text = std::fs::read_to_string(&src).unwrap();
    let start = 1_000_000 + text[1_000_000..].find('\n').unwrap() + 1;
    let mut end = (start + bytes).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let end = start + text[start..end].rfind('\n').unwrap() + 1;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kiln-train-data")
        .join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.txt"));
    // only rewrite on change: the prepared cache checks the file's checksum
    if std::fs::read_to_string(&path).ok().as_deref() != Some(&text[start..end]) {
        std::fs::write(&path, &text[start..end]).unwrap();
    }
    dir
}

/// The `tiny` preset (vocabulary 512, context 64) on `bytes` bytes of text, sequence length
/// 32, micro-batch 2, accumulation 2, spike detectors armed after 10 steps, outputs under
/// `root/out`.
pub fn tiny_config(name: &str, root: &Path, corpus: &str, bytes: usize) -> RunConfig {
    let mut c = RunConfig::preset("tiny").unwrap();
    c.name = name.to_string();
    c.output_dir = root.join("out");
    c.data.data_dir = write_corpus(corpus, bytes);
    c.data.cache_dir = Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-train-cache"));
    c.data.corpora = vec![corpus.to_string()];
    c.data.val_fraction = 0.1;
    c.data.train_shards = 1;
    c.data.tokenizer_sample_bytes = bytes;
    c.train.seq_len = 32;
    c.train.micro_batch = 2;
    c.train.accumulation = 2;
    c.optim.schedule.lr = 3e-3;
    c.optim.schedule.min_lr = 3e-4;
    c.optim.schedule.warmup_steps = 5;
    for s in [&mut c.monitor.loss_spike, &mut c.monitor.grad_spike] {
        (s.warmup, s.window) = (10, 20);
    }
    c.monitor.watchdog_s = 300.0;
    c.metrics.console = false;
    c.eval.at_end = false;
    c
}

/// Bitwise comparison of two parameter lists, naming the first parameter that differs.
pub fn assert_params_bitwise(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) {
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let same =
            va.len() == vb.len() && va.iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "parameter {na} differs");
    }
}

/// The largest absolute difference over all parameters (by name), its parameter, and the
/// largest relative one (to max(|p|, 1e-3)).
pub fn max_param_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (f64, String, f64) {
    let mut abs = 0.0f64;
    let mut worst = String::new();
    let mut rel = 0.0f64;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len());
        for (x, y) in va.iter().zip(vb) {
            let d = (*x as f64 - *y as f64).abs();
            if d > abs {
                abs = d;
                worst = na.clone();
            }
            rel = rel.max(d / (*y as f64).abs().max(1e-3));
        }
    }
    (abs, worst, rel)
}
