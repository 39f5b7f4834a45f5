//! The `kiln` command (`cargo install --path crates/cli`): the programs a user runs around
//! kiln's libraries, one subcommand each, with clap's `--help` on the command and on every
//! subcommand.
//!
//! - `kiln train`: the main job (any run preset or TOML file, any `RunConfig` field as a flag),
//!   exactly what the `train_gpt` example runs and prints ([`train`]);
//! - `kiln launch --nproc-per-node N -- PROGRAM ...` and `kiln supervise -- PROGRAM ...`:
//!   kiln-launch's local launcher and restart supervisor ([`launch`]);
//! - `kiln export-hf` and `kiln import-hf`: a checkpoint to a Hugging Face GPT-2 or Llama folder and back
//!   into a run ([`hf`]);
//! - `kiln sample` and `kiln evaluate`: text from a trained model, and its loss on a text
//!   ([`sample`], [`evaluate`], sharing [`model_args`]);
//! - `kiln plan-memory` and `kiln prepare-data`: memory per rank under each ZeRO stage, and the
//!   default corpus tokenized ([`plan`], [`prepare`]);
//! - `kiln plan-pipeline`: a pipeline schedule's timeline per rank, its bubble against theory
//!   and a PNG of it ([`plan_pipeline`]).
//!
//! Every subcommand is a clap `Args` struct with a `run` method, so a program of one's own can
//! reuse them:
//!
//! ```
//! use clap::Parser;
//! use kiln_cli::{Cli, Command};
//! let cli = Cli::try_parse_from(["kiln", "plan-memory", "tiny", "--dp", "2", "--tp", "1"])?;
//! let Command::PlanMemory(plan) = &cli.command else { unreachable!() };
//! assert_eq!((plan.preset.as_str(), plan.dp, plan.tp), ("tiny", 2, 1));
//! let table = plan.table()?;
//! assert!(table.contains("zero-3"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod evaluate;
pub mod hf;
pub mod launch;
pub mod model_args;
pub mod plan;
pub mod plan_pipeline;
pub mod prepare;
pub mod sample;
pub mod train;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// The `kiln` command line.
#[derive(Debug, Parser)]
#[command(
    name = "kiln",
    version,
    about = "Train, launch, supervise, export, import, sample and evaluate kiln's language models",
    long_about = None,
    propagate_version = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a GPT: the main job (run preset `train_gpt`), another preset, or a TOML file
    Train(train::TrainCommand),
    /// Start a program once per local rank with torchrun's variables (torchrun's
    /// --nproc-per-node)
    Launch(launch::LaunchArgs),
    /// Run a training command and restart it with --resume when it crashes (torchrun's
    /// --max-restarts)
    Supervise(launch::SuperviseArgs),
    /// Write a kiln checkpoint as a Hugging Face GPT-2 or Llama folder
    ExportHf(hf::ExportArgs),
    /// Start a training run from a Hugging Face GPT-2 or Llama folder's weights
    ImportHf(hf::ImportArgs),
    /// Continue a prompt with a trained model (greedy or top-k sampling)
    Sample(sample::SampleArgs),
    /// The mean next-token loss and perplexity of a trained model on a text
    Evaluate(evaluate::EvaluateArgs),
    /// Memory per rank of a GPT preset under every ZeRO stage, for a dp x tp grid
    PlanMemory(plan::PlanArgs),
    /// A pipeline schedule's timeline per rank, its bubble against theory and the activations
    /// each rank holds (GPipe, 1F1B, interleaved, ZB-H1), and a PNG of it
    PlanPipeline(plan_pipeline::PlanPipelineArgs),
    /// Tokenize the default corpus (train a BPE tokenizer, write the token shards)
    PrepareData(prepare::PrepareArgs),
}

impl Command {
    /// Runs the subcommand; its exit code.
    pub fn run(&self) -> anyhow::Result<ExitCode> {
        match self {
            Command::Train(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::Launch(a) => a.run(),
            Command::Supervise(a) => a.run(),
            Command::ExportHf(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::ImportHf(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::Sample(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::Evaluate(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::PlanMemory(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::PlanPipeline(a) => a.run().map(|()| ExitCode::SUCCESS),
            Command::PrepareData(a) => a.run().map(|()| ExitCode::SUCCESS),
        }
    }
}

/// The `kiln` binary: parses the command line (clap prints `--help` and usage errors, exit
/// code 2), runs the subcommand, and prints an error with its causes (exit code 1).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    report(cli.command.run())
}

/// The exit code of a program's result, printing an error and its causes on stderr.
pub fn report(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}
