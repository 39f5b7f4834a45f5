//! With the `cuda` feature: compiles each of kiln's CUDA kernel sources (`src/cuda/*.cu`) with
//! nvcc to PTX for the compute capability in `CUDA_COMPUTE_CAP` (as candle's own kernels), and
//! assembles the PTX with ptxas, so a kernel that does not compile fails the build on a
//! machine without a GPU. Without the feature nothing happens.

use std::path::PathBuf;
use std::process::Command;

/// A CUDA tool: `CUDA_ROOT/bin/<name>` when that exists, else `<name>` on `PATH`.
fn tool(name: &str) -> PathBuf {
    if let Some(root) = std::env::var_os("CUDA_ROOT") {
        let p = PathBuf::from(root).join("bin").join(name);
        if p.exists() {
            return p;
        }
    }
    PathBuf::from(name)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| {
        format!(
            "cannot run {:?}: {e} (install CUDA's compiler: see docs/gpu.md)",
            cmd.get_program()
        )
    })?;
    if !out.status.success() {
        return Err(format!(
            "{:?} failed:\n{}{}",
            cmd,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

fn compile(source: &str, stem: &str) -> Result<(), String> {
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: u32 = cap
        .trim()
        .trim_start_matches("sm_")
        .parse()
        .map_err(|_| format!("CUDA_COMPUTE_CAP must be a number such as 90, got {cap:?}"))?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let ptx = out_dir.join(format!("{stem}.ptx"));
    let mut nvcc = Command::new(tool("nvcc"));
    nvcc.args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg(source);
    if let Some(root) = std::env::var_os("CUDA_ROOT") {
        nvcc.arg("-I").arg(PathBuf::from(root).join("include"));
    }
    run(&mut nvcc)?;
    // the PTX must also assemble to machine code for the target (what the driver JITs)
    run(Command::new(tool("ptxas"))
        .arg(format!("-arch=sm_{cap}"))
        .arg("-o")
        .arg(out_dir.join(format!("{stem}.cubin")))
        .arg(&ptx))?;
    Ok(())
}

/// The kernel sources and the stems of their PTX files (`OUT_DIR/<stem>.ptx`, which
/// `src/cuda/*.rs` embed).
const KERNELS: [(&str, &str); 3] = [
    ("src/cuda/ops.cu", "kiln_kernels_ops"),
    ("src/cuda/attn.cu", "kiln_kernels_attn"),
    ("src/cuda/step.cu", "kiln_kernels_step"),
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_kernels(&KERNELS);
}

/// Compiles each `(source, stem)` to `OUT_DIR/<stem>.ptx` when the `cuda` feature is on.
fn build_kernels(kernels: &[(&str, &str)]) {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    for (source, _) in kernels {
        println!("cargo:rerun-if-changed={source}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for (source, stem) in kernels {
        if let Err(e) = compile(source, stem) {
            eprintln!(
                "{}: {e}",
                std::env::var("CARGO_PKG_NAME").unwrap_or_default()
            );
            std::process::exit(1);
        }
    }
}
