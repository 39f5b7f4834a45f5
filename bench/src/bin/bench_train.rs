//! Training throughput of kiln's step on a GPT, with where the step's time goes; with
//! `--bare-candle`, the same model trained by a plain candle loop, the baseline kiln's machinery
//! is measured against.
//!
//! Prints one JSON line: `mode` (`kiln` or `bare_candle`), `tokens_per_s` (global tokens over
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
//! cargo run --release -p kiln-bench --bin bench_train -- --d-model 512 --layers 8 --heads 8 --ctx 256 --batch 4
//! cargo run --release -p kiln-bench --bin bench_train -- --dtype bf16 --dp 2 --zero 1 --recompute every_block
//! ```
//!
//! Flags: `--preset NAME`, `--d-model N`, `--layers N`, `--heads N`, `--ctx N` (context and
//! sequence length), `--vocab N`, `--batch N` (global sequences per step), `--dtype
//! f32|bf16|f16`, `--dp N`, `--tp N`, `--zero 0..3`, `--recompute
//! none|every_block|every_<k>|selective|selective_<k>`, `--steps N` (default 25; the median
//! is over steps 5 to N), `--lr X`, `--bare-candle` (no
//! value; f32, dp 1, tp 1, ZeRO 0 and no recomputation only), `--sequence-parallel` (no value;
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
            "{{\"bench\":\"train\",\"mode\":\"{}\",\"preset\":\"{}\",\"d_model\":{},\"layers\":{},\"heads\":{},\"ctx\":{seq},\"vocab\":{},\"params\":{},\"batch\":{},\"dtype\":\"{}\",\"bf16_kernel\":\"{}\",\"dp\":{},\"tp\":{},\"sequence_parallel\":{},\"zero_stage\":{},\"recompute\":\"{}\",\"steps\":{},\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"data_s\":{:.4},\"forward_s\":{:.4},\"backward_s\":{:.4},\"grad_sync_s\":{:.4},\"optimizer_s\":{:.4},\"other_s\":{other:.4},\"peak_rss_mib\":{:.1}}}",
            self.mode,
            self.preset,
            self.cfg.d_model,
            self.cfg.n_layers,
            self.cfg.n_heads,
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

/// kiln's training step in tokens/s and where its time goes (or, with --bare-candle, a plain
/// candle loop on the same model); one JSON line.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_train")]
struct Args {
    /// The model preset the sizes start from
    #[arg(long, value_name = "NAME", default_value = "small_cpu")]
    preset: String,
    /// Model width
    #[arg(long, value_name = "N")]
    d_model: Option<usize>,
    /// Blocks
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Attention heads
    #[arg(long, value_name = "N")]
    heads: Option<usize>,
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
    let preset = args.preset.clone();
    let mut cfg = GptConfig::by_name(&preset)?;
    if let Some(v) = args.d_model {
        cfg.d_model = v;
    }
    if let Some(v) = args.layers {
        cfg.n_layers = v;
    }
    if let Some(v) = args.heads {
        cfg.n_heads = v;
    }
    if let Some(v) = args.ctx {
        cfg.n_ctx = v;
    }
    if let Some(v) = args.vocab {
        cfg.vocab_size = v;
    }
    cfg.validate()?;
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

/// The `--bare-candle` baseline: kiln-model's GPT written with candle's composite ops and
/// trained by a plain loop with `candle_nn::AdamW`.
mod bare {
    use super::Parts;
    use candle_core::{DType, Device, Tensor, Var, D};
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};
    use kiln_model::GptConfig;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::time::Instant;

    /// A LayerNorm's gain and shift.
    struct Norm {
        weight: Var,
        bias: Var,
    }

    /// `x W^T + b` with `W` `[out, in]`.
    struct Linear {
        weight: Var,
        bias: Var,
    }

    /// One pre-LayerNorm block.
    struct Block {
        ln_1: Norm,
        c_attn: Linear,
        attn_proj: Linear,
        ln_2: Norm,
        c_fc: Linear,
        mlp_proj: Linear,
    }

    /// kiln-model's `Gpt` (dense, one rank) with its parameter names, in plain candle.
    pub struct BareGpt {
        cfg: GptConfig,
        wte: Var,
        wpe: Var,
        blocks: Vec<Block>,
        ln_f: Norm,
        /// `[n_ctx, n_ctx]`: 0 on and below the diagonal, -inf above.
        causal_mask: Tensor,
        /// Every parameter with kiln-model's name, in kiln-model's order.
        params: Vec<(String, Var)>,
    }

    /// `n` draws of N(0, std) (Box-Muller).
    fn normal(rng: &mut ChaCha8Rng, n: usize, std: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1 = 1.0 - rng.gen::<f64>();
                let u2 = rng.gen::<f64>();
                (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect()
    }

    enum Fill {
        Normal,
        Zeros,
        Ones,
    }

    /// Creates the parameters, recording each with its name.
    struct Builder {
        rng: ChaCha8Rng,
        params: Vec<(String, Var)>,
    }

    impl Builder {
        fn var(&mut self, name: String, shape: &[usize], fill: Fill) -> candle_core::Result<Var> {
            let dev = Device::Cpu;
            let t = match fill {
                Fill::Normal => {
                    let n = shape.iter().product();
                    Tensor::from_vec(normal(&mut self.rng, n, 0.02), shape, &dev)?
                }
                Fill::Zeros => Tensor::zeros(shape, DType::F32, &dev)?,
                Fill::Ones => Tensor::ones(shape, DType::F32, &dev)?,
            };
            let v = Var::from_tensor(&t)?;
            self.params.push((name, v.clone()));
            Ok(v)
        }

        fn norm(&mut self, name: &str, d: usize) -> candle_core::Result<Norm> {
            Ok(Norm {
                weight: self.var(format!("{name}.weight"), &[d], Fill::Ones)?,
                bias: self.var(format!("{name}.bias"), &[d], Fill::Zeros)?,
            })
        }

        fn linear(&mut self, name: &str, in_f: usize, out_f: usize) -> candle_core::Result<Linear> {
            Ok(Linear {
                weight: self.var(format!("{name}.weight"), &[out_f, in_f], Fill::Normal)?,
                bias: self.var(format!("{name}.bias"), &[out_f], Fill::Zeros)?,
            })
        }
    }

    impl BareGpt {
        /// The model for `cfg` on the CPU in f32, initialised from `seed`.
        pub fn new(cfg: &GptConfig, seed: u64) -> candle_core::Result<Self> {
            let dev = Device::Cpu;
            let mut pb = Builder {
                rng: ChaCha8Rng::seed_from_u64(seed),
                params: Vec::new(),
            };
            let (d, f) = (cfg.d_model, cfg.d_ff());
            let wte = pb.var("wte".into(), &[cfg.vocab_size, d], Fill::Normal)?;
            let wpe = pb.var("wpe".into(), &[cfg.n_ctx, d], Fill::Normal)?;
            let mut blocks = Vec::with_capacity(cfg.n_layers);
            for i in 0..cfg.n_layers {
                blocks.push(Block {
                    ln_1: pb.norm(&format!("h.{i}.ln_1"), d)?,
                    c_attn: pb.linear(&format!("h.{i}.attn.c_attn"), d, 3 * d)?,
                    attn_proj: pb.linear(&format!("h.{i}.attn.c_proj"), d, d)?,
                    ln_2: pb.norm(&format!("h.{i}.ln_2"), d)?,
                    c_fc: pb.linear(&format!("h.{i}.mlp.c_fc"), d, f)?,
                    mlp_proj: pb.linear(&format!("h.{i}.mlp.c_proj"), f, d)?,
                });
            }
            let ln_f = pb.norm("ln_f", d)?;
            let t = cfg.n_ctx;
            let mask: Vec<f32> = (0..t * t)
                .map(|k| {
                    if k % t > k / t {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            Ok(Self {
                cfg: cfg.clone(),
                wte,
                wpe,
                blocks,
                ln_f,
                causal_mask: Tensor::from_vec(mask, (t, t), &dev)?,
                params: pb.params,
            })
        }

        /// Every parameter with kiln-model's name.
        pub fn named_parameters(&self) -> &[(String, Var)] {
            &self.params
        }

        /// The number of trainable elements.
        pub fn num_parameters(&self) -> usize {
            self.params.iter().map(|(_, v)| v.elem_count()).sum()
        }

        fn layer_norm(&self, x: &Tensor, n: &Norm) -> candle_core::Result<Tensor> {
            let mean = x.mean_keepdim(D::Minus1)?;
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
            xc.broadcast_div(&(var + self.cfg.layer_norm_eps)?.sqrt()?)?
                .broadcast_mul(n.weight.as_tensor())?
                .broadcast_add(n.bias.as_tensor())
        }

        /// `x` `[rows, in]` to `[rows, out]`.
        fn linear(x: &Tensor, l: &Linear) -> candle_core::Result<Tensor> {
            x.matmul(&l.weight.t()?)?.broadcast_add(l.bias.as_tensor())
        }

        /// Causal multi-head self-attention of `x` `[b * t, d]`.
        fn attention(
            &self,
            x: &Tensor,
            blk: &Block,
            b: usize,
            t: usize,
        ) -> candle_core::Result<Tensor> {
            let (d, h) = (self.cfg.d_model, self.cfg.n_heads);
            let dh = d / h;
            // [b, t, 3, h, dh] -> [3, b, h, t, dh]
            let qkv = Self::linear(x, &blk.c_attn)?
                .reshape((b, t, 3, h, dh))?
                .permute((2, 0, 3, 1, 4))?
                .contiguous()?;
            let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
            let mask = self.causal_mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
            let scores = (q.matmul(&k.t()?)? * (1.0 / (dh as f64).sqrt()))?.broadcast_add(&mask)?;
            let y = candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v)?;
            let y = y.transpose(1, 2)?.contiguous()?.reshape((b * t, d))?;
            Self::linear(&y, &blk.attn_proj)
        }

        /// Mean next-token cross-entropy of `tokens` against `targets` (both `[b, t]`, u32).
        pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
            let (b, t) = tokens.dims2()?;
            let d = self.cfg.d_model;
            let tok = self.wte.index_select(&tokens.flatten_all()?, 0)?;
            let pos = self.wpe.narrow(0, 0, t)?;
            let mut x = tok
                .reshape((b, t, d))?
                .broadcast_add(&pos)?
                .reshape((b * t, d))?;
            for blk in &self.blocks {
                x = (&x + self.attention(&self.layer_norm(&x, &blk.ln_1)?, blk, b, t)?)?;
                let hid = Self::linear(&self.layer_norm(&x, &blk.ln_2)?, &blk.c_fc)?.gelu()?;
                x = (&x + Self::linear(&hid, &blk.mlp_proj)?)?;
            }
            let logits = self.layer_norm(&x, &self.ln_f)?.matmul(&self.wte.t()?)?;
            candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
        }
    }

    /// Trains `model` for `steps` steps of `batch` random sequences of `n_ctx` tokens (drawn
    /// before the first step); the medians of steps 5 to `steps`.
    pub fn train(
        model: &BareGpt,
        batch: usize,
        steps: usize,
        lr: f64,
    ) -> candle_core::Result<Parts> {
        let (vocab, t) = (model.cfg.vocab_size as u32, model.cfg.n_ctx);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let batches = (0..steps)
            .map(|_| {
                let ids: Vec<u32> = (0..batch * (t + 1))
                    .map(|_| rng.gen_range(0..vocab))
                    .collect();
                let ids = Tensor::from_vec(ids, (batch, t + 1), &Device::Cpu)?;
                Ok((
                    ids.narrow(1, 0, t)?.contiguous()?,
                    ids.narrow(1, 1, t)?.contiguous()?,
                ))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let vars: Vec<Var> = model
            .named_parameters()
            .iter()
            .map(|(_, v)| v.clone())
            .collect();
        let mut opt = AdamW::new(
            vars.clone(),
            ParamsAdamW {
                lr,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
        )?;
        let max_norm = 1.0f64;
        let mut rows = Vec::new();
        for (step, (tokens, targets)) in (1..=steps).zip(&batches) {
            let t0 = Instant::now();
            let loss = model.loss(tokens, targets)?;
            let t_fwd = t0.elapsed().as_secs_f64();
            let mut grads = loss.backward()?;
            let t_bwd = t0.elapsed().as_secs_f64();
            // the global norm, and clipping to max_norm as torch.nn.utils.clip_grad_norm_
            let sq = vars
                .iter()
                .filter_map(|v| grads.get(v).map(|g| g.sqr()?.sum_all()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let norm = f64::from(Tensor::stack(&sq, 0)?.sum_all()?.to_scalar::<f32>()?).sqrt();
            if norm > max_norm {
                let coef = max_norm / (norm + 1e-6);
                for v in &vars {
                    if let Some(g) = grads.get(v) {
                        let g = (g * coef)?;
                        grads.insert(v, g);
                    }
                }
            }
            opt.step(&grads)?;
            let step_s = t0.elapsed().as_secs_f64();
            if step >= 5 {
                rows.push(Parts {
                    step: step_s,
                    data: 0.0,
                    forward: t_fwd,
                    backward: t_bwd - t_fwd,
                    grad_sync: 0.0,
                    optimizer: step_s - t_bwd,
                });
            }
        }
        Ok(Parts::medians(&rows))
    }

    #[cfg(test)]
    mod tests {
        use super::BareGpt;
        use candle_core::{Device, Tensor};
        use kiln_model::{Gpt, GptConfig, GptOptions};

        /// The largest `|x|` of `t`.
        fn max_abs(t: &Tensor) -> f32 {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        }

        /// The bare model is kiln-model's function: with kiln's parameters copied in, the same
        /// loss and the same gradient for every parameter (measured: within ~2e-6 of the
        /// largest gradient; exact GELU instead of the tanh one differs by ~5e-4).
        #[test]
        fn bare_gpt_matches_kiln_loss_and_gradients() {
            let cfg = GptConfig::tiny();
            let kiln = Gpt::new(&cfg, &GptOptions::seeded(7)).unwrap();
            let bare = BareGpt::new(&cfg, 3).unwrap();
            let kiln_params = kiln.named_parameters();
            assert_eq!(kiln_params.len(), bare.named_parameters().len());
            assert_eq!(bare.num_parameters() as u64, cfg.param_count());
            for ((kn, kv), (bn, bv)) in kiln_params.iter().zip(bare.named_parameters()) {
                assert_eq!(kn, bn);
                bv.set(kv.as_tensor()).unwrap();
            }
            let (b, t) = (3, cfg.n_ctx);
            let ids: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 37 % 509) as u32).collect();
            let ids = Tensor::from_vec(ids, (b, t + 1), &Device::Cpu).unwrap();
            let tokens = ids.narrow(1, 0, t).unwrap().contiguous().unwrap();
            let targets = ids.narrow(1, 1, t).unwrap().contiguous().unwrap();
            let lk = kiln.loss(&tokens, &targets).unwrap();
            let lb = bare.loss(&tokens, &targets).unwrap();
            let (fk, fb) = (
                lk.to_scalar::<f32>().unwrap(),
                lb.to_scalar::<f32>().unwrap(),
            );
            assert!((fk - fb).abs() < 1e-5, "loss kiln {fk} bare {fb}");
            let (gk, gb) = (lk.backward().unwrap(), lb.backward().unwrap());
            for ((name, kv), (_, bv)) in kiln_params.iter().zip(bare.named_parameters()) {
                let a = gk.get(kv).unwrap();
                let g = gb.get(bv).unwrap();
                let diff = max_abs(&(a - g).unwrap());
                let scale = max_abs(a);
                assert!(
                    diff <= 2e-5 * scale.max(1e-6),
                    "{name}: max |kiln - bare| {diff}, max |kiln| {scale}"
                );
            }
        }
    }
}
