//! Turning the plain-text corpus into a tokenizer and token shards under a cache directory,
//! once: a later call finds them, checks them and returns at once.

use crate::error::{DataError, Result};
use crate::fsutil;
use crate::shard::{Shard, ShardLayout, ShardWriter, TokenDtype, Verify};
use crate::source::TokenSource;
use crate::tokenizer::{sample_text, Tokenizer};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The corpora of the repository's `data/` folder.
pub const DEFAULT_CORPORA: [&str; 3] = ["shakespeare", "austen", "web_bible"];

/// The cache directory used when none is given: `$KILN_DATA_CACHE`, else `.cache/kiln-data`.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("KILN_DATA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cache/kiln-data"))
}

/// What [`prepare_corpus`] builds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrepareConfig {
    /// Folder with `{name}.txt` for every corpus.
    pub data_dir: PathBuf,
    /// The cache folder written to.
    pub out_dir: PathBuf,
    /// Corpus names (file stems); each becomes one source.
    pub corpora: Vec<String>,
    /// Tokenizer vocabulary size.
    pub vocab_size: usize,
    /// Fraction of each file, at its end, held out as the validation split.
    pub val_fraction: f64,
    /// Training shards per corpus.
    pub train_shards: usize,
    /// Bytes of text (spread evenly over the training splits) the tokenizer is trained on.
    pub tokenizer_sample_bytes: usize,
}

impl PrepareConfig {
    /// The three default corpora of `data_dir`, vocabulary 8192, the last 5% of each file for
    /// validation, 4 training shards per corpus, the tokenizer trained on 4 MiB of text.
    pub fn new(data_dir: impl Into<PathBuf>, out_dir: impl Into<PathBuf>) -> Self {
        PrepareConfig {
            data_dir: data_dir.into(),
            out_dir: out_dir.into(),
            corpora: DEFAULT_CORPORA.iter().map(|s| s.to_string()).collect(),
            vocab_size: 8192,
            val_fraction: 0.05,
            train_shards: 4,
            tokenizer_sample_bytes: 4 << 20,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.corpora.is_empty() {
            return Err(DataError::config("corpora", "no corpus"));
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(DataError::config(
                "val_fraction",
                format!("{} is not in [0, 1)", self.val_fraction),
            ));
        }
        if self.train_shards == 0 {
            return Err(DataError::config("train_shards", "0"));
        }
        Ok(())
    }
}

/// One corpus after preparation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedSource {
    /// The corpus name.
    pub name: String,
    /// Training shards, in order.
    pub train: Vec<PathBuf>,
    /// Validation shards, in order.
    pub val: Vec<PathBuf>,
    /// Tokens in the training split (its end-of-text included).
    pub train_tokens: u64,
    /// Tokens in the validation split (its end-of-text included).
    pub val_tokens: u64,
    /// Bytes of the text file.
    pub input_bytes: u64,
    /// CRC-32 of the text file (a change triggers a rebuild).
    pub input_crc32: u32,
}

/// The result of [`prepare_corpus`]: where the tokenizer and the shards are. Paths in the
/// manifest file are relative to the cache folder, so the folder can be moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedCorpus {
    /// The configuration it was built with (folders excluded from the comparison).
    pub config: PrepareConfig,
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// The tokenizer's vocabulary size.
    pub vocab_size: usize,
    /// The end-of-text id closing every split.
    pub eot: u32,
    /// Token dtype of the shards.
    pub dtype: TokenDtype,
    /// The corpora.
    pub sources: Vec<PreparedSource>,
    /// Whether the call found everything in place and built nothing.
    #[serde(skip)]
    pub reused: bool,
}

impl PreparedCorpus {
    /// The training splits as sources (one per corpus).
    pub fn train_sources(&self, verify: Verify) -> Result<Vec<TokenSource>> {
        self.sources
            .iter()
            .map(|s| TokenSource::open(s.name.clone(), &s.train, verify))
            .collect()
    }

    /// The validation splits as sources (one per corpus).
    pub fn val_sources(&self, verify: Verify) -> Result<Vec<TokenSource>> {
        self.sources
            .iter()
            .map(|s| TokenSource::open(format!("{}/val", s.name), &s.val, verify))
            .collect()
    }

    /// Loads the tokenizer.
    pub fn load_tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::from_file(&self.tokenizer)
    }

    fn relative_to(&self, dir: &Path) -> Self {
        let rel = |p: &PathBuf| {
            p.strip_prefix(dir)
                .map(Path::to_path_buf)
                .unwrap_or_else(|_| p.clone())
        };
        let mut m = self.clone();
        m.tokenizer = rel(&m.tokenizer);
        for s in &mut m.sources {
            s.train = s.train.iter().map(rel).collect();
            s.val = s.val.iter().map(rel).collect();
        }
        m
    }

    fn resolved_in(mut self, dir: &Path) -> Self {
        self.tokenizer = dir.join(&self.tokenizer);
        for s in &mut self.sources {
            s.train = s.train.iter().map(|p| dir.join(p)).collect();
            s.val = s.val.iter().map(|p| dir.join(p)).collect();
        }
        self
    }
}

/// Splits `text` into (train, validation): validation is the last `fraction` of the bytes,
/// starting at the first line start at or after that point.
pub fn split_validation(text: &str, fraction: f64) -> (&str, &str) {
    let mut at = ((text.len() as f64) * (1.0 - fraction)).floor() as usize;
    at = at.min(text.len());
    while at < text.len() && !text.is_char_boundary(at) {
        at += 1;
    }
    if at > 0 && at < text.len() && text.as_bytes()[at - 1] != b'\n' {
        at = text[at..].find('\n').map_or(text.len(), |nl| at + nl + 1);
    }
    text.split_at(at)
}

const MANIFEST: &str = "manifest.json";

fn same_build(a: &PrepareConfig, b: &PrepareConfig) -> bool {
    (
        &a.corpora,
        a.vocab_size,
        a.val_fraction.to_bits(),
        a.train_shards,
        a.tokenizer_sample_bytes,
    ) == (
        &b.corpora,
        b.vocab_size,
        b.val_fraction.to_bits(),
        b.train_shards,
        b.tokenizer_sample_bytes,
    )
}

/// Whether a previous build in `cfg.out_dir` is complete, matches `cfg` and the text files,
/// and every shard passes its checks.
fn reuse(cfg: &PrepareConfig, inputs: &[(u64, u32)]) -> Option<PreparedCorpus> {
    let text = std::fs::read_to_string(cfg.out_dir.join(MANIFEST)).ok()?;
    let m: PreparedCorpus = serde_json::from_str(&text).ok()?;
    let m = m.resolved_in(&cfg.out_dir);
    if !same_build(&m.config, cfg) || m.sources.len() != inputs.len() {
        return None;
    }
    for (s, &(bytes, crc)) in m.sources.iter().zip(inputs) {
        if (s.input_bytes, s.input_crc32) != (bytes, crc) {
            return None;
        }
        let total = |paths: &[PathBuf]| -> Option<u64> {
            paths
                .iter()
                .map(|p| Shard::open(p).ok().map(|s| s.len()))
                .sum()
        };
        if total(&s.train)? != s.train_tokens || total(&s.val)? != s.val_tokens {
            return None;
        }
    }
    let tok = Tokenizer::from_file(&m.tokenizer).ok()?;
    (tok.vocab_size() == m.vocab_size && tok.eot() == m.eot)
        .then_some(PreparedCorpus { reused: true, ..m })
}

fn encode_text(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut out = Vec::with_capacity(text.len() / 3);
    for chunk in lines.chunks(4096) {
        for ids in tok.encode_batch(chunk)? {
            out.extend_from_slice(&ids);
        }
    }
    out.push(tok.eot());
    Ok(out)
}

/// Builds, under `cfg.out_dir`, a BPE tokenizer trained on the corpora's training splits and,
/// for each corpus `name`, `name/train_NNNNN.bin` and `name/val_NNNNN.bin` token shards (each
/// split closed by an end-of-text token), then `manifest.json` last. Idempotent: when the
/// manifest matches the configuration and the text files and every shard verifies, nothing is
/// rebuilt (`reused` is set). Deterministic: the same inputs give the same files, so processes
/// racing to prepare the same folder write identical files (each write is an atomic rename).
pub fn prepare_corpus(cfg: &PrepareConfig) -> Result<PreparedCorpus> {
    cfg.validate()?;
    let mut texts = Vec::with_capacity(cfg.corpora.len());
    let mut inputs = Vec::with_capacity(cfg.corpora.len());
    for name in &cfg.corpora {
        let path = cfg.data_dir.join(format!("{name}.txt"));
        let bytes = std::fs::read(&path).map_err(|e| DataError::file("read", &path, e))?;
        inputs.push((bytes.len() as u64, crc32fast::hash(&bytes)));
        let text = String::from_utf8(bytes).map_err(|e| {
            DataError::file(
                "read",
                &path,
                std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            )
        })?;
        texts.push(text);
    }
    if let Some(m) = reuse(cfg, &inputs) {
        return Ok(m);
    }
    let splits: Vec<(&str, &str)> = texts
        .iter()
        .map(|t| split_validation(t, cfg.val_fraction))
        .collect();
    let per_corpus = cfg.tokenizer_sample_bytes / cfg.corpora.len();
    let sample: Vec<&str> = splits
        .iter()
        .flat_map(|(train, _)| sample_text(train, per_corpus))
        .collect();
    let tok = Tokenizer::train_bpe(
        sample.iter().flat_map(|b| b.split_inclusive('\n')),
        cfg.vocab_size,
    )?;
    let tokenizer = cfg.out_dir.join("tokenizer.json");
    tok.save(&tokenizer)?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let mut sources = Vec::with_capacity(cfg.corpora.len());
    for ((name, (train, val)), &(input_bytes, input_crc32)) in
        cfg.corpora.iter().zip(&splits).zip(&inputs)
    {
        let dir = cfg.out_dir.join(name);
        let write = |stem: &str, text: &str, shards: usize| -> Result<(Vec<PathBuf>, u64)> {
            let ids = encode_text(&tok, text)?;
            let mut w = ShardWriter::new(&dir, stem, dtype, ShardLayout::Count(shards))?;
            w.push(&ids)?;
            Ok((w.finish()?, ids.len() as u64))
        };
        let (train, train_tokens) = write("train", train, cfg.train_shards)?;
        let (val, val_tokens) = write("val", val, 1)?;
        sources.push(PreparedSource {
            name: name.clone(),
            train,
            val,
            train_tokens,
            val_tokens,
            input_bytes,
            input_crc32,
        });
    }
    let prepared = PreparedCorpus {
        config: cfg.clone(),
        tokenizer,
        vocab_size: tok.vocab_size(),
        eot: tok.eot(),
        dtype,
        sources,
        reused: false,
    };
    let manifest = prepared.relative_to(&cfg.out_dir);
    let json = serde_json::to_string_pretty(&manifest).map_err(|source| DataError::Json {
        what: format!("write {}", cfg.out_dir.join(MANIFEST).display()),
        source,
    })?;
    fsutil::write_atomic(&cfg.out_dir.join(MANIFEST), json.as_bytes())?;
    Ok(prepared)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_split_starts_at_a_line() {
        let text = "aaaa\nbbbb\ncccc\ndddd\n";
        assert_eq!(
            split_validation(text, 0.25),
            ("aaaa\nbbbb\ncccc\n", "dddd\n")
        );
        assert_eq!(
            split_validation(text, 0.3),
            ("aaaa\nbbbb\ncccc\n", "dddd\n")
        );
        assert_eq!(split_validation(text, 0.0), (text, ""));
        assert_eq!(split_validation("no newline", 0.5), ("no newline", ""));
        let (a, b) = split_validation("é\né\né\n", 0.5);
        assert_eq!(format!("{a}{b}"), "é\né\né\n");
    }
}
