//! The README's Rust snippets, as written, in a new crate outside the workspace that depends on
//! kiln by path: what a new user does after `cargo new`.
//!
//! Every ```` ```rust ```` block of `README.md` (read from the file, not copied here) becomes one
//! binary of a scratch crate, its lines wrapped in
//! `fn main() -> Result<(), Box<dyn std::error::Error>> { ... Ok(()) }`. The crate lives in a
//! fresh folder under the system's temporary directory, beside `kiln`, a symlink to this
//! workspace, which is the layout the README describes (a clone of kiln beside your crate; the
//! trainer snippet reads `../kiln/data`). Its `Cargo.toml` depends on
//! `kiln = { path = "<this workspace>" }`, its `Cargo.lock` is the workspace's (the same
//! versions), and it is built with `cargo build --release --offline` (no test touches the
//! network: the workspace's own build has filled the registry) into the target folder this
//! test was built in, with the workspace's release profile and the workspace's feature set of
//! the registry crates: those the workspace build has compiled are reused as they are, and only
//! kiln's own crates compile again (about 1.5 minutes on 2 cores; a target folder of its own
//! compiled everything again, 11.5 minutes).
//! Each snippet then runs with `cargo run --release --offline` from the crate's folder:
//! - every snippet exits with status 0 (the communication snippet asserts its own numbers);
//! - the trainer snippet prints a validation loss at least 1.5 nats below ln(vocabulary), the
//!   loss of a uniform prediction (9.01 for the vocabulary of 8192; 6.74 here after its 20
//!   steps), and leaves its metrics and the checkpoint of its last step in `runs/readme`;
//! - run a second time, it stops with an error naming `checkpoint.resume`, as the README says.
//!
//! The prepared corpus is cached under the target's temporary folder (`KILN_DATA_CACHE`, which
//! the README names beside the snippet), so only the first run tokenizes it.
//!
//! Without `cargo` on the machine the test prints `skipped: <reason>` and passes, except under
//! `CI=true`, where it fails.

use anyhow::{bail, ensure, Context, Result};
use kiln_testkit::{run_with_deadline, ProcessRun};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Building the scratch crate: kiln's crates, or everything when the workspace build has not
/// compiled the registry crates first.
const BUILD_DEADLINE: Duration = Duration::from_secs(40 * 60);
/// One run of a snippet.
const RUN_DEADLINE: Duration = Duration::from_secs(10 * 60);

/// The workspace root.
fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The contents of every ```` ```rust ```` block of `markdown`, in order.
fn rust_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        let fence = line.trim_start();
        match current.as_mut() {
            None if fence.trim_end() == "```rust" => current = Some(String::new()),
            None => {}
            Some(_) if fence.starts_with("```") => blocks.extend(current.take()),
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
        }
    }
    blocks
}

/// A snippet as the body of a `main` that returns its errors.
fn as_main(snippet: &str) -> String {
    let body: String = snippet
        .lines()
        .map(|l| {
            if l.is_empty() {
                "\n".to_string()
            } else {
                format!("    {l}\n")
            }
        })
        .collect();
    format!("fn main() -> Result<(), Box<dyn std::error::Error>> {{\n{body}    Ok(())\n}}\n")
}

/// The cargo this test runs under (or the one on `PATH`), if it answers `--version`.
fn find_cargo() -> Option<PathBuf> {
    let cargo = std::env::var_os("CARGO").map_or_else(|| PathBuf::from("cargo"), PathBuf::from);
    let ok = Command::new(&cargo)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(cargo)
}

/// The target folder this test was built in (`CARGO_TARGET_DIR` or the workspace's `target`).
fn target_dir() -> &'static Path {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp)
}

/// `cargo <args>` in `dir` with the workspace's target folder and no colours.
fn cargo(cargo: &Path, dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(cargo);
    cmd.args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir())
        .env("CARGO_TERM_COLOR", "never")
        .env(
            "KILN_DATA_CACHE",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme-data-cache"),
        )
        .env("RUST_BACKTRACE", "0");
    cmd
}

/// Runs `cmd` to its end or `deadline`, failing with its output when it does not succeed.
fn succeed(what: &str, cmd: Command, deadline: Duration) -> Result<ProcessRun> {
    let run = run_with_deadline(cmd, deadline);
    ensure!(run.success(), "{what} failed: {}", run.output());
    println!("{what}: {:.1?}", run.elapsed);
    Ok(run)
}

/// The number in `validation loss Some(<number>)` of the trainer snippet's output.
fn validation_loss(stdout: &str) -> Result<f64> {
    let rest = stdout
        .split("validation loss Some(")
        .nth(1)
        .context("no `validation loss Some(...)` printed")?;
    let number = rest.split(')').next().unwrap_or_default();
    number
        .parse()
        .with_context(|| format!("validation loss {number:?} is not a number"))
}

/// A fresh folder `<tmp>/kiln-readme-<pid>` holding `kiln` (a symlink to the workspace) and the
/// scratch crate `app` with one binary `readme_snippet_<i>` per snippet.
fn scratch_crate(snippets: &[String]) -> Result<(PathBuf, PathBuf)> {
    let root = std::env::temp_dir().join(format!("kiln-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let app = root.join("app");
    std::fs::create_dir_all(app.join("src/bin"))?;
    #[cfg(unix)]
    std::os::unix::fs::symlink(repo(), root.join("kiln"))?;
    #[cfg(not(unix))]
    bail!("the scratch crate's `../kiln` is a symlink: a Unix test");
    let path = repo().canonicalize()?;
    let path = path.to_str().context("non-UTF-8 workspace path")?;
    // what `cargo new` writes, the dependency, and the workspace's release profile (so the
    // registry crates are the workspace build's); `[workspace]` keeps it a workspace of its
    // own wherever the temporary folder is. clap with `derive`, which no snippet uses, gives
    // the registry crates the workspace's features (kiln-cli's clap turns on syn's `full`,
    // which every serde-derived crate below candle sees): without it they compile again
    let profile = release_profile(&std::fs::read_to_string(repo().join("Cargo.toml"))?);
    let manifest = format!(
        "[package]\nname = \"readme-snippets\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
         publish = false\n\n[dependencies]\nkiln = {{ path = {path:?} }}\n\
         clap = {{ version = \"4\", features = [\"derive\"] }}\n\n{profile}\n[workspace]\n"
    );
    std::fs::write(app.join("Cargo.toml"), manifest)?;
    std::fs::copy(repo_lock()?, app.join("Cargo.lock"))?;
    for (i, s) in snippets.iter().enumerate() {
        std::fs::write(
            app.join(format!("src/bin/readme_snippet_{i}.rs")),
            as_main(s),
        )?;
    }
    Ok((root, app))
}

/// The `[profile.release]` table of a manifest and its per-package tables
/// (`[profile.release.package."*"]`), headers included (empty when it has none).
fn release_profile(manifest: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        let header = line.trim_start().starts_with('[');
        if header {
            let h = line.trim();
            inside = h == "[profile.release]" || h.starts_with("[profile.release.package.");
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The workspace's `Cargo.lock`.
fn repo_lock() -> Result<PathBuf> {
    let lock = repo().join("Cargo.lock");
    ensure!(lock.is_file(), "{} is missing", lock.display());
    Ok(lock)
}

#[test]
fn readme_rust_snippets_run_as_written_from_a_new_crate() -> Result<()> {
    let Some(cargo_bin) = find_cargo() else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            bail!("cargo not found (neither $CARGO nor cargo on PATH) under CI=true");
        }
        println!("skipped: cargo not found (neither $CARGO nor cargo on PATH)");
        return Ok(());
    };
    let readme = std::fs::read_to_string(repo().join("README.md"))?;
    let snippets = rust_blocks(&readme);
    let trainer: Vec<usize> = (0..snippets.len())
        .filter(|&i| snippets[i].contains("kiln::train::run_threads"))
        .collect();
    ensure!(
        snippets.len() >= 2 && trainer.len() == 1,
        "README.md should hold the communication snippet and one trainer snippet, found {} \
         rust blocks ({} with kiln::train::run_threads)",
        snippets.len(),
        trainer.len()
    );
    let (root, app) = scratch_crate(&snippets)?;

    let build = cargo(
        &cargo_bin,
        &app,
        &["build", "--release", "--offline", "--bins"],
    );
    succeed(
        "cargo build --release (the scratch crate)",
        build,
        BUILD_DEADLINE,
    )?;

    for i in 0..snippets.len() {
        let bin = format!("readme_snippet_{i}");
        let args = ["run", "--release", "--offline", "--quiet", "--bin", &bin];
        let start = Instant::now();
        let run = succeed(
            &format!("README snippet {i}"),
            cargo(&cargo_bin, &app, &args),
            RUN_DEADLINE,
        )?;
        if i != trainer[0] {
            continue;
        }
        print!("{}", run.stdout);
        let vocab = kiln_train::RunConfig::preset("train_gpt")?
            .gpt_config()?
            .vocab_size;
        let uniform = (vocab as f64).ln();
        let loss = validation_loss(&run.stdout)?;
        ensure!(
            loss.is_finite() && loss < uniform - 1.5,
            "validation loss {loss} after the snippet's training, a uniform prediction's is \
             {uniform:.2}"
        );
        let out = app.join("runs/readme");
        ensure!(out.join("metrics.jsonl").is_file(), "{}", run.output());
        let last = out.join("checkpoints/step-00000020");
        ensure!(last.is_dir(), "no checkpoint {}", last.display());
        println!("trainer snippet: {:.1?}", start.elapsed());

        // the same program again into the same output folder: the error says what to set
        let again = run_with_deadline(cargo(&cargo_bin, &app, &args), RUN_DEADLINE);
        ensure!(
            again.status.is_some() && !again.success(),
            "a second run into runs/readme should stop with an error: {}",
            again.output()
        );
        ensure!(
            again.stderr.contains("checkpoint.resume"),
            "the second run's error should name checkpoint.resume: {}",
            again.output()
        );
    }
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

#[test]
fn rust_blocks_are_found_and_wrapped() {
    let md = "text\n```rust\nlet a = 1;\n\nassert_eq!(a, 1);\n```\n```sh\nls\n```\n  ```rust\nx()?;\n  ```\n";
    let blocks = rust_blocks(md);
    assert_eq!(blocks, ["let a = 1;\n\nassert_eq!(a, 1);\n", "x()?;\n"]);
    assert_eq!(
        as_main(&blocks[1]),
        "fn main() -> Result<(), Box<dyn std::error::Error>> {\n    x()?;\n    Ok(())\n}\n"
    );
    assert_eq!(
        validation_loss("validation loss Some(6.25) at 480 tokens/s\n").ok(),
        Some(6.25)
    );
    assert!(validation_loss("validation loss None at 480 tokens/s").is_err());
    let manifest = "[package]\nname = \"x\"\n\n[profile.release]\ndebug = 1\n\n\
                    [profile.release.package.\"*\"]\ndebug = false\n\n[profile.dev]\n";
    assert_eq!(
        release_profile(manifest),
        "[profile.release]\ndebug = 1\n\n[profile.release.package.\"*\"]\ndebug = false\n\n"
    );
}
