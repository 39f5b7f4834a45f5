//! With the `cuda` feature: `kernels/ops.cu` and `kernels/attn.cu` to PTX (see build-support/cuda_kernels.rs).

include!("../../build-support/cuda_kernels.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_kernels(&[
        ("kernels/ops.cu", "kiln_model_ops"),
        ("kernels/attn.cu", "kiln_model_attn"),
    ]);
}
