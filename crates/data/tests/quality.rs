//! Quality control on the real corpora: the perplexity filter separates real text from the same
//! words shuffled, and the drift monitor detects a switch of source and stays quiet on held-out
//! text of the reference source.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_data::{sample_text, DriftMonitor, NgramLm, PerplexityFilter, Tokenizer};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::collections::HashMap;

fn corpus(name: &str) -> String {
    let path = format!("{}/../../data/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The byte range `from..to` (fractions of the file), cut at line ends.
fn slice(text: &str, from: f64, to: f64) -> &str {
    let at = |f: f64| {
        let mut i = (text.len() as f64 * f) as usize;
        while i < text.len() && !text.is_char_boundary(i) {
            i += 1;
        }
        match text[i..].find('\n') {
            Some(nl) if f > 0.0 && f < 1.0 => i + nl + 1,
            _ => i,
        }
    };
    &text[at(from)..at(to)]
}

/// Lower-cased words and single punctuation marks.
fn words(s: &str) -> impl Iterator<Item = String> + '_ {
    s.split(|c: char| c.is_whitespace()).flat_map(|w| {
        let mut out = Vec::new();
        let mut cur = String::new();
        for c in w.chars() {
            if c.is_alphanumeric() || c == '\'' {
                cur.extend(c.to_lowercase());
            } else {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                out.push(c.to_string());
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    })
}

#[test]
fn perplexity_filter_separates_text_from_shuffled_words() {
    let text = corpus("shakespeare");
    let mut vocab: HashMap<String, u32> = HashMap::new();
    vocab.insert("<unk>".into(), 0);
    let train: Vec<Vec<u32>> = slice(&text, 0.0, 0.8)
        .lines()
        .map(|l| {
            words(l)
                .map(|w| {
                    let n = vocab.len() as u32;
                    *vocab.entry(w).or_insert(n)
                })
                .collect()
        })
        .collect();
    let lm = NgramLm::train(train.iter().map(|d| &d[..]), 3, vocab.len()).unwrap();
    let ids = |s: &str| -> Vec<u32> {
        words(s)
            .map(|w| vocab.get(&w).copied().unwrap_or(0))
            .collect()
    };
    // documents of 60 words from text the model never saw
    let docs = |range: &str| -> Vec<Vec<u32>> {
        let words = ids(range);
        words
            .chunks_exact(60)
            .map(|c| c.to_vec())
            .take(150)
            .collect()
    };
    let calib = docs(slice(&text, 0.85, 0.90));
    let real = docs(slice(&text, 0.95, 1.0));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let shuffled: Vec<Vec<u32>> = real
        .iter()
        .map(|d| {
            let mut s = d.clone();
            s.shuffle(&mut rng);
            s
        })
        .collect();
    assert_eq!(real.len(), 150);
    // keep 90% of held-out real text (threshold from other held-out text)
    let filter = PerplexityFilter::with_quantile(lm, calib.iter().map(|d| &d[..]), 0.9).unwrap();
    let kept_real = real.iter().filter(|d| filter.keep(d)).count();
    let kept_shuffled = shuffled.iter().filter(|d| filter.keep(d)).count();
    let ppl = |v: &[Vec<u32>]| {
        let mut p: Vec<f64> = v.iter().map(|d| filter.score(d).unwrap()).collect();
        p.sort_by(f64::total_cmp);
        p[p.len() / 2]
    };
    println!(
        "threshold {:.1}, median perplexity real {:.1} shuffled {:.1}, kept real {kept_real}/150 shuffled {kept_shuffled}/150",
        filter.threshold(),
        ppl(&real),
        ppl(&shuffled)
    );
    assert!(
        kept_real >= 120,
        "kept only {kept_real} of 150 real documents"
    );
    assert!(
        kept_shuffled <= 8,
        "kept {kept_shuffled} of 150 shuffled documents"
    );
    // pairwise: the same words score worse shuffled
    let worse = real
        .iter()
        .zip(&shuffled)
        .filter(|(r, s)| filter.score(s) > filter.score(r))
        .count();
    assert!(
        worse >= 147,
        "shuffled scored worse in only {worse} of 150 pairs"
    );
}

#[test]
fn drift_monitor_detects_a_switch_and_is_quiet_on_the_same_source() {
    let shakespeare = corpus("shakespeare");
    let bible = corpus("web_bible");
    const WINDOW: usize = 16;
    let tok = Tokenizer::train_bpe(slice(&shakespeare, 0.0, 0.03).lines(), 1024).unwrap();
    let v = tok.vocab_size();
    let encode = |s: &str| -> Vec<u32> {
        let lines: Vec<&str> = s.split_inclusive('\n').collect();
        tok.encode_batch(&lines).unwrap().concat()
    };
    // the reference: evenly spaced blocks of the first 80% (every play before the held-out part contributes)
    let reference = encode(&sample_text(slice(&shakespeare, 0.0, 0.8), 1_200_000).concat());
    let batches = |toks: Vec<u32>| -> Vec<Vec<u32>> {
        toks.chunks_exact(1024)
            .map(|c| c.to_vec())
            .take(48)
            .collect()
    };
    let calib = batches(encode(slice(&shakespeare, 0.85, 0.90)));
    let same = batches(encode(slice(&shakespeare, 0.95, 1.0)));
    let other = batches(encode(slice(&bible, 0.95, 1.0)));
    assert_eq!((calib.len(), same.len(), other.len()), (48, 48, 48));

    let mut m = DriftMonitor::new(&reference, v, 0.5, WINDOW, 0.0).unwrap();
    let threshold = m.calibrate(calib.iter().map(|b| &b[..]), 1.5).unwrap();
    let mut worst_same = 0f64;
    for (i, b) in same.iter().enumerate() {
        let r = m.observe(b).unwrap();
        assert!(
            !r.alert,
            "false alarm on held-out shakespeare: kl {} > {threshold}",
            r.kl
        );
        if i + 1 >= WINDOW {
            worst_same = worst_same.max(r.kl);
        }
    }
    // switch to the bible: an alert within one window, and every full window of it alerts
    let mut first_alert = None;
    let mut min_other = f64::INFINITY;
    for (i, b) in other.iter().enumerate() {
        let r = m.observe(b).unwrap();
        if r.alert && first_alert.is_none() {
            first_alert = Some(i);
        }
        if i + 1 >= WINDOW {
            assert!(r.alert, "window of bible only did not alert: kl {}", r.kl);
            min_other = min_other.min(r.kl);
        }
    }
    println!(
        "drift threshold {threshold:.3} nats, worst same-source kl {worst_same:.3}, smallest bible-window kl {min_other:.3}, first alert after {} bible batches",
        first_alert.unwrap() + 1
    );
    assert!(first_alert.unwrap() < WINDOW);
    assert!(min_other > 2.0 * worst_same);
}
