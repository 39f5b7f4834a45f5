//! Text from a trained model: loads a kiln checkpoint (any dp, tp and ZeRO layout, read back as
//! whole parameters) or a Hugging Face GPT-2 export folder, prints what it loaded, and continues
//! a prompt greedily or by temperature / top-k sampling (deterministic for a seed).
//!
//! Run: `cargo run --release --example sample -- runs/train_gpt/checkpoints --prompt "ROMEO:"`
//! (the folder of checkpoints, its `latest` file, one `step-NNNNNNNN` folder, or a folder with
//! `config.json` + `model.safetensors`).
//!
//! Flags: `--prompt TEXT` (default: the end-of-text token, an unconditional sample),
//! `--max-tokens N` (default 100), `--greedy`, or `--temperature T` (default 0.8) and
//! `--top-k K` (default 40), `--seed S` (default 0), `--tokenizer PATH` (a `tokenizer.json`,
//! when the folder has none), `--device cpu|cuda:N` (default cpu), `--ids` (also print the
//! generated token ids on a line starting `ids:`).

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

#[path = "common/model_cli.rs"]
mod model_cli;

use anyhow::{bail, Context};
use kiln_model::{generate, Sampling};
use model_cli::{Flags, ModelArgs};
use std::time::Instant;

const USAGE: &str = "usage: sample <checkpoint-or-export-folder> [--prompt TEXT] \
[--max-tokens N] [--greedy | --temperature T --top-k K] [--seed S] [--tokenizer PATH] \
[--device cpu|cuda:N] [--ids]";

/// Parses `--flag value`, `--flag=value` and the switches `--greedy` and `--ids`; `None` for
/// `--help`.
fn parse_args(args: impl IntoIterator<Item = String>) -> anyhow::Result<Option<Args>> {
    let mut flags = Flags::new(args, USAGE);
    let (mut prompt, mut max_tokens, mut seed) = (None, 100, 0);
    let (mut greedy, mut temperature, mut top_k, mut ids) = (false, 0.8f64, 40, false);
    let mut sampling_flag = None;
    while let Some(flag) = flags.next_flag()? {
        let name = flag.name.as_str();
        match name {
            "help" => return Ok(None),
            "greedy" | "ids" => {
                if flag.inline.is_some() {
                    bail!("--{name} takes no value\n{USAGE}");
                }
                if name == "greedy" {
                    greedy = true;
                } else {
                    ids = true;
                }
            }
            "prompt" => prompt = Some(flags.value(&flag)?),
            "max-tokens" => max_tokens = flags.number(&flag)?,
            "temperature" => {
                temperature = flags.number(&flag)?;
                sampling_flag = Some("temperature");
            }
            "top-k" => {
                top_k = flags.number(&flag)?;
                sampling_flag = Some("top-k");
            }
            "seed" => seed = flags.number(&flag)?,
            _ => bail!("unknown flag --{name}\n{USAGE}"),
        }
    }
    if let (true, Some(f)) = (greedy, sampling_flag) {
        bail!("--greedy and --{f} do not go together: greedy decoding does not sample");
    }
    if !greedy {
        if !(temperature.is_finite() && temperature > 0.0) {
            bail!("--temperature {temperature}: must be finite and > 0");
        }
        if top_k == 0 {
            bail!("--top-k 0: must be at least 1");
        }
    }
    Ok(Some(Args {
        model: flags.finish()?,
        prompt,
        max_tokens,
        greedy,
        temperature,
        top_k,
        seed,
        ids,
    }))
}

/// The command line.
#[derive(Debug)]
struct Args {
    model: ModelArgs,
    prompt: Option<String>,
    max_tokens: usize,
    greedy: bool,
    temperature: f64,
    top_k: usize,
    seed: u64,
    ids: bool,
}

fn main() -> anyhow::Result<()> {
    let Some(args) = parse_args(std::env::args().skip(1))? else {
        println!("{USAGE}");
        return Ok(());
    };
    args.model.ensure_exists()?;
    let (loaded, _device) = args.model.load()?;
    let (model, tok, tok_path) = (&loaded.model, &loaded.tokenizer, &loaded.tokenizer_path);
    let cfg = &loaded.pretrained.config;

    let prompt_text = args
        .prompt
        .clone()
        .unwrap_or_else(|| kiln_data::EOT_TOKEN.to_string());
    let prompt = tok.encode(&prompt_text)?;
    if prompt.is_empty() {
        bail!("the prompt {prompt_text:?} is empty: it gives no token to continue");
    }
    loaded.check_vocab(&prompt, "the prompt")?;
    let sampling = if args.greedy {
        Sampling::Greedy
    } else {
        Sampling::TopK {
            k: args.top_k,
            temperature: args.temperature,
        }
    };
    match sampling {
        Sampling::Greedy => println!("  decoding: greedy, {} new tokens", args.max_tokens),
        Sampling::TopK { k, temperature } => println!(
            "  decoding: top-{k} sampling at temperature {temperature}, seed {}, {} new tokens",
            args.seed, args.max_tokens
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
    let out = generate(model, &prompt, args.max_tokens, sampling, args.seed)?;
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
    if args.ids {
        let ids: Vec<String> = new.iter().map(u32::to_string).collect();
        println!("ids: {}", ids.join(" "));
    }
    Ok(())
}
