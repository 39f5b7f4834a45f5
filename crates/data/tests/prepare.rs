//! Corpus preparation: the tokenizer and shards round-trip the text exactly, the validation
//! split is the end of each file, and a second call reuses what is there unless it changed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_data::{prepare_corpus, split_validation, PrepareConfig, TokenShard, Verify};
use std::path::PathBuf;

fn corpus_head(name: &str, bytes: usize) -> String {
    let path = format!("{}/../../data/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let mut end = bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[test]
fn prepare_round_trips_holds_out_the_end_and_is_idempotent() {
    let root = std::env::temp_dir().join(format!("kiln-data-prepare-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let names = ["shakespeare", "austen", "web_bible"];
    for n in names {
        std::fs::write(data.join(format!("{n}.txt")), corpus_head(n, 60_000)).unwrap();
    }
    let cfg = PrepareConfig {
        vocab_size: 600,
        train_shards: 3,
        tokenizer_sample_bytes: 90_000,
        ..PrepareConfig::new(&data, root.join("cache"))
    };
    let p = prepare_corpus(&cfg).unwrap();
    assert!(!p.reused);
    assert_eq!(p.vocab_size, 600);
    let tok = p.load_tokenizer().unwrap();
    for (s, n) in p.sources.iter().zip(names) {
        assert_eq!(s.name, n);
        assert_eq!((s.train.len(), s.val.len()), (3, 1));
        let text = std::fs::read_to_string(data.join(format!("{n}.txt"))).unwrap();
        let (train, val) = split_validation(&text, 0.05);
        assert!(val.len() >= 2_900 && val.len() <= 3_200, "{}", val.len());
        assert!(text.ends_with(val) && train.len() + val.len() == text.len());
        let read = |paths: &[PathBuf]| -> Vec<u32> {
            paths
                .iter()
                .flat_map(|p| TokenShard::open(p).unwrap().to_vec())
                .collect()
        };
        let (t, v) = (read(&s.train), read(&s.val));
        assert_eq!(
            (t.len() as u64, v.len() as u64),
            (s.train_tokens, s.val_tokens)
        );
        // each split is its text, then end-of-text
        assert_eq!(*t.last().unwrap(), p.eot);
        assert_eq!(tok.decode(&t[..t.len() - 1]).unwrap(), train);
        assert_eq!(tok.decode(&v[..v.len() - 1]).unwrap(), val);
        // BPE compresses: at least 2 bytes per token on English with 600 entries
        assert!(train.len() as f64 / t.len() as f64 > 2.0);
    }
    let sources = p.train_sources(Verify::Full).unwrap();
    assert_eq!(sources.len(), 3);
    assert_eq!(
        p.val_sources(Verify::Full).unwrap()[2].name(),
        "web_bible/val"
    );

    // a second call finds everything in place
    let again = prepare_corpus(&cfg).unwrap();
    assert!(again.reused);
    assert_eq!(again.sources, p.sources);

    // a damaged shard is noticed and rebuilt, to the same bytes
    let victim = p.sources[1].train[1].clone();
    let good = std::fs::read(&victim).unwrap();
    let mut bad = good.clone();
    bad[100] ^= 0xff;
    std::fs::write(&victim, &bad).unwrap();
    let rebuilt = prepare_corpus(&cfg).unwrap();
    assert!(!rebuilt.reused);
    assert_eq!(std::fs::read(&victim).unwrap(), good);

    // a changed text file or configuration rebuilds too
    let mut moved = cfg.clone();
    moved.val_fraction = 0.1;
    assert!(!prepare_corpus(&moved).unwrap().reused);
    std::fs::write(data.join("austen.txt"), corpus_head("austen", 50_000)).unwrap();
    assert!(!prepare_corpus(&moved).unwrap().reused);
    assert!(prepare_corpus(&moved).unwrap().reused);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A given tokenizer (a model's, to fine-tune it) is used instead of training one: copied into
/// the cache, the shards in its ids; another tokenizer's content rebuilds; a vocabulary other
/// than the configured one is an error naming the file.
#[test]
fn a_given_tokenizer_is_used_and_checked() {
    let root = std::env::temp_dir().join(format!("kiln-data-given-tok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("austen.txt"), corpus_head("austen", 40_000)).unwrap();
    std::fs::write(data.join("bible.txt"), corpus_head("web_bible", 40_000)).unwrap();
    // two tokenizers of 500 entries, trained on other texts than the corpus
    let make = |name: &str, text: &str| {
        let tok = kiln_data::Tokenizer::train_bpe(text.split_inclusive('\n'), 500).unwrap();
        let path = root.join(name);
        tok.save(&path).unwrap();
        (tok, path)
    };
    let (tok_a, path_a) = make("a.json", &corpus_head("shakespeare", 60_000));
    let (_, path_b) = make("b.json", &corpus_head("web_bible", 60_000));
    let cfg = PrepareConfig {
        corpora: vec!["austen".into()],
        vocab_size: 500,
        train_shards: 1,
        tokenizer: Some(path_a.clone()),
        ..PrepareConfig::new(&data, root.join("cache"))
    };
    let p = prepare_corpus(&cfg).unwrap();
    assert_eq!(
        std::fs::read(&p.tokenizer).unwrap(),
        std::fs::read(&path_a).unwrap()
    );
    let austen = corpus_head("austen", 40_000);
    let (train, _) = split_validation(&austen, cfg.val_fraction);
    let shard = TokenShard::open(&p.sources[0].train[0]).unwrap();
    let mut ids = vec![0u32; shard.len() as usize];
    shard.read(0, &mut ids).unwrap();
    let mut want = tok_a.encode(train).unwrap();
    want.push(tok_a.eot());
    assert_eq!(ids, want, "the shard holds the given tokenizer's ids");
    assert!(prepare_corpus(&cfg).unwrap().reused);
    // the same path with another tokenizer in it: rebuilt with that one
    std::fs::copy(&path_b, &path_a).unwrap();
    let again = prepare_corpus(&cfg).unwrap();
    assert!(!again.reused);
    assert_eq!(
        std::fs::read(&again.tokenizer).unwrap(),
        std::fs::read(&path_b).unwrap()
    );
    // a vocabulary that is not the model's
    let err = prepare_corpus(&PrepareConfig {
        vocab_size: 512,
        out_dir: root.join("cache2"),
        ..cfg.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("a.json") && err.contains("500") && err.contains("512"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
