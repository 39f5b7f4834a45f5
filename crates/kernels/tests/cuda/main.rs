//! kiln-kernels' CUDA kernels against the same ops on the CPU, in one test binary: the fused
//! ops ([`ops`]), the fused causal attention ([`attention`]) and AdamW ([`adamw`]). Needs a
//! build with the `cuda` feature and a GPU; anywhere else each test says why it did not run and
//! passes (CI has no GPU; `scripts/gpu_check.sh` runs them on one).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod adamw;
mod attention;
mod common;
mod ops;
