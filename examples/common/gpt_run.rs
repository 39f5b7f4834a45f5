//! The shared body of the `train_gpt*` examples: parse the flags over a run preset, train with
//! kiln-train's `Trainer` on thread ranks (`--backend thread`) or one rank per process
//! (`--backend mpi` under `mpirun -np <dp*tp>`), print the summary, and generate a sample
//! with the trained model. Only the process that holds rank 0 prints.

use kiln_comm::launch::{Backend, LaunchEnv};
use kiln_model::{generate, Sampling};
use kiln_train::{run_with, RunConfig, TrainSummary, Trainer};
use std::time::Instant;

/// Trains the `preset` run with the command line's overrides (`--steps 100 --dp 2 ...`).
pub fn main_for(preset: &str) -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: {preset} [flags]\n\n{}",
            RunConfig::args_help(preset)?
        );
        return Ok(());
    }
    let cfg = RunConfig::from_args(preset, std::env::args().skip(1))?;
    cfg.validate()?;
    // thread ranks outnumbering the cores run their ops on their own threads, not queued for
    // candle's one worker pool (before any tensor op: it sizes the pool)
    let serial_ops = kiln_train::one_op_thread_per_rank(&cfg);
    // one process prints: the only one (threads), or the launcher's rank 0
    let main_process = cfg.parallel.backend == Backend::Thread || LaunchEnv::from_env()?.rank == 0;
    if main_process {
        print_header(preset, &cfg)?;
        if serial_ops && cfg.parallel.world() > 1 {
            println!(
                "  each thread rank runs its ops on its own thread ({} ranks, {} cores)",
                cfg.parallel.world(),
                std::thread::available_parallelism().map_or(1, |n| n.get())
            );
        }
    }
    let t0 = Instant::now();
    let tokenizer_path = cfg.data_cache_dir()?.join("tokenizer.json");
    let results = run_with(&cfg, |ctx| {
        let mut trainer = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        let engine = trainer.engine();
        if engine.is_device_resident() && engine.dp_dims().1 == 0 && engine.tp_dims().1 == 0 {
            println!(
                "  optimizer step device-resident: fp32 master weights, gradients and AdamW moments on {}",
                ctx.config.device
            );
        }
        while trainer.step() < ctx.config.train.steps {
            trainer.train_step()?;
        }
        // ZeRO-3 keeps only shards: gather them into the model's variables to generate
        trainer.materialize_weights()?;
        // every rank runs the generation (tensor-parallel ranks in lockstep, same seed)
        let tok = kiln_data::Tokenizer::from_file(&tokenizer_path)?;
        let prompt = tok.encode("ROMEO:\nBut soft, what light")?;
        let out = generate(
            trainer.model(),
            &prompt,
            60,
            Sampling::TopK {
                k: 40,
                temperature: 0.8,
            },
            7,
        )?;
        let text = tok.decode(&out)?;
        Ok((trainer.finish()?, text))
    })?;
    if let Some((_, (summary, sample))) = results.into_iter().find(|(rank, _)| *rank == 0) {
        report(&summary, &sample, t0.elapsed().as_secs_f64());
    }
    Ok(())
}

fn print_header(preset: &str, cfg: &RunConfig) -> anyhow::Result<()> {
    let gpt = cfg.gpt_config()?;
    println!(
        "kiln {preset}: GPT-3 architecture scaled down ({} layers, d_model {}, {} heads, ctx {}, vocab {}: {:.2}M parameters)",
        gpt.n_layers,
        gpt.d_model,
        gpt.n_heads,
        cfg.train.seq_len,
        gpt.vocab_size,
        gpt.param_count() as f64 / 1e6
    );
    println!(
        "  {} {} as dp={} x tp={}{}, ZeRO-{}, {} compute{}, {} steps of {} sequences, checkpointing {}, on {}",
        cfg.parallel.world(),
        match cfg.parallel.backend { Backend::Thread => "thread ranks", Backend::Mpi => "MPI processes", _ => "NCCL processes" },
        cfg.parallel.dp,
        cfg.parallel.tp,
        if cfg.parallel.sequence_parallel && cfg.parallel.tp > 1 { " (sequence-parallel)" } else { "" },
        cfg.parallel.zero,
        cfg.precision.compute,
        if cfg.precision.compute == kiln_precision::ComputeDType::F32 { "" } else { " with dynamic loss scaling" },
        cfg.train.steps,
        cfg.train.micro_batch * cfg.train.accumulation * cfg.parallel.dp,
        cfg.train.activation_checkpointing,
        cfg.device
    );
    if !cfg.data.mixture.is_empty() {
        let points: Vec<String> = cfg
            .data
            .mixture
            .points
            .iter()
            .map(|p| format!("from step {}: {:?}", p.step, p.weights))
            .collect();
        println!(
            "  corpora {:?} mixed by schedule: {}",
            cfg.data.corpora,
            points.join("; ")
        );
    }
    Ok(())
}

fn report(summary: &TrainSummary, sample: &str, wall: f64) {
    println!();
    println!(
        "done: {} steps in {wall:.1} s ({:.0} tokens/s over the run)",
        summary.steps, summary.tokens_per_s
    );
    if let Some(l) = summary.final_loss {
        println!("  final training loss {l:.4}");
    }
    if let Some(v) = summary.val_loss {
        println!("  validation loss     {v:.4} (perplexity {:.1})", v.exp());
    }
    if let Some(r) = summary.resumed_from {
        println!("  resumed from the step-{r} checkpoint");
    }
    if !summary.rollbacks.is_empty() {
        println!("  rollbacks: {:?}", summary.rollbacks);
    }
    println!("  skipped steps: {}", summary.skipped_steps);
    let last_mfu = summary.last_metrics.as_ref().and_then(|m| m.mfu);
    if let (Some(mfu), Some(peak)) = (last_mfu, &summary.mfu_peak) {
        println!("  mfu {:.1}% at the last step, of the {peak}", mfu * 100.0);
    }
    for (name, q) in &summary.quality {
        println!(
            "  quality filter    {name}: kept {} of {} documents, {} of {} tokens (perplexity <= {:.1})",
            q.docs_kept,
            q.docs_kept + q.docs_dropped,
            q.tokens_kept,
            q.tokens_kept + q.tokens_dropped,
            q.threshold
        );
    }
    let seen: u64 = summary.source_samples.iter().map(|(_, n)| n).sum();
    if summary.source_samples.len() > 1 && seen > 0 {
        let mix: Vec<String> = summary
            .source_samples
            .iter()
            .map(|(name, n)| format!("{name} {:.1}%", 100.0 * *n as f64 / seen as f64))
            .collect();
        println!("  realised mixture  {} ({seen} samples)", mix.join(", "));
    }
    if let Some((kl, threshold)) = summary.drift {
        println!(
            "  data drift        KL {kl:.4} nats over the last window (alert above {threshold:.4}; raised {} time(s))",
            summary.drift_alerts
        );
    }
    let o = &summary.outputs;
    for (what, p) in [
        ("metrics (JSONL)", &o.jsonl),
        ("TensorBoard", &o.tensorboard),
        ("loss plot", &o.png),
        ("checkpoints", &o.checkpoints),
    ] {
        if let Some(p) = p {
            println!("  {what:<16} {}", p.display());
        }
    }
    println!();
    println!("sample (top-k 40, temperature 0.8):\n{sample}");
}
