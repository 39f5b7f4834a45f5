//! The perplexity filter of `prepare_corpus` on real text: its counts add up and match the
//! shards, the shards are the training text less whole paragraphs (a garbage one among them),
//! drop_fraction 0 changes nothing, the tokenizer and validation split are untouched, a changed
//! filter rebuilds, a rebuild writes the same bytes, and bad settings are typed errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_data::{
    prepare_corpus, split_validation, DataError, NgramLm, PrepareConfig, PreparedCorpus,
    QualityConfig, QualityReport, TokenShard,
};
use std::path::{Path, PathBuf};

fn corpus_head(name: &str, bytes: usize) -> String {
    let path = format!("{}/../../data/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let mut end = bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// A paragraph of random printable characters (splitmix64), in lines of 60.
fn garbage(seed: u64, chars: usize) -> String {
    let mut x = seed;
    let mut s = String::new();
    for i in 0..chars {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        s.push(char::from(b'!' + (z % 94) as u8));
        if i % 60 == 59 {
            s.push('\n');
        }
    }
    s.push_str("\n\n");
    s
}

/// `text` with `insert` placed at the first paragraph start after `at` of its bytes.
fn insert_paragraph(text: &str, at: f64, insert: &str) -> String {
    let from = (text.len() as f64 * at) as usize;
    let pos = from + text[from..].find("\n\n").unwrap() + 2;
    format!("{}{insert}{}", &text[..pos], &text[pos..])
}

/// The documents of a text as the filter defines them, computed here on their own: a new
/// document at every non-blank line after a blank one, leading blank lines joining the first.
fn paragraphs(text: &str) -> Vec<String> {
    let mut docs: Vec<String> = Vec::new();
    let mut prev_blank = false;
    for line in text.split_inclusive('\n') {
        let blank = line.trim().is_empty();
        if docs.is_empty() || (prev_blank && !blank) {
            docs.push(String::new());
        }
        docs.last_mut().unwrap().push_str(line);
        prev_blank = blank;
    }
    docs
}

struct Fixture {
    root: PathBuf,
    data: PathBuf,
    garbage: String,
    junk: String,
}

impl Fixture {
    /// Austen's and Shakespeare's first 60 kB, austen with two garbage paragraphs inserted:
    /// random characters, and one junk word repeated.
    fn new(tag: &str) -> Self {
        let root = std::env::temp_dir().join(format!(
            "kiln-data-prepare-quality-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let data = root.join("data");
        std::fs::create_dir_all(&data).unwrap();
        let garbage = garbage(7, 600);
        let junk = format!("{}\n\n", ["xq#zv!"; 80].join(" "));
        let austen = insert_paragraph(&corpus_head("austen", 60_000), 0.4, &garbage);
        let austen = insert_paragraph(&austen, 0.7, &junk);
        std::fs::write(data.join("austen.txt"), austen).unwrap();
        std::fs::write(
            data.join("shakespeare.txt"),
            corpus_head("shakespeare", 60_000),
        )
        .unwrap();
        Fixture {
            root,
            data,
            garbage,
            junk,
        }
    }

    fn config(&self, out: &str, quality: Option<QualityConfig>) -> PrepareConfig {
        PrepareConfig {
            corpora: vec!["austen".into(), "shakespeare".into()],
            vocab_size: 600,
            train_shards: 2,
            tokenizer_sample_bytes: 90_000,
            quality,
            ..PrepareConfig::new(&self.data, self.root.join(out))
        }
    }

    fn train_text(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.data.join(format!("{name}.txt"))).unwrap();
        split_validation(&text, 0.05).0.to_string()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn tokens(paths: &[PathBuf]) -> Vec<u32> {
    paths
        .iter()
        .flat_map(|p| TokenShard::open(p).unwrap().to_vec())
        .collect()
}

fn bytes(paths: &[PathBuf]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn report(p: &PreparedCorpus, i: usize) -> &QualityReport {
    p.sources[i].quality.as_ref().unwrap()
}

fn files_of(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_of(&p));
        } else {
            out.push((
                p.strip_prefix(dir).unwrap().to_path_buf(),
                std::fs::read(&p).unwrap(),
            ));
        }
    }
    out.sort();
    out
}

#[test]
fn counts_add_up_and_the_shards_are_the_text_less_whole_paragraphs() {
    let fx = Fixture::new("counts");
    let plain = prepare_corpus(&fx.config("plain", None)).unwrap();
    let filtered = prepare_corpus(&fx.config("filtered", Some(QualityConfig::default()))).unwrap();
    assert!(plain.sources.iter().all(|s| s.quality.is_none()));
    let tok = filtered.load_tokenizer().unwrap();
    // the tokenizer is trained before the filter: the same file
    assert_eq!(
        std::fs::read(&plain.tokenizer).unwrap(),
        std::fs::read(&filtered.tokenizer).unwrap()
    );
    for (i, (p, f)) in plain.sources.iter().zip(&filtered.sources).enumerate() {
        let q = report(&filtered, i);
        println!("{}: {q:?}", f.name);
        let text = fx.train_text(&f.name);
        let docs = paragraphs(&text);
        // documents and tokens add up, to the unfiltered split's
        assert_eq!(q.docs_kept + q.docs_dropped, docs.len() as u64);
        assert_eq!(q.tokens_kept + q.tokens_dropped, p.train_tokens - 1);
        // the shards hold the kept tokens and one end-of-text
        let t = tokens(&f.train);
        assert_eq!(t.len() as u64, f.train_tokens);
        assert_eq!(f.train_tokens, q.tokens_kept + 1);
        assert_eq!(*t.last().unwrap(), filtered.eot);
        assert!(q.threshold > 1.0 && q.threshold.is_finite());
        // each document's tokens (the split is encoded line by line)
        let doc_tokens = |d: &str| -> u64 {
            d.split_inclusive('\n')
                .map(|l| tok.encode(l).unwrap().len() as u64)
                .sum()
        };
        // at most drop_fraction of the documents long enough to be scored go: those above the
        // 0.98 quantile, the element of rank round((n - 1) * 0.98)
        let scored = docs.iter().filter(|d| doc_tokens(d) >= 8).count() as u64;
        let above = scored - 1 - ((scored - 1) as f64 * 0.98).round() as u64;
        assert!(
            q.docs_dropped >= 1 && q.docs_dropped <= above,
            "{} of {scored}",
            q.docs_dropped
        );
        // the shards are the training text with whole paragraphs removed, in order
        let kept = tok.decode(&t[..t.len() - 1]).unwrap();
        let mut at = 0;
        let (mut n_kept, mut kept_tokens, mut short_dropped) = (0u64, 0u64, 0);
        for d in &docs {
            if kept[at..].starts_with(d.as_str()) {
                at += d.len();
                n_kept += 1;
                kept_tokens += doc_tokens(d);
            } else if doc_tokens(d) < 8 {
                short_dropped += 1;
            }
        }
        assert_eq!(at, kept.len(), "{}", &kept[at..]);
        assert_eq!((n_kept, kept_tokens), (q.docs_kept, q.tokens_kept));
        assert_eq!(
            short_dropped, 0,
            "a document too short to score was dropped"
        );
        // the validation split is never filtered
        assert_eq!(bytes(&p.val), bytes(&f.val));
        assert_eq!(p.val_tokens, f.val_tokens);
    }
    // the garbage paragraphs are among the dropped
    let austen = tokens(&filtered.sources[0].train);
    let austen = tok.decode(&austen[..austen.len() - 1]).unwrap();
    for g in [&fx.garbage, &fx.junk] {
        assert!(fx.train_text("austen").contains(g.as_str()));
        assert!(!austen.contains(&g[..60]), "kept {}", &g[..60]);
    }
    assert!(tokens(&plain.sources[0].train).len() > tokens(&filtered.sources[0].train).len());
}

#[test]
fn drop_fraction_zero_keeps_every_document_and_writes_the_unfiltered_shards() {
    let fx = Fixture::new("zero");
    let plain = prepare_corpus(&fx.config("plain", None)).unwrap();
    let q = QualityConfig {
        drop_fraction: 0.0,
        ..QualityConfig::default()
    };
    let zero = prepare_corpus(&fx.config("zero", Some(q))).unwrap();
    for (i, (p, z)) in plain.sources.iter().zip(&zero.sources).enumerate() {
        let r = report(&zero, i);
        assert_eq!((r.docs_dropped, r.tokens_dropped), (0, 0));
        assert_eq!(
            r.docs_kept,
            paragraphs(&fx.train_text(&z.name)).len() as u64
        );
        assert_eq!(r.tokens_kept + 1, p.train_tokens);
        assert_eq!(bytes(&p.train), bytes(&z.train));
        assert_eq!(bytes(&p.val), bytes(&z.val));
    }
}

#[test]
fn a_changed_filter_rebuilds_and_a_rebuild_writes_the_same_bytes() {
    let fx = Fixture::new("rebuild");
    let cfg = fx.config("cache", Some(QualityConfig::default()));
    let first = prepare_corpus(&cfg).unwrap();
    assert!(!first.reused);
    let files = files_of(&cfg.out_dir);
    let again = prepare_corpus(&cfg).unwrap();
    assert!(again.reused);
    assert_eq!(again.sources, first.sources);

    // another drop fraction: rebuilt, dropping more
    let more = QualityConfig {
        drop_fraction: 0.1,
        ..QualityConfig::default()
    };
    let rebuilt = prepare_corpus(&PrepareConfig {
        quality: Some(more.clone()),
        ..cfg.clone()
    })
    .unwrap();
    assert!(!rebuilt.reused);
    assert!(report(&rebuilt, 0).docs_dropped > report(&first, 0).docs_dropped);
    assert!(rebuilt.sources[0].train_tokens < first.sources[0].train_tokens);
    // another order or minimum length, or no filter: rebuilt as well
    for q in [
        Some(QualityConfig {
            order: 2,
            ..QualityConfig::default()
        }),
        Some(QualityConfig {
            min_doc_tokens: 20,
            ..QualityConfig::default()
        }),
        None,
    ] {
        let c = PrepareConfig {
            quality: q,
            ..cfg.clone()
        };
        assert!(!prepare_corpus(&c).unwrap().reused);
        assert!(prepare_corpus(&c).unwrap().reused);
    }
    // back to the first configuration: every file is byte for byte the first build's
    let back = prepare_corpus(&cfg).unwrap();
    assert!(!back.reused);
    assert_eq!(back.sources, first.sources);
    assert_eq!(files_of(&cfg.out_dir), files);
}

#[test]
fn bad_filter_settings_are_config_errors_naming_the_field() {
    let fx = Fixture::new("errors");
    for (q, field) in [
        (
            QualityConfig {
                drop_fraction: -0.1,
                ..QualityConfig::default()
            },
            "quality.drop_fraction",
        ),
        (
            QualityConfig {
                drop_fraction: 1.0,
                ..QualityConfig::default()
            },
            "quality.drop_fraction",
        ),
        (
            QualityConfig {
                drop_fraction: f64::NAN,
                ..QualityConfig::default()
            },
            "quality.drop_fraction",
        ),
        (
            QualityConfig {
                order: 0,
                ..QualityConfig::default()
            },
            "quality.order",
        ),
        (
            QualityConfig {
                order: 5,
                ..QualityConfig::default()
            },
            "quality.order",
        ),
    ] {
        let err = prepare_corpus(&fx.config("cache", Some(q.clone()))).unwrap_err();
        match &err {
            DataError::Config { name, .. } => assert_eq!(*name, field, "{q:?}: {err}"),
            other => panic!("{q:?}: {other}"),
        }
        assert!(
            err.to_string().starts_with(&format!("invalid {field}: ")),
            "{err}"
        );
        assert_eq!(q.validate().unwrap_err().to_string(), err.to_string());
    }
    // nothing was written
    assert!(!fx.root.join("cache").exists());
    // the serde form: every field defaults, an unknown one is refused
    let q: QualityConfig = serde_json::from_str(r#"{"drop_fraction": 0.05}"#).unwrap();
    assert_eq!(
        q,
        QualityConfig {
            order: 3,
            drop_fraction: 0.05,
            min_doc_tokens: 8
        }
    );
    assert!(serde_json::from_str::<QualityConfig>(r#"{"dropfraction": 0.05}"#).is_err());
    // a configuration written before the filter existed reads as "no filter"
    let old = r#"{"data_dir": "d", "out_dir": "o", "corpora": ["a"], "vocab_size": 600,
        "val_fraction": 0.05, "train_shards": 2, "tokenizer_sample_bytes": 1000}"#;
    assert_eq!(
        serde_json::from_str::<PrepareConfig>(old).unwrap().quality,
        None
    );
}

/// The cost of the filter on the repository's corpus with the default configurations (run
/// with `cargo test --release -p kiln-data --test prepare_quality -- --ignored --nocapture`).
#[test]
#[ignore = "prepares the whole corpus twice (about a minute in release mode)"]
fn time_on_the_real_corpus() {
    let data = PathBuf::from(format!("{}/../../data", env!("CARGO_MANIFEST_DIR")));
    let root = std::env::temp_dir().join(format!("kiln-data-quality-time-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut seconds = Vec::new();
    for (out, quality) in [
        ("plain", None),
        ("filtered", Some(QualityConfig::default())),
    ] {
        let cfg = PrepareConfig {
            quality,
            ..PrepareConfig::new(&data, root.join(out))
        };
        let t = std::time::Instant::now();
        let p = prepare_corpus(&cfg).unwrap();
        let s = t.elapsed().as_secs_f64();
        assert!(!p.reused);
        println!("prepare_corpus, quality {:?}: {s:.1} s", cfg.quality);
        for src in &p.sources {
            println!(
                "  {:<12} train {:>9} tokens  {:?}",
                src.name, src.train_tokens, src.quality
            );
        }
        seconds.push(s);
        if p.sources[0].quality.is_none() {
            continue;
        }
        // what was dropped, and the filter's own work timed alone through the public API
        // (the same steps: encode line by line, two models of half the documents each, score)
        let tok = p.load_tokenizer().unwrap();
        for src in &p.sources {
            let text = std::fs::read_to_string(data.join(format!("{}.txt", src.name))).unwrap();
            let train = split_validation(&text, 0.05).0;
            let docs = paragraphs(train);
            let docs = if docs.len() == 1 {
                train.split_inclusive('\n').map(str::to_string).collect()
            } else {
                docs
            };
            let t = std::time::Instant::now();
            let ids: Vec<Vec<u32>> = docs
                .iter()
                .map(|d| {
                    let lines: Vec<&str> = d.split_inclusive('\n').collect();
                    tok.encode_batch(&lines).unwrap().concat()
                })
                .collect();
            let encoded = t.elapsed().as_secs_f64();
            let mut scored = 0;
            for fold in 0..2 {
                let lm = NgramLm::train(
                    ids.iter().skip(1 - fold).step_by(2).map(|d| &d[..]),
                    3,
                    tok.vocab_size(),
                )
                .unwrap();
                for d in ids.iter().skip(fold).step_by(2) {
                    scored += usize::from(d.len() >= 8 && lm.perplexity(d).is_some());
                }
            }
            println!(
                "  {}: {} documents ({scored} scored): encoding {encoded:.2} s, models and scores {:.2} s",
                src.name,
                docs.len(),
                t.elapsed().as_secs_f64() - encoded
            );
            let t = tokens(&src.train);
            let kept = tok.decode(&t[..t.len() - 1]).unwrap();
            let mut at = 0;
            let mut shown = 0;
            for d in &docs {
                if kept[at..].starts_with(d.as_str()) {
                    at += d.len();
                } else if shown < 4 {
                    shown += 1;
                    let head: String = d.chars().take(90).collect();
                    println!("    dropped: {head:?}");
                }
            }
        }
    }
    println!("the filter costs {:.1} s", seconds[1] - seconds[0]);
    std::fs::remove_dir_all(&root).unwrap();
}
