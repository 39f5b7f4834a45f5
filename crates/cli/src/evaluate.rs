//! `kiln evaluate`: how well a trained model predicts a text. Loads a kiln checkpoint (any dp,
//! tp and ZeRO layout) or a Hugging Face GPT-2 export folder, tokenizes a text file, cuts it
//! into non-overlapping windows of the model's context (each with its next tokens as targets;
//! the last partial window is dropped), and prints the mean next-token cross-entropy over every
//! window in nats, the perplexity `exp(loss)`, and the same as one JSON line
//! (`{"tokens":..,"loss":..,"perplexity":..}`).

use crate::model_args::ModelArgs;
use anyhow::{bail, Context};
use candle_core::{DType, Tensor};
use kiln_data::Tokenizer;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `kiln evaluate`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example:\n  kiln evaluate runs/train_gpt/checkpoints --text data/austen.txt"
)]
pub struct EvaluateArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text file to evaluate on
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Evaluate at most N tokens (whole windows of the model's context)
    #[arg(long, value_name = "N", default_value_t = 65536)]
    pub max_tokens: usize,
    /// Windows per forward pass
    #[arg(long, value_name = "B", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: u64,
}

/// The token ids of at least the first `needed` tokens of `text` (all of them when it has
/// fewer), and how many bytes of it were tokenized. A long text is tokenized by growing
/// prefixes cut at a line end, and kept only when it gives a margin of tokens beyond `needed`:
/// only the last pre-token of a prefix can differ from the whole text's tokenization.
fn encode_prefix(tok: &Tokenizer, text: &str, needed: usize) -> anyhow::Result<(Vec<u32>, usize)> {
    const MARGIN: usize = 64;
    let mut bytes = needed.saturating_add(MARGIN).saturating_mul(8).max(1 << 16);
    loop {
        if bytes >= text.len() {
            return Ok((tok.encode(text)?, text.len()));
        }
        let mut end = bytes;
        while !text.is_char_boundary(end) {
            end += 1;
        }
        if let Some(nl) = text[..end].rfind('\n').filter(|&nl| nl > 0) {
            end = nl + 1;
        }
        let ids = tok.encode(&text[..end])?;
        if ids.len() >= needed + MARGIN {
            return Ok((ids, end));
        }
        bytes = bytes.saturating_mul(2);
    }
}

fn read_text(path: &Path) -> anyhow::Result<String> {
    if !path.is_file() {
        bail!("--text {}: no such file", path.display());
    }
    std::fs::read_to_string(path)
        .with_context(|| format!("--text {}: cannot read it as UTF-8 text", path.display()))
}

impl EvaluateArgs {
    /// Evaluates and prints the result.
    pub fn run(&self) -> anyhow::Result<()> {
        let batch = self.batch as usize;
        self.model.ensure_exists()?;
        let text = read_text(&self.text)?;
        let (loaded, device) = self.model.load()?;
        let (model, tok, tok_path) = (&loaded.model, &loaded.tokenizer, &loaded.tokenizer_path);
        let cfg = &loaded.pretrained.config;

        let n_ctx = cfg.n_ctx;
        let max_windows = self.max_tokens / n_ctx;
        if max_windows == 0 {
            bail!(
                "--max-tokens {} is below one window of the model's context ({n_ctx} tokens)",
                self.max_tokens
            );
        }
        let (ids, used_bytes) = encode_prefix(tok, &text, max_windows * n_ctx + 1)?;
        let whole = used_bytes == text.len();
        if ids.len() < n_ctx + 1 {
            bail!(
                "--text {} is too short: it has {} tokens ({} bytes, tokenized with {}) and one \
                 window needs {} (the model's context of {n_ctx} and the next token as target)",
                self.text.display(),
                ids.len(),
                text.len(),
                tok_path.display(),
                n_ctx + 1
            );
        }
        loaded.check_vocab(&ids, &self.text.display().to_string())?;
        let windows = ((ids.len() - 1) / n_ctx).min(max_windows);
        let batches = windows.div_ceil(batch);
        println!(
            "text: {} ({} bytes{}): {} tokens{}",
            self.text.display(),
            text.len(),
            if whole {
                String::new()
            } else {
                format!(", the first {used_bytes} tokenized")
            },
            ids.len(),
            if windows < max_windows {
                String::new()
            } else {
                format!(
                    " (--max-tokens {} keeps {windows} windows)",
                    self.max_tokens
                )
            }
        );
        println!(
            "evaluating {windows} windows of {n_ctx} tokens in {batches} batches of up to {}",
            batch
        );

        let t1 = Instant::now();
        let mut loss_sum = 0.0f64;
        let every = batches.div_ceil(10).max(1);
        for (b, first) in (0..windows).step_by(batch).enumerate() {
            let rows = batch.min(windows - first);
            let mut x = Vec::with_capacity(rows * n_ctx);
            let mut y = Vec::with_capacity(rows * n_ctx);
            for w in first..first + rows {
                let s = w * n_ctx;
                x.extend_from_slice(&ids[s..s + n_ctx]);
                y.extend_from_slice(&ids[s + 1..s + n_ctx + 1]);
            }
            let x = Tensor::from_vec(x, (rows, n_ctx), &device)?;
            let y = Tensor::from_vec(y, (rows, n_ctx), &device)?;
            // forward only: nothing here calls backward, so no gradient is kept
            let loss = model
                .loss(&x, &y)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            if !loss.is_finite() {
                bail!("the loss of windows {first}..{} is {loss}", first + rows);
            }
            loss_sum += loss * rows as f64;
            if batches > 1 && ((b + 1) % every == 0 || b + 1 == batches) {
                let done = first + rows;
                println!(
                    "  {done}/{windows} windows: mean loss so far {:.4} ({:.0} tokens/s)",
                    loss_sum / done as f64,
                    (done * n_ctx) as f64 / t1.elapsed().as_secs_f64().max(1e-9)
                );
            }
        }
        let tokens = windows * n_ctx;
        let loss = loss_sum / windows as f64;
        let perplexity = loss.exp();
        println!();
        println!(
            "tokens evaluated: {tokens} in {:.2} s",
            t1.elapsed().as_secs_f64()
        );
        println!(
            "mean loss: {loss:.4} nats/token ({:.4} bits)",
            loss / std::f64::consts::LN_2
        );
        println!("perplexity: {perplexity:.3}");
        // the fields in this order (serde_json's map would sort them); a non-finite number is null
        println!(
            "{{\"tokens\":{tokens},\"loss\":{},\"perplexity\":{}}}",
            serde_json::Value::from(loss),
            serde_json::Value::from(perplexity)
        );
        Ok(())
    }
}
