//! Training throughput of kiln's step on a GPT, with where the step's time goes.
//!
//! Prints one JSON line: `tokens_per_s` (global tokens over the median step time of steps 5 to
//! 25), the median seconds of each part of a step (`data`: the loader; `forward` and `backward`:
//! the model, recomputation counted as backward; `grad_sync`: waiting for the gradient
//! collectives after the backward; `optimizer`: unscale, norm, clipping, AdamW and the
//! parameter write-back; `other`: the rest), and `peak_rss_mib` (the process's high-water mark).
//!
//! With no arguments: the `small_cpu` preset (vocabulary 8192, context 128, d_model 256, 4
//! layers, 4 heads, tied embeddings), global batch 8, f32, AdamW, one rank, batches from the
//! prepared corpus of `data/` (`.cache/kiln-data`, built on first use).
//!
//! ```text
//! cargo run --release --example bench_train
//! cargo run --release --example bench_train -- --d-model 512 --layers 8 --heads 8 --ctx 256 --batch 4
//! cargo run --release --example bench_train -- --dtype bf16 --dp 2 --zero 1 --checkpointing every_block
//! ```
//!
//! Flags: `--preset NAME`, `--d-model N`, `--layers N`, `--heads N`, `--ctx N` (context and
//! sequence length), `--vocab N`, `--batch N` (global sequences per step), `--dtype
//! f32|bf16|f16`, `--dp N`, `--tp N`, `--zero 0..3`, `--checkpointing none|every_block|every_<k>`,
//! `--steps N` (default 25; the median is over steps 5 to N), `--lr X`.

use kiln_comm::{spawn, Communicator, ThreadComm};
use kiln_data::{prepare_corpus, DataLoader, LoaderConfig, PrepareConfig, Verify};
use kiln_memory::CheckpointPolicy;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::{DataParallel, DataParallelConfig, ParallelDims, Stage};
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

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let known = [
        "--preset",
        "--d-model",
        "--layers",
        "--heads",
        "--ctx",
        "--vocab",
        "--batch",
        "--dtype",
        "--dp",
        "--tp",
        "--zero",
        "--checkpointing",
        "--steps",
        "--lr",
    ];
    for pair in args.chunks(2) {
        if !known.contains(&pair[0].as_str()) || pair.len() < 2 {
            anyhow::bail!(
                "unknown flag or missing value: {:?}; flags: {}",
                pair,
                known.join(" ")
            );
        }
    }
    let flag = |name: &str| {
        args.chunks(2)
            .find(|p| p[0] == name)
            .and_then(|p| p.get(1))
            .cloned()
    };
    let num = |name: &str| -> anyhow::Result<Option<usize>> {
        flag(name)
            .map(|v| {
                v.parse::<usize>()
                    .map_err(|e| anyhow::anyhow!("{name} {v}: {e}"))
            })
            .transpose()
    };
    let preset = flag("--preset").unwrap_or_else(|| "small_cpu".into());
    let mut cfg = GptConfig::by_name(&preset)?;
    if let Some(v) = num("--d-model")? {
        cfg.d_model = v;
    }
    if let Some(v) = num("--layers")? {
        cfg.n_layers = v;
    }
    if let Some(v) = num("--heads")? {
        cfg.n_heads = v;
    }
    if let Some(v) = num("--ctx")? {
        cfg.n_ctx = v;
    }
    if let Some(v) = num("--vocab")? {
        cfg.vocab_size = v;
    }
    cfg.validate()?;
    let seq = cfg.n_ctx;
    let global_batch = num("--batch")?.unwrap_or(8);
    let (dp, tp) = (num("--dp")?.unwrap_or(1), num("--tp")?.unwrap_or(1));
    let stage = Stage::from_number(num("--zero")?.unwrap_or(0) as u8)?;
    let steps = num("--steps")?.unwrap_or(25).max(6);
    let lr: f32 = flag("--lr").map(|v| v.parse()).transpose()?.unwrap_or(1e-3);
    let checkpoint: CheckpointPolicy = flag("--checkpointing")
        .map(|v| v.parse())
        .transpose()
        .map_err(|e| anyhow::anyhow!("--checkpointing: {e}"))?
        .unwrap_or(CheckpointPolicy::None);
    let dtype_name = flag("--dtype").unwrap_or_else(|| "f32".into());
    let dtype = match dtype_name.as_str() {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        "f16" => candle_core::DType::F16,
        other => anyhow::bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    if dp == 0 || global_batch % dp != 0 {
        anyhow::bail!("--batch {global_batch} must be a positive multiple of --dp {dp}");
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
            &GptOptions::seeded(1).with_compute_dtype(dtype),
            tpc.clone(),
        )?;
        let dpc = DataParallelConfig {
            stage,
            max_grad_norm: Some(1.0),
            checkpoint,
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
        let col = |f: fn(&Parts) -> f64| median(rows.iter().map(f).collect());
        Ok(Parts {
            step: col(|p| p.step),
            data: col(|p| p.data),
            forward: col(|p| p.forward),
            backward: col(|p| p.backward),
            grad_sync: col(|p| p.grad_sync),
            optimizer: col(|p| p.optimizer),
        })
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    // the slowest rank sets the pace; the breakdown is rank 0's
    let step_s = results.iter().map(|p| p.step).fold(0.0, f64::max);
    let p = results[0];
    let other = (p.step - p.data - p.forward - p.backward - p.grad_sync - p.optimizer).max(0.0);
    let tokens = (global_batch * seq) as f64;
    println!(
        "{{\"bench\":\"train\",\"preset\":\"{preset}\",\"d_model\":{},\"layers\":{},\"heads\":{},\"ctx\":{seq},\"vocab\":{},\"params\":{},\"batch\":{global_batch},\"dtype\":\"{dtype_name}\",\"dp\":{dp},\"tp\":{tp},\"zero_stage\":{},\"checkpointing\":\"{checkpoint}\",\"steps\":{steps},\"tokens_per_s\":{:.1},\"step_s\":{step_s:.4},\"data_s\":{:.4},\"forward_s\":{:.4},\"backward_s\":{:.4},\"grad_sync_s\":{:.4},\"optimizer_s\":{:.4},\"other_s\":{other:.4},\"peak_rss_mib\":{:.1}}}",
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.vocab_size,
        cfg.param_count(),
        stage.number(),
        tokens / step_s,
        p.data,
        p.forward,
        p.backward,
        p.grad_sync,
        p.optimizer,
        peak_rss_mib()
    );
    Ok(())
}
