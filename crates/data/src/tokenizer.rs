//! Byte-level BPE tokenizers: one trained in-process on a corpus with the `tokenizers` crate, or
//! GPT-2's own (r50k_base, the GPT-3 vocabulary) through `tiktoken-rs` behind the `gpt2-bpe`
//! feature.

use crate::error::{DataError, Result};
use crate::fsutil;
use std::path::Path;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// The end-of-text special token, GPT-2's spelling; appended after every document.
pub const EOT_TOKEN: &str = "<|endoftext|>";

enum Inner {
    Bpe(Box<tokenizers::Tokenizer>),
    #[cfg(feature = "gpt2-bpe")]
    Gpt2(Box<tiktoken_rs::CoreBPE>),
}

/// A byte-level BPE tokenizer with an end-of-text token: any string round-trips through
/// [`Tokenizer::encode`] and [`Tokenizer::decode`].
pub struct Tokenizer {
    inner: Inner,
    eot: u32,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab_size)
            .field("eot", &self.eot)
            .finish()
    }
}

fn byte_level() -> ByteLevel {
    // GPT-2's settings: no prefix space, its split regex.
    ByteLevel::new(false, true, true)
}

impl Tokenizer {
    /// Trains a byte-level BPE with `vocab_size` entries (the 256 byte symbols, [`EOT_TOKEN`] and
    /// the merges) on `texts`. Pairs seen once are not merged, so a small corpus may give a
    /// smaller vocabulary than asked; [`Tokenizer::vocab_size`] says what was reached. Training
    /// is deterministic: the same texts give the same `tokenizer.json`.
    pub fn train_bpe<I, S>(texts: I, vocab_size: usize) -> Result<Self>
    where
        I: Iterator<Item = S> + Send,
        S: AsRef<str> + Send,
    {
        if vocab_size < 258 {
            return Err(DataError::config(
                "vocab_size",
                format!("{vocab_size} is below 258 (256 bytes, the end-of-text token, one merge)"),
            ));
        }
        let trainer = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab_size)
            .min_frequency(2)
            .special_tokens(vec![AddedToken::from(EOT_TOKEN, true)])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut trainer = TrainerWrapper::BpeTrainer(trainer);
        let mut tk = tokenizers::Tokenizer::new(BPE::default());
        tk.with_pre_tokenizer(Some(byte_level()));
        tk.with_decoder(Some(byte_level()));
        tk.train(&mut trainer, texts)
            .map_err(|e| DataError::tokenizer("train", e))?;
        Self::from_hf(tk)
    }

    fn from_hf(tk: tokenizers::Tokenizer) -> Result<Self> {
        let eot = tk
            .token_to_id(EOT_TOKEN)
            .ok_or_else(|| DataError::Tokenizer {
                op: "load",
                message: format!("the vocabulary has no {EOT_TOKEN} token"),
            })?;
        let vocab_size = tk.get_vocab_size(true);
        Ok(Tokenizer {
            inner: Inner::Bpe(Box::new(tk)),
            eot,
            vocab_size,
        })
    }

    /// Loads a `tokenizer.json` (the Hugging Face format) that has an [`EOT_TOKEN`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let tk = tokenizers::Tokenizer::from_file(path).map_err(|e| DataError::Tokenizer {
            op: "load",
            message: format!("{}: {e}", path.display()),
        })?;
        Self::from_hf(tk)
    }

    /// GPT-2's byte-level BPE (r50k_base, 50257 tokens, end-of-text 50256), the vocabulary of
    /// GPT-2 and GPT-3.
    #[cfg(feature = "gpt2-bpe")]
    pub fn gpt2() -> Result<Self> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::tokenizer("load", e))?;
        let eot = bpe
            .encode_with_special_tokens(EOT_TOKEN)
            .first()
            .copied()
            .ok_or_else(|| DataError::tokenizer("load", "r50k_base has no end-of-text token"))?;
        Ok(Tokenizer {
            inner: Inner::Gpt2(Box::new(bpe)),
            eot,
            vocab_size: eot as usize + 1,
        })
    }

    /// Writes `tokenizer.json` atomically (a temporary file renamed into place). The GPT-2
    /// tokenizer is built in and has nothing to save: that is an error.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        match &self.inner {
            Inner::Bpe(tk) => {
                let json = tk
                    .to_string(false)
                    .map_err(|e| DataError::tokenizer("save", e))?;
                fsutil::write_atomic(path, json.as_bytes())
            }
            #[cfg(feature = "gpt2-bpe")]
            Inner::Gpt2(_) => Err(DataError::tokenizer(
                "save",
                "the gpt2 tokenizer is built in (r50k_base) and has no tokenizer.json",
            )),
        }
    }

    /// "bpe" for a trained or loaded tokenizer, "gpt2" for r50k_base.
    pub fn kind(&self) -> &'static str {
        match &self.inner {
            Inner::Bpe(_) => "bpe",
            #[cfg(feature = "gpt2-bpe")]
            Inner::Gpt2(_) => "gpt2",
        }
    }

    /// Token ids of `text`; an [`EOT_TOKEN`] spelled in the text becomes the end-of-text id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Bpe(tk) => Ok(tk
                .encode_fast(text, false)
                .map_err(|e| DataError::tokenizer("encode", e))?
                .get_ids()
                .to_vec()),
            #[cfg(feature = "gpt2-bpe")]
            Inner::Gpt2(bpe) => Ok(bpe.encode_with_special_tokens(text)),
        }
    }

    /// Token ids of many texts, encoded in parallel; the same as [`Tokenizer::encode`] on each.
    pub fn encode_batch(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        match &self.inner {
            Inner::Bpe(tk) => Ok(tk
                .encode_batch_fast(texts.to_vec(), false)
                .map_err(|e| DataError::tokenizer("encode", e))?
                .iter()
                .map(|e| e.get_ids().to_vec())
                .collect()),
            #[cfg(feature = "gpt2-bpe")]
            Inner::Gpt2(_) => texts.iter().map(|t| self.encode(t)).collect(),
        }
    }

    /// The text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(DataError::Tokenizer {
                op: "decode",
                message: format!(
                    "token {bad} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            });
        }
        match &self.inner {
            Inner::Bpe(tk) => tk
                .decode(ids, false)
                .map_err(|e| DataError::tokenizer("decode", e)),
            #[cfg(feature = "gpt2-bpe")]
            Inner::Gpt2(bpe) => bpe
                .decode(ids.to_vec())
                .map_err(|e| DataError::tokenizer("decode", e)),
        }
    }

    /// Number of token ids (special tokens included): every id is below it.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The end-of-text token id.
    pub fn eot(&self) -> u32 {
        self.eot
    }
}

/// A deterministic sample of about `max_bytes` of `text` for tokenizer training: the text cut
/// into blocks of about 16 KiB at line ends, and evenly spaced blocks kept, so every part of the
/// corpus is represented. The whole text when it is no longer than `max_bytes`.
pub fn sample_text(text: &str, max_bytes: usize) -> Vec<&str> {
    const BLOCK: usize = 16 * 1024;
    if text.len() <= max_bytes {
        return vec![text];
    }
    let mut blocks = Vec::with_capacity(text.len() / BLOCK + 1);
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + BLOCK).min(text.len());
        while end < text.len() && !text.is_char_boundary(end) {
            end += 1;
        }
        if let Some(nl) = text[end..].find('\n') {
            end += nl + 1;
        } else {
            end = text.len();
        }
        blocks.push(&text[start..end]);
        start = end;
    }
    let keep = (max_bytes / BLOCK).clamp(1, blocks.len());
    (0..keep).map(|i| blocks[i * blocks.len() / keep]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/shakespeare.txt");
        let text = std::fs::read_to_string(path).unwrap();
        let mut end = 100_000;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text[..end].to_string()
    }

    #[test]
    fn trained_bpe_round_trips_and_is_deterministic() {
        let corpus = corpus();
        let a = Tokenizer::train_bpe(corpus.lines(), 512).unwrap();
        let b = Tokenizer::train_bpe(corpus.lines(), 512).unwrap();
        assert_eq!(a.vocab_size(), 512);
        assert_eq!(a.eot(), 0);
        let text = "the cat sat on the log, café ☕ <|endoftext|>x";
        let ids = a.encode(text).unwrap();
        assert_eq!(a.decode(&ids).unwrap(), text);
        assert!(ids.contains(&a.eot()));
        assert!(ids.iter().all(|&t| (t as usize) < a.vocab_size()));
        // merges learned: the frequent word is one token, fewer tokens than bytes
        assert_eq!(a.encode(" the").unwrap().len(), 1);
        assert!(ids.len() < text.len() / 2);
        assert_eq!(ids, b.encode(text).unwrap());
        // batch encoding is the same as one by one
        let batch = a.encode_batch(&["the cat", " sat", ""]).unwrap();
        assert_eq!(batch[0], a.encode("the cat").unwrap());
        assert_eq!(batch[1], a.encode(" sat").unwrap());
        assert!(batch[2].is_empty());
        // save and load give the same tokenizer, byte for byte
        let dir = std::env::temp_dir().join(format!("kiln-data-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (pa, pb) = (dir.join("a.json"), dir.join("b.json"));
        a.save(&pa).unwrap();
        b.save(&pb).unwrap();
        assert_eq!(std::fs::read(&pa).unwrap(), std::fs::read(&pb).unwrap());
        let c = Tokenizer::from_file(&pa).unwrap();
        assert_eq!(c.encode(text).unwrap(), ids);
        assert_eq!(c.vocab_size(), 512);
        assert!(a.decode(&[512]).is_err());
        assert!(matches!(
            Tokenizer::from_file(dir.join("missing.json")),
            Err(DataError::Tokenizer { op: "load", .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sample_text_is_evenly_spaced_lines() {
        let text: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
        let s = sample_text(&text, 40_000);
        let total: usize = s.iter().map(|b| b.len()).sum();
        assert!(
            (30_000..=40_000 + 2 * 16 * 1024).contains(&total),
            "{total}"
        );
        assert!(s.iter().all(|b| b.ends_with('\n') && b.starts_with("line")));
        assert_eq!(s[0], &text[..s[0].len()]);
        assert_eq!(sample_text("short", 100), vec!["short"]);
    }

    #[cfg(feature = "gpt2-bpe")]
    #[test]
    fn gpt2_known_ids() {
        let t = Tokenizer::gpt2().unwrap();
        assert_eq!(t.vocab_size(), 50257);
        assert_eq!(t.eot(), 50256);
        // "hello world" is [31373, 995] in GPT-2
        assert_eq!(t.encode("hello world").unwrap(), vec![31373, 995]);
        assert_eq!(t.decode(&[31373, 995]).unwrap(), "hello world");
    }
}
