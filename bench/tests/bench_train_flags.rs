//! `bench_train` refuses what it cannot run before it prepares data or builds a model: a
//! `--bare-candle` Llama, and Llama sizes on a GPT.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn refused(flags: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_bench_train"))
        .args(flags)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{flags:?} ran");
    assert!(out.stdout.is_empty(), "{flags:?} printed a result");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_llama_is_refused_by_the_bare_candle_loop() {
    for flags in [
        &["--arch", "llama", "--bare-candle"][..],
        &["--preset", "llama_tiny", "--bare-candle"][..],
    ] {
        let err = refused(flags);
        assert!(
            err.contains("--bare-candle trains the GPT layout only"),
            "{err}"
        );
        assert!(err.contains("llama"), "{err}");
    }
}

#[test]
fn llama_sizes_on_a_gpt_are_refused() {
    let err = refused(&["--kv-heads", "2"]);
    assert!(err.contains("--kv-heads sizes a Llama"), "{err}");
    let err = refused(&["--arch", "llama", "--preset", "small_cpu"]);
    assert!(
        err.contains("--arch llama with --preset small_cpu"),
        "{err}"
    );
    let err = refused(&["--arch", "mamba"]);
    assert!(err.contains("gpt") && err.contains("llama"), "{err}");
}
