//! Turning the plain-text corpus into a tokenizer and token shards under a cache directory,
//! once: a later call finds them, checks them and returns at once. With
//! [`PrepareConfig::quality`] set, each source's training split passes the perplexity filter
//! of [`crate::quality`] on its way to the shards.

use crate::error::{DataError, Result};
use crate::fsutil;
use crate::quality::{documents, filter_documents, QualityConfig, QualityReport};
use crate::shard::{ShardLayout, ShardWriter, TokenDtype, TokenShard, Verify};
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
    /// The perplexity filter applied to each training split after the tokenizer is trained
    /// (`None`: every document is kept). The tokenizer and the validation splits are the same
    /// with or without it.
    #[serde(default)]
    pub quality: Option<QualityConfig>,
    /// A tokenizer to use instead of training one (`tokenizer.json`, the `tokenizers`
    /// library's format; e.g. the one of a model to fine-tune): copied into the cache folder,
    /// its vocabulary must be `vocab_size`. A change of its content rebuilds the shards.
    /// `None`: a BPE tokenizer is trained on the corpora.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
}

impl PrepareConfig {
    /// The three default corpora of `data_dir`, vocabulary 8192, the last 5% of each file for
    /// validation, 4 training shards per corpus, the tokenizer trained on 4 MiB of text, no
    /// quality filter.
    pub fn new(data_dir: impl Into<PathBuf>, out_dir: impl Into<PathBuf>) -> Self {
        PrepareConfig {
            data_dir: data_dir.into(),
            out_dir: out_dir.into(),
            corpora: DEFAULT_CORPORA.iter().map(|s| s.to_string()).collect(),
            vocab_size: 8192,
            val_fraction: 0.05,
            train_shards: 4,
            tokenizer_sample_bytes: 4 << 20,
            quality: None,
            tokenizer: None,
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
        if let Some(q) = &self.quality {
            q.validate()?;
        }
        Ok(())
    }
}

/// One corpus after preparation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedSource {
    /// The corpus name.
    pub name: String,
    /// Training shards, in order.
    pub train: Vec<PathBuf>,
    /// Validation shards, in order.
    pub val: Vec<PathBuf>,
    /// Tokens in the training shards: the training split after the quality filter, and its
    /// end-of-text.
    pub train_tokens: u64,
    /// Tokens in the validation split (its end-of-text included).
    pub val_tokens: u64,
    /// Bytes of the text file.
    pub input_bytes: u64,
    /// CRC-32 of the text file (a change triggers a rebuild).
    pub input_crc32: u32,
    /// What the quality filter kept and dropped of the training split (`None` when
    /// [`PrepareConfig::quality`] is).
    #[serde(default)]
    pub quality: Option<QualityReport>,
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
    let quality = |q: &Option<QualityConfig>| {
        q.as_ref()
            .map(|q| (q.order, q.drop_fraction.to_bits(), q.min_doc_tokens))
    };
    (
        &a.corpora,
        a.vocab_size,
        a.val_fraction.to_bits(),
        a.train_shards,
        a.tokenizer_sample_bytes,
        quality(&a.quality),
        a.tokenizer.is_some(),
    ) == (
        &b.corpora,
        b.vocab_size,
        b.val_fraction.to_bits(),
        b.train_shards,
        b.tokenizer_sample_bytes,
        quality(&b.quality),
        b.tokenizer.is_some(),
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
        if (s.input_bytes, s.input_crc32) != (bytes, crc)
            || s.quality.is_some() != cfg.quality.is_some()
        {
            return None;
        }
        let total = |paths: &[PathBuf]| -> Option<u64> {
            paths
                .iter()
                .map(|p| TokenShard::open(p).ok().map(|s| s.len()))
                .sum()
        };
        if total(&s.train)? != s.train_tokens || total(&s.val)? != s.val_tokens {
            return None;
        }
    }
    if let Some(given) = &cfg.tokenizer {
        // the same path may hold another tokenizer now
        if std::fs::read(given).ok()? != std::fs::read(&m.tokenizer).ok()? {
            return None;
        }
    }
    let tok = Tokenizer::from_file(&m.tokenizer).ok()?;
    (tok.vocab_size() == m.vocab_size && tok.eot() == m.eot)
        .then_some(PreparedCorpus { reused: true, ..m })
}

/// The token ids of each line (lines never share a token, so their concatenation is the
/// text's encoding).
fn encode_lines(tok: &Tokenizer, lines: &[&str]) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::with_capacity(lines.len());
    for chunk in lines.chunks(4096) {
        out.extend(tok.encode_batch(chunk)?);
    }
    Ok(out)
}

/// The split's tokens, closed by end-of-text.
fn encode_text(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut out = Vec::with_capacity(text.len() / 3);
    for ids in encode_lines(tok, &lines)? {
        out.extend_from_slice(&ids);
    }
    out.push(tok.eot());
    Ok(out)
}

/// The training split's tokens after the quality filter, closed by end-of-text: the kept
/// documents in their order. With nothing dropped these are [`encode_text`]'s tokens.
fn encode_filtered(
    tok: &Tokenizer,
    text: &str,
    cfg: &QualityConfig,
) -> Result<(Vec<u32>, QualityReport)> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let line_ids = encode_lines(tok, &lines)?;
    let docs: Vec<Vec<u32>> = documents(&lines)
        .into_iter()
        .map(|r| line_ids[r].concat())
        .collect();
    let (keep, report) = filter_documents(cfg, &docs, tok.vocab_size())?;
    let capacity = usize::try_from(report.tokens_kept).unwrap_or(0) + 1;
    let mut out = Vec::with_capacity(capacity);
    for (d, k) in docs.iter().zip(keep) {
        if k {
            out.extend_from_slice(d);
        }
    }
    out.push(tok.eot());
    Ok((out, report))
}

/// Builds, under `cfg.out_dir`, a BPE tokenizer trained on the corpora's training splits and,
/// for each corpus `name`, `name/train_NNNNN.bin` and `name/val_NNNNN.bin` token shards (each
/// split closed by an end-of-text token), then `manifest.json` last. Idempotent: when the
/// manifest matches the configuration and the text files and every shard verifies, nothing is
/// rebuilt (`reused` is set). Deterministic: the same inputs give the same files, so processes
/// racing to prepare the same folder write identical files (each write is an atomic rename).
///
/// With [`PrepareConfig::quality`] set, each corpus's training split is cut into documents
/// (paragraphs separated by blank lines; lines when the split has no blank line), an n-gram
/// model trained on them scores each, and the documents above the `1 - drop_fraction`
/// quantile of perplexity are left out of the training shards, the counts recorded in
/// [`PreparedSource::quality`]. The tokenizer is trained before, on the unfiltered text, and
/// the validation split is never filtered.
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
    let tokenizer = cfg.out_dir.join("tokenizer.json");
    let tok = match &cfg.tokenizer {
        Some(given) => {
            let tok = Tokenizer::from_file(given)?;
            if tok.vocab_size() != cfg.vocab_size {
                return Err(DataError::config(
                    "tokenizer",
                    format!(
                        "{} has a vocabulary of {} entries, the model {}",
                        given.display(),
                        tok.vocab_size(),
                        cfg.vocab_size
                    ),
                ));
            }
            let bytes = std::fs::read(given).map_err(|e| DataError::file("read", given, e))?;
            std::fs::create_dir_all(&cfg.out_dir)
                .map_err(|e| DataError::file("create", &cfg.out_dir, e))?;
            crate::fsutil::write_atomic(&tokenizer, &bytes)?;
            tok
        }
        None => {
            let per_corpus = cfg.tokenizer_sample_bytes / cfg.corpora.len();
            let sample: Vec<&str> = splits
                .iter()
                .flat_map(|(train, _)| sample_text(train, per_corpus))
                .collect();
            let tok = Tokenizer::train_bpe(
                sample.iter().flat_map(|b| b.split_inclusive('\n')),
                cfg.vocab_size,
            )?;
            tok.save(&tokenizer)?;
            tok
        }
    };
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let mut sources = Vec::with_capacity(cfg.corpora.len());
    for ((name, (train, val)), &(input_bytes, input_crc32)) in
        cfg.corpora.iter().zip(&splits).zip(&inputs)
    {
        let dir = cfg.out_dir.join(name);
        let write = |stem: &str, ids: &[u32], shards: usize| -> Result<(Vec<PathBuf>, u64)> {
            let mut w = ShardWriter::new(&dir, stem, dtype, ShardLayout::Count(shards))?;
            w.push(ids)?;
            Ok((w.finish()?, ids.len() as u64))
        };
        let (train_ids, quality) = match &cfg.quality {
            Some(q) => {
                let (ids, report) = encode_filtered(&tok, train, q)?;
                (ids, Some(report))
            }
            None => (encode_text(&tok, train)?, None),
        };
        let (train, train_tokens) = write("train", &train_ids, cfg.train_shards)?;
        drop(train_ids);
        let (val, val_tokens) = write("val", &encode_text(&tok, val)?, 1)?;
        sources.push(PreparedSource {
            name: name.clone(),
            train,
            val,
            train_tokens,
            val_tokens,
            input_bytes,
            input_crc32,
            quality,
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
