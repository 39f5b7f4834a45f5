//! Code shared by the workspace tests.
#![allow(dead_code)]

pub mod equivalence;
pub mod pipeline;
pub mod process;
