//! Megatron-style tensor parallelism.
