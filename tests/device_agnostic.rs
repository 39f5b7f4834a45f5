//! The device is configuration: library code creates no tensor on `Device::Cpu` of its own
//! accord. Every `Device::Cpu` left in a library source file (comments, doc examples and unit
//! tests aside) is listed here with the reason it is a host buffer or a default; a new one
//! fails this test until it is justified.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

/// `(file, what the line contains, why the CPU is right there)`.
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "crates/model/src/options.rs",
        "device: Device::Cpu",
        "GptOptions' default; RunConfig.device and GptOptions::with_device choose",
    ),
    (
        "crates/parallel/src/engine/data_parallel.rs",
        "unwrap_or(Device::Cpu)",
        "an engine with no parameters at all has no device to take",
    ),
    (
        "crates/train/src/trainer/eval.rs",
        "candle_core::Device::Cpu",
        "tensor-parallel shards unsplit on the host for the host-side parameter list",
    ),
    (
        "crates/tune/src/int8.rs",
        "device: Device::Cpu",
        "the int8 inference kernels are host code: load_int8 builds its model on the CPU",
    ),
    (
        "crates/train/src/peak.rs",
        "Device::Cpu => {",
        "a match on the run's device: the CPU's peak comes from its cores, clock and vectors",
    ),
    (
        "crates/model/src/device.rs",
        "DeviceSpec::Cpu => Ok(Device::Cpu)",
        "the CPU device spec opens the CPU",
    ),
];

/// Whether `f` is a `tests.rs` that its parent module (`dir.rs` beside `dir/`) declares as
/// `#[cfg(test)] mod tests;`: test code in a file of its own.
fn is_test_module_file(f: &Path) -> bool {
    if f.file_name().and_then(|n| n.to_str()) != Some("tests.rs") {
        return false;
    }
    let Some(dir) = f.parent() else {
        return false;
    };
    let parent = dir.with_extension("rs");
    std::fs::read_to_string(parent)
        .map(|t| t.contains("#[cfg(test)]\nmod tests;"))
        .unwrap_or(false)
}

/// The lines of library code: up to a `#[cfg(test)]` module, without comments.
fn code_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push((i + 1, line));
    }
    out
}

#[test]
fn library_code_puts_nothing_on_the_cpu_unasked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let dir = krate.unwrap().path();
        if dir.ends_with("testkit") {
            continue; // test support, not library code
        }
        files.extend(kiln_testkit::rust_sources(&dir.join("src")));
    }
    let mut unexplained = Vec::new();
    let mut allowed_hits = 0;
    for f in &files {
        let rel = f
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if is_test_module_file(f) {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in code_lines(&text) {
            if !line.contains("Device::Cpu") {
                continue;
            }
            if ALLOWED
                .iter()
                .any(|(file, what, _)| *file == rel && line.contains(what))
            {
                allowed_hits += 1;
            } else {
                unexplained.push(format!("{rel}:{n}: {}", line.trim()));
            }
        }
    }
    println!(
        "{} library files scanned, {allowed_hits} justified Device::Cpu",
        files.len()
    );
    assert!(
        unexplained.is_empty(),
        "Device::Cpu in library code; take the device from the configuration or the input \
         tensors, or justify it in tests/device_agnostic.rs:\n{}",
        unexplained.join("\n")
    );
    assert!(files.len() > 50, "only {} files found", files.len());
}
