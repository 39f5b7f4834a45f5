//! How kiln's components describe their state, so that any of them can be saved, resumed and
//! resharded without the reference trainer: PyTorch's `state_dict()` / `load_state_dict()`
//! for every optimizer, scaler, schedule, loader and engine.
//!
//! - [`Stateful`]: `state` copies a component's state out as a [`StateDict`], `load_state`
//!   takes one back, `state_spec` says what it expects.
//! - [`StateDict`]: named [`TensorData`] (plain typed tensors: a [`DType`], a shape and
//!   little-endian bytes) and JSON metadata. A tensor may be a [`Shard`] of a global tensor:
//!   a slice along one dimension (tensor parallel) or a flat range (ZeRO).
//! - [`Want`]: the slice of a global tensor a rank asks for.
//! - [`ZeroStage`]: what the data-parallel ranks shard (ZeRO 0 to 3), the one type the engine,
//!   the memory estimate, the checkpoint layout and the run config share.
//!
//! No tensor library and no communication: every crate of kiln can depend on this one, and
//! kiln-ckpt turns state dicts into files.
//!
//! ```
//! use kiln_state::{Shard, StateDict, Stateful};
//!
//! /// A counter and a vector, this rank holding elements 4..8 of a global 16.
//! struct Momentum { steps: u64, buf: Vec<f32> }
//!
//! impl Stateful for Momentum {
//!     fn state(&self) -> kiln_state::Result<StateDict> {
//!         let mut sd = StateDict::new();
//!         let t = kiln_state::TensorData::from_slice(&[4], &self.buf)?;
//!         sd.insert_sharded("buf", t, Shard::flat(&[16], 4, 4))?;
//!         sd.set_meta("steps", self.steps)?;
//!         Ok(sd)
//!     }
//!     fn load_state(&mut self, sd: StateDict) -> kiln_state::Result<()> {
//!         self.buf = sd.get_shaped("buf", &[4])?;
//!         self.steps = sd.meta("steps")?;
//!         Ok(())
//!     }
//! }
//!
//! let a = Momentum { steps: 3, buf: vec![0.5, 1.0, 1.5, 2.0] };
//! let mut b = Momentum { steps: 0, buf: vec![0.0; 4] };
//! b.load_state(a.state()?)?;
//! assert_eq!((b.steps, b.buf), (3, vec![0.5, 1.0, 1.5, 2.0]));
//! # Ok::<(), kiln_state::StateError>(())
//! ```
#![deny(missing_docs)]

mod dict;
mod error;
mod shard;
mod stateful;
mod tensor;
mod util;
mod want;
mod zero;

pub use dict::{check_tensor_name, StateDict, TensorSpec};
pub use error::{Result, StateError};
pub use shard::{chunk_range, dim_runs, FlatShard, Shard, ShardSpec};
pub use stateful::{RngState, Stateful, Step};
pub use tensor::{numel, DType, Element, TensorData};
pub use util::{panic_message, splitmix64};
pub use want::Want;
pub use zero::ZeroStage;
