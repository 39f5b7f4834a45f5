//! With the `cuda` feature: `kernels/step.cu` to PTX (see build-support/cuda_kernels.rs).

include!("../../build-support/cuda_kernels.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_kernels(&[("kernels/step.cu", "kiln_parallel_step")]);
}
