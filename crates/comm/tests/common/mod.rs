//! Helpers shared by kiln-comm's integration tests.
pub mod suite;
