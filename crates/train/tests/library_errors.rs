//! The errors a program using kiln-train as a library meets first, printed the ways such a
//! program prints them (`{}`, anyhow's `{:#}`, the `source()` chain): a corpus file that is not
//! where `RunConfig.data.data_dir` says is named, on every rank, and a second run into the
//! output folder of a first one is told which configuration fields lead out.
// the shared set-up in `common` unwraps (its helpers are not `#[test]` functions)
#![allow(clippy::unwrap_used)]

mod common;

use anyhow::{anyhow, ensure, Context, Result};
use common::{test_dir, tiny_config};
use kiln_comm::{ThreadComm, ThreadCommConfig};
use kiln_train::{prepare_sources, run_threads, DataSources, RunConfig, TrainError};
use std::error::Error as _;
use std::path::PathBuf;

/// The `tiny` run of `test` reading its corpus (`<test>.txt`) from `data_dir`, which does not
/// exist.
fn missing_corpus_config(test: &str) -> Result<(RunConfig, PathBuf)> {
    let root = test_dir(test);
    let mut cfg = tiny_config(test, &root, test, 20_000);
    let data_dir = root.join("no-such-folder");
    cfg.apply_overrides(&[(
        "data.data_dir",
        data_dir.to_str().context("non-UTF-8 temp dir")?,
    )])?;
    Ok((cfg, data_dir))
}

/// `err`'s message and every source below it, one per line.
fn chain(err: &dyn std::error::Error) -> Vec<String> {
    let mut out = vec![err.to_string()];
    let mut next = err.source();
    while let Some(e) = next {
        out.push(e.to_string());
        next = e.source();
    }
    out
}

#[test]
fn a_missing_corpus_file_is_named_by_every_rank() -> Result<()> {
    let (mut cfg, data_dir) = missing_corpus_config("missing_corpus_ranks")?;
    cfg.apply_overrides(&[("dp", "2")])?;
    let missing = data_dir.join("missing_corpus_ranks.txt");
    let missing = missing.display().to_string();

    let comms = ThreadComm::group(2, ThreadCommConfig::default())?;
    let results: Vec<kiln_train::Result<DataSources>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let cfg = &cfg;
                s.spawn(move || prepare_sources(cfg, &comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a rank panicked")))
            .collect::<Result<_>>()
    })?;
    let [first, second] = <[_; 2]>::try_from(results).map_err(|_| anyhow!("two results"))?;

    // rank 0 prepared, and failed: the file is in the message, kiln-data's error is the source
    let e0 = first.err().context("rank 0 should fail")?;
    let text0 = e0.to_string();
    ensure!(
        matches!(&e0, TrainError::Prepare { corpora, data_dir: d, .. }
            if corpora == &["missing_corpus_ranks"] && d == &data_dir),
        "{e0:?}"
    );
    ensure!(text0.contains(&missing), "{text0}");
    ensure!(text0.contains("No such file"), "{text0}");
    let below = chain(&e0);
    ensure!(below.len() >= 3, "{below:?}");
    ensure!(below[1].contains(&missing), "{below:?}");
    let io = e0
        .source()
        .and_then(|s| s.source())
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .context("the io::Error at the bottom of the chain")?;
    ensure!(io.kind() == std::io::ErrorKind::NotFound, "{io:?}");

    // rank 1 waited for rank 0 and carries its message
    let e1 = second.err().context("rank 1 should fail")?;
    ensure!(
        matches!(&e1, TrainError::Rank { rank: 0, message } if *message == text0),
        "{e1:?}"
    );
    ensure!(e1.to_string().contains(&missing), "{e1}");
    Ok(())
}

#[test]
fn a_missing_corpus_file_is_named_however_the_error_is_printed() -> Result<()> {
    let (cfg, data_dir) = missing_corpus_config("missing_corpus_printed")?;
    let missing = data_dir.join("missing_corpus_printed.txt");
    let missing = missing.display().to_string();
    let err = run_threads(&cfg).err().context("the run should fail")?;
    let plain = err.to_string();
    ensure!(plain.starts_with("cannot prepare the corpus"), "{plain}");
    ensure!(plain.contains(&missing), "{plain}");
    let any = anyhow::Error::from(err);
    for printed in [format!("{any}"), format!("{any:#}"), format!("{any:?}")] {
        ensure!(printed.contains(&missing), "{printed}");
    }
    Ok(())
}

#[test]
fn a_second_run_into_the_same_output_dir_names_the_fields_to_set() -> Result<()> {
    let root = test_dir("library_second_run");
    // a corpus of its own: tests preparing one corpus in one cache folder at once would race
    let mut cfg = tiny_config("library_second_run", &root, "library_second_run", 200_000);
    cfg.apply_overrides(&[("steps", "2"), ("warmup", "1"), ("ckpt_every", "2")])?;
    let first = run_threads(&cfg)?;
    ensure!(first.checkpoints == [2], "{:?}", first.checkpoints);

    let err = run_threads(&cfg)
        .err()
        .context("the second run should fail")?;
    let msg = err.to_string();
    ensure!(matches!(err, TrainError::Config { .. }), "{msg}");
    let dir = cfg.checkpoint_dir().display().to_string();
    ensure!(msg.contains(&dir), "{msg}");
    // the fields a library caller sets, each with the flag that sets it in parentheses
    ensure!(
        msg.contains("set checkpoint.resume = true (--resume) to continue it"),
        "{msg}"
    );
    ensure!(msg.contains("or output_dir (--out DIR)"), "{msg}");

    // doing what it says works: resume, or another output folder
    cfg.apply_overrides(&[("checkpoint.resume", "true"), ("steps", "3")])?;
    ensure!(run_threads(&cfg)?.resumed_from == Some(2));
    cfg.apply_overrides(&[("checkpoint.resume", "false")])?;
    cfg.output_dir = root.join("another");
    ensure!(run_threads(&cfg)?.resumed_from.is_none());
    Ok(())
}

#[test]
fn a_missing_config_file_is_named_with_its_cause() -> Result<()> {
    let path = test_dir("library_missing_toml").join("run.toml");
    let err = RunConfig::from_toml_file(&path)
        .err()
        .context("no such file")?;
    let text = err.to_string();
    ensure!(text.contains(&path.display().to_string()), "{text}");
    let io = err
        .source()
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .context("the io::Error is the source")?;
    ensure!(text.ends_with(&io.to_string()), "{text}");

    std::fs::write(&path, "[train]\nsteps = \"many\"\n")?;
    let err = RunConfig::from_toml_file(&path)
        .err()
        .context("a bad value")?;
    let text = err.to_string();
    ensure!(matches!(err, TrainError::Parse { .. }), "{text}");
    ensure!(text.contains(&path.display().to_string()), "{text}");
    let parser = err.source().context("the parser's error is the source")?;
    ensure!(text.ends_with(&parser.to_string()), "{text}");
    Ok(())
}
