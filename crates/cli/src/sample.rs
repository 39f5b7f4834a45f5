//! `kiln sample`: text from a trained model. Loads a kiln checkpoint (any dp, tp and ZeRO
//! layout, read back as whole parameters) or a Hugging Face GPT-2 export folder, prints what it
//! loaded, and continues a prompt greedily or by temperature / top-k sampling (deterministic
//! for a seed).

use crate::model_args::ModelArgs;
use anyhow::{bail, Context};
use kiln_model::{generate, Sampling};
use std::time::Instant;

/// `kiln sample`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example:\n  kiln sample runs/train_gpt/checkpoints --prompt \"ROMEO:\" \
--max-tokens 100"
)]
pub struct SampleArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to continue (default: the end-of-text token, an unconditional sample)
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// New tokens to generate
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub max_tokens: usize,
    /// Greedy decoding (the most likely token each time) instead of sampling
    #[arg(long, conflicts_with_all = ["temperature", "top_k"])]
    pub greedy: bool,
    /// Sampling temperature, > 0 (default 0.8)
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,
    /// Sample among the K most likely tokens, >= 1 (default 40)
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// The sampling seed
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Also print the generated token ids, on a line starting `ids:`
    #[arg(long)]
    pub ids: bool,
}

impl SampleArgs {
    /// The decoding these flags ask for.
    pub fn sampling(&self) -> anyhow::Result<Sampling> {
        if self.greedy {
            return Ok(Sampling::Greedy);
        }
        let temperature = self.temperature.unwrap_or(0.8);
        let k = self.top_k.unwrap_or(40);
        if !(temperature.is_finite() && temperature > 0.0) {
            bail!("--temperature {temperature}: must be finite and > 0");
        }
        if k == 0 {
            bail!("--top-k 0: must be at least 1");
        }
        Ok(Sampling::TopK { k, temperature })
    }

    /// Loads the model and prints the continuation.
    pub fn run(&self) -> anyhow::Result<()> {
        let sampling = self.sampling()?;
        self.model.ensure_exists()?;
        let (loaded, _device) = self.model.load()?;
        let (model, tok, tok_path) = (&loaded.model, &loaded.tokenizer, &loaded.tokenizer_path);
        let cfg = &loaded.pretrained.config;

        let prompt_text = self
            .prompt
            .clone()
            .unwrap_or_else(|| kiln_data::EOT_TOKEN.to_string());
        let prompt = tok.encode(&prompt_text)?;
        if prompt.is_empty() {
            bail!("the prompt {prompt_text:?} is empty: it gives no token to continue");
        }
        loaded.check_vocab(&prompt, "the prompt")?;
        match sampling {
            Sampling::Greedy => println!("  decoding: greedy, {} new tokens", self.max_tokens),
            Sampling::TopK { k, temperature } => println!(
                "  decoding: top-{k} sampling at temperature {temperature}, seed {}, {} new tokens",
                self.seed, self.max_tokens
            ),
        }
        if prompt.len() > cfg.n_ctx {
            println!(
                "  the prompt's {} tokens exceed the context of {}: the model sees the last {}",
                prompt.len(),
                cfg.n_ctx,
                cfg.n_ctx
            );
        }

        let t1 = Instant::now();
        let out = generate(model, &prompt, self.max_tokens, sampling, self.seed)?;
        let secs = t1.elapsed().as_secs_f64();
        let new = &out[prompt.len()..];
        let text = tok.decode(new).with_context(|| {
            format!(
                "cannot decode the continuation with {} (the model's vocabulary is {})",
                tok_path.display(),
                cfg.vocab_size
            )
        })?;
        println!();
        println!("prompt ({} tokens):", prompt.len());
        println!("{prompt_text}");
        println!(
            "continuation ({} tokens in {secs:.2} s, {:.0} tokens/s):",
            new.len(),
            new.len() as f64 / secs.max(1e-9)
        );
        println!("{text}");
        if self.ids {
            let ids: Vec<String> = new.iter().map(u32::to_string).collect();
            println!("ids: {}", ids.join(" "));
        }
        Ok(())
    }
}
