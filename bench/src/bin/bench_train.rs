//! Training throughput of kiln's step on a GPT or a Llama, with where the step's time goes;
//! with `--bare-candle`, the same GPT trained by a plain candle loop, the baseline kiln's
//! machinery is measured against.
//!
//! Prints one JSON line: `mode` (`kiln` or `bare_candle`), `arch` (`gpt` or `llama`), the
//! sizes (`kv_heads`: key/value heads; `ffn`: the MLP's hidden width), `tokens_per_s` (global tokens over
//! the median step time of steps 5 to 25), the median seconds of each part of a step (`data`:
//! the loader; `forward` and `backward`: the model, recomputation counted as backward;
//! `grad_sync`: waiting for the gradient collectives after the backward; `optimizer`: unscale,
//! norm, clipping, AdamW and the parameter write-back; `other`: the rest), and `peak_rss_mib`
//! (the process's high-water mark); `sequence_parallel` whether the tensor-parallel ranks split
//! the token rows; `bf16_kernel` says how this CPU runs bf16 products (`dot`:
//! the `avx512_bf16` dot product; `fma`: the f32 kernel on rounded operands).
//!
//! With no arguments: the `small_cpu` preset (vocabulary 8192, context 128, d_model 256, 4
//! layers, 4 heads, tied embeddings), global batch 8, f32, AdamW (kiln's defaults: betas
//! 0.9/0.999, weight decay 0.01 on the weight matrices), gradients clipped to a global norm of
//! 1.0, one rank, batches from the prepared corpus of `data/` (`.cache/kiln-data`, built on
//! first use).
//!
//! `--arch llama` starts from the `llama_cpu` preset instead (RMSNorm, rotary positions,
//! SwiGLU, 8 query heads sharing 2 key/value heads, no biases, an untied head); `--preset`
//! takes any preset, GPT or Llama, and the architecture follows it. On a Llama, `--d-model`
//! without `--ffn` sets the SwiGLU width to Llama's `8 d / 3` rounded up to a multiple of 32
//! (704 at d 256, as `llama_cpu`), and `--heads` keeps the preset's key/value heads
//! (`--kv-heads` must divide `--heads`).
//!
//! `--bare-candle` trains the same GPT (kiln-model's architecture and sizes from the same flags:
//! pre-LayerNorm blocks, fused QKV `[3d, d]`, causal softmax attention, 4x GELU-tanh MLP, learned
//! positions, final LayerNorm, LM head tied to the token embedding, biases everywhere, so the
//! same FLOPs) written here with candle's composite ops, each with candle's own backward:
//! `index_select` embeddings, LayerNorm from `mean_keepdim`/`sqr`/`sqrt`, attention as matmul,
//! additive causal mask and `candle_nn::ops::softmax` (max, exp, sum: composite), `Tensor::gelu`
//! (tanh), `candle_nn::loss::cross_entropy` (composite `log_softmax` + `gather`). The loop is
//! forward, `loss.backward()`, the global gradient norm and clipping to 1.0 as kiln's step does
//! (PyTorch's `max_norm / (norm + 1e-6)` when the norm exceeds 1.0), then `candle_nn::AdamW`
//! (lr `--lr`, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on every parameter) over the model's
//! `Var`s. No kiln-parallel engine, flat buffers, loss scaler or kiln-data loader: the batches
//! are random tokens drawn once before the first step. Initialisation is N(0, 0.02) for matrices
//! and embeddings, zero biases and unit LayerNorm gains. f32 and one rank only (`data` and
//! `grad_sync` are 0); `forward` includes the loss, `optimizer` the norm, clipping and AdamW.
//!
//! ```text
//! cargo run --release -p kiln-bench --bin bench_train
//! cargo run --release -p kiln-bench --bin bench_train -- --bare-candle
//! cargo run --release -p kiln-bench --bin bench_train -- --arch llama
//! cargo run --release -p kiln-bench --bin bench_train -- --d-model 512 --layers 8 --heads 8 --ctx 256 --batch 4
//! cargo run --release -p kiln-bench --bin bench_train -- --dtype bf16 --dp 2 --zero 1 --recompute every_block
//! ```
//!
//! Flags: `--arch gpt|llama`, `--preset NAME`, `--d-model N`, `--layers N`, `--heads N`,
//! `--kv-heads N` and `--ffn N` (Llama only), `--ctx N` (context and sequence length),
//! `--vocab N`, `--batch N` (global sequences per step), `--dtype
//! f32|bf16|f16`, `--dp N`, `--tp N`, `--zero 0..3`, `--recompute
//! none|every_block|every_<k>|selective|selective_<k>`, `--steps N` (default 25; the median
//! is over steps 5 to N), `--lr X`, `--bare-candle` (no
//! value; the GPT layout, f32, dp 1, tp 1, ZeRO 0 and no recomputation only), `--sequence-parallel` (no value;
//! Megatron's sequence parallelism when `--tp` is above 1).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use kiln_comm::{spawn, Communicator, ThreadComm};
use kiln_data::{prepare_corpus, DataLoader, LoaderConfig, PrepareConfig, Verify};
use kiln_memory::RecomputePolicy;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::{DataParallel, DataParallelConfig, ParallelDims, ZeroStage};
use kiln_precision::{DynamicLossScaler, DynamicScalerConfig, LossScaler, NoScaler};
use std::sync::Arc;
use std::time::Instant;

// a folder beside the binary, not src/bin/bare.rs, which cargo would take for a binary of its own
#[path = "bench_train/bare.rs"]
mod bare;

/// The median seconds of each part of a step on one rank.
#[derive(Debug, Clone, Copy, Default)]
struct Parts {
    step: f64,
    data: f64,
    forward: f64,
    backward: f64,
    grad_sync: f64,
    optimizer: f64,
}

impl Parts {
    /// The median of each column of `rows`.
    fn medians(rows: &[Parts]) -> Parts {
        let col = |f: fn(&Parts) -> f64| median(rows.iter().map(f).collect());
        Parts {
            step: col(|p| p.step),
            data: col(|p| p.data),
            forward: col(|p| p.forward),
            backward: col(|p| p.backward),
            grad_sync: col(|p| p.grad_sync),
            optimizer: col(|p| p.optimizer),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The high-water mark of this process's resident memory, in MiB (0 where /proc is absent).
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// What one run measured, printed as the JSON line.
struct Report<'a> {
    mode: &'a str,
    arch: Arch,
    preset: &'a str,
    cfg: &'a GptConfig,
    params: u64,
    batch: usize,
    dtype: &'a str,
    dp: usize,
    tp: usize,
    sequence_parallel: bool,
    zero_stage: u8,
    recompute: RecomputePolicy,
    steps: usize,
    /// The slowest rank's median step.
    step_s: f64,
    /// Rank 0's breakdown.
    parts: Parts,
}

impl Report<'_> {
    fn json(&self) -> String {
        let p = &self.parts;
        let other = (p.step - p.data - p.forward - p.backward - p.grad_sync - p.optimizer).max(0.0);
        let seq = self.cfg.n_ctx;
        let tokens = (self.batch * seq) as f64;
        // how bf16 products run on this CPU (the dot product, or the f32 kernel on rounded
        // operands), for reading a bf16 figure
        let bf16_kernel = match kiln_parallel::tp::bf16_kernel() {
            kiln_parallel::tp::Bf16Kernel::Dot => "dot",
            kiln_parallel::tp::Bf16Kernel::Fma => "fma",
        };
        format!(
            "{{\"bench\":\"train\",\"mode\":\"{}\",\"arch\":\"{}\",\"preset\":\"{}\",\"d_model\":{},\"layers\":{},\"heads\":{},\"kv_heads\":{},\"ffn\":{},\"ctx\":{seq},\"vocab\":{},\"params\":{},\"batch\":{},\"dtype\":\"{}\",\"bf16_kernel\":\"{}\",\"dp\":{},\"tp\":{},\"sequence_parallel\":{},\"zero_stage\":{},\"recompute\":\"{}\",\"steps\":{},\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"data_s\":{:.4},\"forward_s\":{:.4},\"backward_s\":{:.4},\"grad_sync_s\":{:.4},\"optimizer_s\":{:.4},\"other_s\":{other:.4},\"peak_rss_mib\":{:.1}}}",
            self.mode,
            self.arch.name(),
            self.preset,
            self.cfg.d_model,
            self.cfg.n_layers,
            self.cfg.n_heads,
            self.cfg.kv_heads(),
            self.cfg.d_ff(),
            self.cfg.vocab_size,
            self.params,
            self.batch,
            self.dtype,
            bf16_kernel,
            self.dp,
            self.tp,
            self.sequence_parallel,
            self.zero_stage,
            self.recompute,
            self.steps,
            tokens / self.step_s,
            self.step_s,
            p.data,
            p.forward,
            p.backward,
            p.grad_sync,
            p.optimizer,
            peak_rss_mib()
        )
    }
}

/// The model's architecture, as `--arch` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Arch {
    /// GPT: LayerNorm, learned positions, GELU, biases, a tied head.
    Gpt,
    /// Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases.
    Llama,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::Gpt => "gpt",
            Arch::Llama => "llama",
        }
    }

    /// The architecture of a config, if it is one of the two.
    fn of(cfg: &GptConfig) -> Option<Arch> {
        if cfg.is_llama_layout() {
            Some(Arch::Llama)
        } else if cfg.is_gpt_layout() {
            Some(Arch::Gpt)
        } else {
            None
        }
    }
}

/// Llama's SwiGLU width for `d_model`: `8 d / 3` rounded up to a multiple of 32 (704 at 256,
/// `llama_cpu`'s; 352 at 128, `llama_tiny`'s).
fn llama_ffn(d_model: usize) -> usize {
    (8 * d_model).div_ceil(3).div_ceil(32) * 32
}

/// The architecture, preset name and validated config the flags ask for.
fn model_config(args: &Args) -> anyhow::Result<(Arch, String, GptConfig)> {
    let preset = match (&args.preset, args.arch) {
        (Some(p), _) => p.clone(),
        (None, Some(Arch::Llama)) => "llama_cpu".to_string(),
        (None, _) => "small_cpu".to_string(),
    };
    let mut cfg = GptConfig::by_name(&preset)?;
    let Some(arch) = Arch::of(&cfg) else {
        anyhow::bail!("--preset {preset} is neither the GPT nor the Llama layout");
    };
    if let Some(a) = args.arch.filter(|a| *a != arch) {
        anyhow::bail!(
            "--arch {} with --preset {preset}, a {} preset: leave out one of them",
            a.name(),
            arch.name()
        );
    }
    if arch == Arch::Gpt {
        for (flag, v) in [("--kv-heads", args.kv_heads), ("--ffn", args.ffn)] {
            if v.is_some() {
                anyhow::bail!(
                    "{flag} sizes a Llama; the GPT layout has as many key/value heads as query \
                     heads and a 4 x d_model GELU MLP (pass --arch llama)"
                );
            }
        }
    }
    if let Some(v) = args.d_model {
        cfg.d_model = v;
        if arch == Arch::Llama {
            cfg.ffn_hidden_size = Some(llama_ffn(v));
        }
    }
    if let Some(v) = args.layers {
        cfg.n_layers = v;
    }
    if let Some(v) = args.heads {
        cfg.n_heads = v;
    }
    if let Some(v) = args.kv_heads {
        cfg.n_kv_heads = Some(v);
    }
    if let Some(v) = args.ffn {
        cfg.ffn_hidden_size = Some(v);
    }
    if let Some(v) = args.ctx {
        cfg.n_ctx = v;
    }
    if let Some(v) = args.vocab {
        cfg.vocab_size = v;
    }
    cfg.validate().map_err(|e| {
        anyhow::anyhow!(
            "{preset} with the size flags: {e} (--d-model {} --heads {} --kv-heads {})",
            cfg.d_model,
            cfg.n_heads,
            cfg.kv_heads()
        )
    })?;
    Ok((arch, preset, cfg))
}

/// kiln's training step in tokens/s and where its time goes (or, with --bare-candle, a plain
/// candle loop on the same model); one JSON line.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_train")]
struct Args {
    /// The architecture: gpt (preset small_cpu) or llama (preset llama_cpu)
    #[arg(long, value_name = "ARCH")]
    arch: Option<Arch>,
    /// The model preset the sizes start from (any, GPT or Llama; default small_cpu, or
    /// llama_cpu with --arch llama)
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,
    /// Model width
    #[arg(long, value_name = "N")]
    d_model: Option<usize>,
    /// Blocks
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Attention (query) heads
    #[arg(long, value_name = "N")]
    heads: Option<usize>,
    /// Key/value heads, dividing --heads (Llama only)
    #[arg(long, value_name = "N")]
    kv_heads: Option<usize>,
    /// The SwiGLU hidden width (Llama only; default 8 d / 3 rounded up to a multiple of 32)
    #[arg(long, value_name = "N")]
    ffn: Option<usize>,
    /// Context and sequence length
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
    /// Vocabulary size
    #[arg(long, value_name = "N")]
    vocab: Option<usize>,
    /// Global sequences per step
    #[arg(long, value_name = "N", default_value_t = 8)]
    batch: usize,
    /// Compute dtype: f32, bf16 or f16
    #[arg(long, value_name = "DTYPE", default_value = "f32")]
    dtype: String,
    /// Data-parallel thread ranks
    #[arg(long, value_name = "N", default_value_t = 1)]
    dp: usize,
    /// Tensor-parallel thread ranks
    #[arg(long, value_name = "N", default_value_t = 1)]
    tp: usize,
    /// ZeRO stage, 0-3
    #[arg(long, value_name = "STAGE", default_value_t = 0)]
    zero: u8,
    /// Activation recompute: none, every_block, every_K, selective or selective_K
    #[arg(long, value_name = "POLICY", default_value = "none")]
    recompute: RecomputePolicy,
    /// Steps (the median is over steps 5 to N; at least 6)
    #[arg(long, value_name = "N", default_value_t = 25)]
    steps: usize,
    /// Learning rate
    #[arg(long, value_name = "LR", default_value_t = 1e-3)]
    lr: f32,
    /// The same model as a plain candle loop (f32, one rank, no ZeRO or recomputation)
    #[arg(long)]
    bare_candle: bool,
    /// Megatron's sequence parallelism when --tp is above 1
    #[arg(long)]
    sequence_parallel: bool,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (bare_candle, sequence_parallel) = (args.bare_candle, args.sequence_parallel);
    let (arch, preset, cfg) = model_config(&args)?;
    let seq = cfg.n_ctx;
    let global_batch = args.batch;
    let (dp, tp) = (args.dp, args.tp);
    let stage = ZeroStage::from_number(args.zero)?;
    let steps = args.steps.max(6);
    let lr: f32 = args.lr;
    let recompute: RecomputePolicy = args.recompute;
    let dtype_name = args.dtype.clone();
    let dtype = match dtype_name.as_str() {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        "f16" => candle_core::DType::F16,
        other => anyhow::bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    if dp == 0 || global_batch % dp != 0 {
        anyhow::bail!("--batch {global_batch} must be a positive multiple of --dp {dp}");
    }
    let report = |mode, params, step_s, parts| Report {
        mode,
        arch,
        preset: &preset,
        cfg: &cfg,
        params,
        batch: global_batch,
        dtype: &dtype_name,
        dp,
        tp,
        sequence_parallel: sequence_parallel && tp > 1,
        zero_stage: stage.number(),
        recompute,
        steps,
        step_s,
        parts,
    };

    if bare_candle {
        if !cfg.is_gpt_layout() {
            anyhow::bail!(
                "--bare-candle trains the GPT layout only (LayerNorm, learned positions, GELU, \
                 biases, a tied head), got {} (preset {preset}): leave out --bare-candle",
                arch.name()
            );
        }
        if dtype != candle_core::DType::F32 {
            anyhow::bail!("--bare-candle trains in f32 only, got --dtype {dtype_name}");
        }
        if dp != 1 || tp != 1 {
            anyhow::bail!("--bare-candle runs one rank only, got --dp {dp} --tp {tp}");
        }
        if stage != ZeroStage::Replicated || recompute != RecomputePolicy::None {
            anyhow::bail!(
                "--bare-candle has no ZeRO or activation recomputation, got --zero {} --recompute {recompute}",
                stage.number()
            );
        }
        let model = bare::BareGpt::new(&cfg, 1)?;
        let parts = bare::train(&model, global_batch, steps, f64::from(lr))?;
        let params = model.num_parameters() as u64;
        println!(
            "{}",
            report("bare_candle", params, parts.step, parts).json()
        );
        return Ok(());
    }

    let world = dp * tp;
    let shape = cfg.shape();
    ParallelDims::new(dp, tp, world, &shape)?;

    // the corpus, prepared once (the tokenizer's vocabulary must fit the model's)
    let cache = kiln_data::default_cache_dir().join(format!(
        "{}-v{}",
        kiln_data::DEFAULT_CORPORA.join("+"),
        cfg.vocab_size
    ));
    let prepared = prepare_corpus(&PrepareConfig {
        vocab_size: cfg.vocab_size,
        ..PrepareConfig::new("data", cache)
    })?;
    let sources = prepared.train_sources(Verify::Full)?;

    let per_rank = global_batch / dp;
    let results = spawn(world, |comm: ThreadComm| -> anyhow::Result<Parts> {
        let dims = ParallelDims::new(dp, tp, world, &shape)?;
        let groups = dims.build_groups(&comm)?;
        let world_comm: Arc<dyn Communicator> = Arc::new(comm);
        let tpc: Arc<dyn Communicator> = Arc::from(groups.tp);
        let model = Gpt::tensor_parallel(
            &cfg,
            &GptOptions::seeded(1)
                .with_compute_dtype(dtype)
                .with_sequence_parallel(sequence_parallel),
            tpc.clone(),
        )?;
        let dpc = DataParallelConfig {
            stage,
            max_grad_norm: Some(1.0),
            recompute,
            ..Default::default()
        };
        let mut engine = DataParallel::new(&model.segment_param_lists(), &*groups.dp, dpc)?
            .with_world(world_comm.clone())
            .with_param_splits(&model.param_splits())?
            .with_decay_groups(
                &model.param_kinds(),
                &kiln_optim::WeightDecayGroups::default(),
            )?;
        if tp > 1 {
            engine = engine.with_tensor_parallel(tpc);
        }
        let mut loader = DataLoader::new(
            sources.clone(),
            None,
            LoaderConfig {
                dp,
                rank: dims.dp_rank(world_comm.rank()),
                seed: 1,
                ..LoaderConfig::new(seq, per_rank)
            },
        )?;
        let mut scaler: Box<dyn LossScaler> = if dtype == candle_core::DType::F16 {
            Box::new(DynamicLossScaler::new(DynamicScalerConfig::default())?)
        } else {
            Box::new(NoScaler)
        };
        let mut rows: Vec<Parts> = Vec::new();
        for step in 1..=steps {
            let t0 = Instant::now();
            let batch = loader.next_batch()?;
            let micro = kiln_train::micro_batches(&batch, 1, engine.device())?;
            let data = t0.elapsed().as_secs_f64();
            let preview = engine.backward(&model, &micro, &mut *scaler)?;
            let report = if preview.found_inf {
                engine.discard()?
            } else {
                engine.apply(lr)?
            };
            let step_s = t0.elapsed().as_secs_f64();
            if step >= 5 {
                rows.push(Parts {
                    step: step_s,
                    data,
                    forward: report.forward_s,
                    backward: report.compute_s - report.forward_s,
                    grad_sync: report.comm_wait_s,
                    optimizer: report.optim_s,
                });
            }
        }
        Ok(Parts::medians(&rows))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    // the slowest rank sets the pace; the breakdown is rank 0's
    let step_s = results.iter().map(|p| p.step).fold(0.0, f64::max);
    let parts = results
        .first()
        .copied()
        .ok_or_else(|| anyhow::anyhow!("no rank reported"))?;
    println!(
        "{}",
        report("kiln", cfg.param_count(), step_s, parts).json()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{llama_ffn, model_config, Arch, Args};
    use kiln_model::GptConfig;

    fn config(flags: &[&str]) -> anyhow::Result<(Arch, String, GptConfig)> {
        let argv = std::iter::once("bench_train").chain(flags.iter().copied());
        model_config(&<Args as clap::Parser>::try_parse_from(argv)?)
    }

    #[test]
    fn llama_ffn_is_the_presets_width() {
        assert_eq!(llama_ffn(256), GptConfig::llama_cpu().d_ff());
        assert_eq!(llama_ffn(128), GptConfig::llama_tiny().d_ff());
        assert_eq!(llama_ffn(4096), 10_944); // 8 * 4096 / 3 = 10922.7, up to 32
    }

    #[test]
    fn arch_picks_the_default_preset_and_the_size_flags_apply() {
        let (arch, preset, cfg) = config(&[]).unwrap();
        assert_eq!(
            (arch, preset.as_str(), cfg),
            (Arch::Gpt, "small_cpu", GptConfig::small_cpu())
        );
        let (arch, preset, cfg) = config(&["--arch", "llama"]).unwrap();
        assert_eq!(
            (arch, preset.as_str(), cfg),
            (Arch::Llama, "llama_cpu", GptConfig::llama_cpu())
        );
        let (arch, _, cfg) = config(&["--preset", "llama_tiny"]).unwrap();
        assert_eq!((arch, cfg), (Arch::Llama, GptConfig::llama_tiny()));
        let (_, _, cfg) = config(&["--arch", "llama", "--d-model", "512", "--heads", "4"]).unwrap();
        assert_eq!(
            (cfg.d_model, cfg.n_heads, cfg.kv_heads(), cfg.d_ff()),
            (512, 4, 2, 1376)
        );
        let (_, _, cfg) = config(&["--arch", "llama", "--kv-heads", "8", "--ffn", "512"]).unwrap();
        assert_eq!(
            (cfg.kv_heads(), cfg.d_ff(), cfg.grouped_query()),
            (8, 512, false)
        );
    }

    #[test]
    fn nonsense_is_refused_naming_the_flags() {
        let err = |flags: &[&str]| config(flags).unwrap_err().to_string();
        assert!(err(&["--arch", "gpt", "--kv-heads", "2"]).contains("--kv-heads sizes a Llama"));
        assert!(err(&["--ffn", "512"]).contains("--ffn sizes a Llama"));
        assert!(err(&["--arch", "gpt", "--preset", "llama_cpu"]).contains("--arch gpt"));
        let e = err(&["--arch", "llama", "--heads", "4", "--kv-heads", "3"]);
        assert!(e.contains("n_kv_heads (3) must divide n_heads (4)"), "{e}");
    }
}
