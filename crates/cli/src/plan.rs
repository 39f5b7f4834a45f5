//! `kiln plan-memory`: memory per rank for a GPT preset under every ZeRO stage, for a given
//! dp x tp grid: the ZeRO paper's model-state accounting (16-bit weights and gradients, fp32
//! master weights and Adam moments: 2 + 2 + 12 bytes per parameter) split over the
//! data-parallel group, the activations of one micro-batch with and without activation
//! checkpointing, and the communication buffers.

use kiln_memory::{MemPrecision, MemoryPlan, RecomputePolicy, ZeroStage};
use kiln_model::GptConfig;
use std::fmt::Write;

/// The precisions `--precision` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanPrecision {
    /// 16-bit weights and gradients with fp32 master weights and moments
    Mixed16,
    /// Everything in f32
    F32,
}

/// `kiln plan-memory`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Example:\n  kiln plan-memory gpt3_175b --dp 64 --tp 8")]
pub struct PlanArgs {
    /// The model preset (tiny, small_cpu, gpt3_small ... gpt3_175b)
    #[arg(value_name = "PRESET", default_value = "gpt3_175b")]
    pub preset: String,
    /// Data-parallel degree
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub dp: u64,
    /// Tensor-parallel degree
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub tp: u64,
    /// Sequences per micro-batch and rank
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub micro_batch: u64,
    /// The precision of the weights and gradients
    #[arg(long, value_enum, default_value_t = PlanPrecision::Mixed16)]
    pub precision: PlanPrecision,
    /// Split the activations tensor parallelism replicates over the tp ranks too
    #[arg(long)]
    pub sequence_parallel: bool,
}

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

impl PlanArgs {
    /// The plan of `stage` with these flags.
    pub fn plan(&self, stage: ZeroStage) -> anyhow::Result<MemoryPlan> {
        let cfg = GptConfig::by_name(&self.preset)?;
        Ok(MemoryPlan {
            shape: cfg.shape(),
            precision: match self.precision {
                PlanPrecision::Mixed16 => MemPrecision::Mixed16,
                PlanPrecision::F32 => MemPrecision::F32,
            },
            stage,
            dp: self.dp,
            tp: self.tp,
            micro_batch: self.micro_batch,
            recompute: RecomputePolicy::EveryBlock,
            bucket_bytes: 25 << 20,
            sequence_parallel: self.sequence_parallel,
        })
    }

    /// The table: a header line, then one row per stage (GiB per rank).
    pub fn table(&self) -> anyhow::Result<String> {
        let shape = GptConfig::by_name(&self.preset)?.shape();
        let mut out = String::new();
        writeln!(
            out,
            "{}: {:.2}B parameters ({} layers, d_model {}, {} heads, ctx {}, vocab {}), dp={} tp={}{}, micro-batch {}, {:?}",
            self.preset,
            shape.params() as f64 / 1e9,
            shape.n_layers,
            shape.d_model,
            shape.n_heads,
            shape.ctx,
            shape.vocab,
            self.dp,
            self.tp,
            if self.sequence_parallel { " sequence-parallel" } else { "" },
            self.micro_batch,
            self.plan(ZeroStage::Replicated)?.precision
        )?;
        writeln!(
            out,
            "{:<11} {:>12} {:>10} {:>12} {:>13} {:>16} {:>9} {:>13} {:>16}",
            "stage",
            "params/rank",
            "weights",
            "gradients",
            "optimizer",
            "model states",
            "comm",
            "activations",
            "act (no ckpt)"
        )?;
        for (name, stage) in [
            ("replicated", ZeroStage::Replicated),
            ("zero-1", ZeroStage::Zero1),
            ("zero-2", ZeroStage::Zero2),
            ("zero-3", ZeroStage::Zero3),
        ] {
            let plan = self.plan(stage)?;
            let e = plan.estimate()?;
            let no_ckpt = MemoryPlan {
                recompute: RecomputePolicy::None,
                ..plan
            }
            .activation_bytes();
            writeln!(
                out,
                "{:<11} {:>12} {:>10} {:>12} {:>13} {:>16} {:>9} {:>13} {:>16}",
                name,
                e.params_per_rank,
                gib(e.weights),
                gib(e.grads),
                gib(e.optimizer),
                gib(e.model_states()),
                gib(e.comm_buffers),
                gib(e.activations),
                gib(no_ckpt)
            )?;
        }
        out.push_str("(GiB per rank; activations for one micro-batch, with every block recomputed unless noted)\n");
        Ok(out)
    }

    /// Prints the table.
    pub fn run(&self) -> anyhow::Result<()> {
        print!("{}", self.table()?);
        Ok(())
    }
}
