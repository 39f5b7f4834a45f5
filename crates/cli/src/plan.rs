//! `kiln plan-memory`: memory per rank for a GPT or Llama preset under every ZeRO stage, for a given
//! dp x tp grid: the ZeRO paper's model-state accounting (16-bit weights and gradients, fp32
//! master weights and Adam moments: 2 + 2 + 12 bytes per parameter) split over the
//! data-parallel group, the activations of one micro-batch with and without activation
//! checkpointing, and the communication buffers. With `--pp`, the memory of each pipeline rank
//! instead (kiln-memory's [`MemoryPlan::estimate_stage`]): its stage's parameters under one
//! ZeRO stage, and the activations its schedule holds in flight.

use kiln_memory::{
    MemPrecision, MemoryPlan, PipelinePlan, PipelineSchedule, RecomputePolicy, ZeroStage,
};
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
#[command(
    after_help = "Examples:\n  kiln plan-memory gpt3_175b --dp 64 --tp 8\n  kiln plan-memory llama3_70b --dp 8 --tp 8 --sequence-parallel\n  kiln plan-memory gpt3_175b --tp 8 --pp 16 --dp 12 --micro-batches 128 --schedule 1f1b"
)]
pub struct PlanArgs {
    /// The model preset (tiny, small_cpu, gpt3_small ... gpt3_175b, llama_tiny, llama_cpu,
    /// llama3_8b, llama3_70b, llama3_405b)
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
    /// Activation recomputation (none, every_block, every_K, selective or selective_K)
    #[arg(long, value_name = "POLICY", default_value = "every_block")]
    pub recompute: RecomputePolicy,
    /// Pipeline-parallel degree: print each pipeline rank's memory instead of the ZeRO table
    #[arg(long, value_name = "N")]
    pub pp: Option<u64>,
    /// Model chunks per pipeline rank (the interleaved schedule's v)
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub virtual_stages: u64,
    /// Micro-batches per step [default: 4 x pp]
    #[arg(long, value_name = "N")]
    pub micro_batches: Option<u64>,
    /// The pipeline schedule (gpipe, 1f1b, interleaved, zb_h1)
    #[arg(long, value_name = "NAME", default_value = "1f1b")]
    pub schedule: PipelineSchedule,
    /// The ZeRO stage of the pipeline table, inside each stage's dp group (0-3)
    #[arg(long, value_name = "STAGE", default_value = "1")]
    pub zero: ZeroStage,
    /// Blocks of each model stage, first to last, comma-separated [default: the even split]
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    pub stage_blocks: Option<Vec<u64>>,
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
            recompute: self.recompute,
            bucket_bytes: 25 << 20,
            sequence_parallel: self.sequence_parallel,
        })
    }

    /// The pipeline `--pp` and the flags beside it describe, if `--pp` was given.
    pub fn pipeline(&self) -> Option<PipelinePlan> {
        let pp = self.pp?;
        Some(PipelinePlan {
            stage_blocks: self.stage_blocks.clone(),
            ..PipelinePlan::new(
                pp,
                self.virtual_stages,
                self.micro_batches.unwrap_or(4 * pp),
                self.schedule,
            )
        })
    }

    /// The model's line: parameters, shape (and the layout, where it is not GPT's), degrees,
    /// micro-batch and precision.
    fn header(&self) -> anyhow::Result<String> {
        let cfg = GptConfig::by_name(&self.preset)?;
        let shape = cfg.shape();
        let mut layout = String::new();
        if !cfg.is_gpt_layout() {
            write!(layout, "; {}, MLP width {}", cfg.describe(), shape.d_ff())?;
            if shape.kv_replicated(self.tp) {
                layout.push_str(", key/value projections replicated on every tp rank");
            }
        }
        Ok(format!(
            "{}: {:.2}B parameters ({} layers, d_model {}, {} heads, ctx {}, vocab {}{layout}), dp={} tp={}{}, micro-batch {}, {:?}\n",
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
        ))
    }

    /// The table: a header line, then one row per stage (GiB per rank); with `--pp`, one row
    /// per pipeline rank ([`PlanArgs::pipeline_table`]).
    pub fn table(&self) -> anyhow::Result<String> {
        if let Some(pipeline) = self.pipeline() {
            return self.pipeline_table(&pipeline);
        }
        let mut out = self.header()?;
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
        if self.recompute == RecomputePolicy::EveryBlock {
            out.push_str("(GiB per rank; activations for one micro-batch, with every block recomputed unless noted)\n");
        } else {
            writeln!(
                out,
                "(GiB per rank; activations for one micro-batch, with {} recomputation unless noted)",
                self.recompute
            )?;
        }
        Ok(out)
    }

    /// One row per pipeline rank under `pipeline` and `--zero` (GiB per rank), and the largest.
    pub fn pipeline_table(&self, pipeline: &PipelinePlan) -> anyhow::Result<String> {
        let plan = self.plan(self.zero)?;
        let stages = plan.estimate_pipeline(pipeline)?;
        let mut out = self.header()?;
        writeln!(
            out,
            "pipeline: pp={} virtual stages {}, {} micro-batches, {} schedule, {} over dp={}, {} recomputation",
            pipeline.pp,
            pipeline.virtual_stages,
            pipeline.micro_batches,
            pipeline.schedule,
            plan.stage,
            plan.dp,
            plan.recompute
        )?;
        writeln!(
            out,
            "{:<6} {:>6} {:>12} {:>9} {:>10} {:>10} {:>13} {:>7} {:>10} {:>12} {:>9}",
            "rank",
            "blocks",
            "params/rank",
            "weights",
            "gradients",
            "optimizer",
            "model states",
            "comm",
            "in flight",
            "activations",
            "total"
        )?;
        for e in &stages {
            let m = &e.memory;
            writeln!(
                out,
                "{:<6} {:>6} {:>12} {:>9} {:>10} {:>10} {:>13} {:>7} {:>10} {:>12} {:>9}",
                e.rank,
                e.blocks,
                m.params_per_rank,
                gib(m.weights),
                gib(m.grads),
                gib(m.optimizer),
                gib(m.model_states()),
                gib(m.comm_buffers),
                e.in_flight,
                gib(m.activations),
                gib(e.total())
            )?;
        }
        // the first of the largest
        if let Some(top) = stages.iter().rev().max_by_key(|e| e.total()) {
            writeln!(
                out,
                "largest: rank {} with {} GiB ({:.2} GB)",
                top.rank,
                gib(top.total()),
                top.total() as f64 / 1e9
            )?;
        }
        out.push_str("(GiB per rank; in flight: micro-batches of one model chunk held at the schedule's peak, activations then; rank 0 holds the embedding, the last rank the head and the tied embedding's copy)\n");
        Ok(out)
    }

    /// Prints the table.
    pub fn run(&self) -> anyhow::Result<()> {
        print!("{}", self.table()?);
        Ok(())
    }
}
