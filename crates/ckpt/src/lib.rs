//! Checkpoints for kiln: save every component's state so a run resumes bitwise, on the same
//! or on another number of ranks.
//!
//! - [`TensorData`]: a plain typed tensor (dtype, shape, little-endian bytes), independent of
//!   any tensor library; [`StateDict`]: one component's named tensors (each optionally a
//!   [`Shard`] of a global tensor) and JSON metadata; [`Stateful`]: the trait components
//!   implement; [`RankState`]: all the parts one rank saves.
//!
//! ```
//! use kiln_ckpt::{LoadOptions, RankState, StateDict, Stateful, Step};
//!
//! let mut model = StateDict::new();
//! model.put("w", &[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
//! let mut saved = RankState::new();
//! saved.insert("model", model).unwrap();
//! saved.capture("step", &Step(7)).unwrap();
//!
//! let mut restored = StateDict::new();
//! restored.put("w", &[2, 2], &[0.0f32; 4]).unwrap();
//! let mut step = Step(0);
//! saved
//!     .restore_all(&mut [("model", &mut restored), ("step", &mut step)], LoadOptions::default())
//!     .unwrap();
//! assert_eq!(restored.get::<f32>("w").unwrap(), [1.0, 2.0, 3.0, 4.0]);
//! assert_eq!(step, Step(7));
//! ```
#![deny(missing_docs)]

mod error;
mod layout;
mod rankfile;
mod shard;
mod state;
mod tensor;

pub use error::{CkptError, Result};
pub use layout::Layout;
pub use rankfile::{decode_rank_file, encode_rank_file, FORMAT_VERSION};
pub use shard::{FlatShard, Shard, ShardSpec};
pub use state::{
    KeyReport, LoadOptions, RankState, RngState, StateDict, Stateful, Step, TensorSpec,
};
pub use tensor::{DType, Element, TensorData};
