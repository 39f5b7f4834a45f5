//! `kiln plan-memory` on the Llama presets: the parameters of Llama 3 70B (70,553,706,496), each
//! tensor-parallel rank's share of them (the key/value projections split at tp 8 and
//! replicated at tp 16, a multiple of its 8 key/value heads) and ZeRO's 2 + 2 + 12 bytes per
//! parameter, against closed forms written here from the model's sizes, and the activations of
//! one micro-batch against the Llama block's count.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

/// `kiln plan-memory llama3_70b --dp 8 --tp <tp>`'s output.
fn plan(tp: u64) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["plan-memory", "llama3_70b", "--dp", "8", "--tp"])
        .arg(tp.to_string())
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{printed}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    printed
}

fn row<'a>(printed: &'a str, name: &str) -> Vec<&'a str> {
    printed
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} row:\n{printed}"))
        .split_whitespace()
        .collect()
}

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

#[test]
fn plan_memory_counts_llama3_70b_per_tensor_parallel_rank() {
    // Llama 3 70B: 80 blocks of width 8192, 64 query heads and 8 key/value heads of 128,
    // SwiGLU hidden 28672, vocab 128256, context 8192
    let (l, h, a, kd, f, v, s) = (
        80u64, 8192u64, 64u64, 1024u64, 28_672u64, 128_256u64, 8192u64,
    );
    // split over the tensor-parallel ranks: q and o (h² each), k and v (h·kd each), gate, up
    // and down (3·h·f), the embedding and the untied head (2·V·h); replicated: the two
    // RMSNorms of each block and the final one
    let kv = l * 2 * h * kd;
    let split = l * (2 * h * h + 3 * h * f) + kv + 2 * v * h;
    let norms = l * 2 * h + h;
    assert_eq!(split + norms, 70_553_706_496);

    let printed = plan(8);
    assert!(
        printed.starts_with("llama3_70b: 70.55B parameters (80 layers, d_model 8192, 64 heads"),
        "{printed}"
    );
    assert!(
        printed.contains("64 query heads sharing 8 key/value heads")
            && printed.contains("MLP width 28672")
            && !printed.contains("replicated on every tp rank"),
        "{printed}"
    );
    let p = split / 8 + norms;
    assert_eq!(p, 8_820_367_360);
    assert_eq!(row(&printed, "replicated")[1], p.to_string());
    // 2 + 2 + 12 bytes per parameter of the rank; ZeRO-3 splits them over dp = 8
    assert_eq!(row(&printed, "replicated")[5], gib(16 * p));
    assert_eq!(row(&printed, "zero-3")[5], gib(16 * p / 8));
    // activations, 16-bit, micro-batch 1, every block recomputed: 80 block inputs, one block
    // while it runs again (the RMSNorm inputs and outputs whole, q, the attention output, the
    // rotary input of q, gate|up and the SwiGLU output, k, v and the rotary input of k over
    // the tp ranks, the scores of 64 / 8 heads), the embedding output, the logits and their
    // gradient (vocab-parallel)
    let block = 2 * (4 * s * h + s * (3 * h + 3 * f + 3 * kd) / 8 + 2 * a * s * s / 8);
    let ends = 2 * s * h + 2 * 2 * s * v / 8;
    assert_eq!(
        row(&printed, "replicated")[7],
        gib(80 * 2 * s * h + block + ends)
    );

    // tp 16, a multiple of the 8 key/value heads: every rank holds k and v whole
    let printed = plan(16);
    assert!(
        printed.contains("key/value projections replicated on every tp rank"),
        "{printed}"
    );
    let p = (split - kv) / 16 + kv + norms;
    assert_eq!(p, 5_669_134_336);
    assert_eq!(row(&printed, "zero-1")[1], p.to_string());
}
