//! Checkpoints for kiln: save every component's state so a run resumes bitwise after a
//! crash, on the same or on another number of ranks.
//!
//! - kiln-state's types, re-exported so one import serves (they live there, below every
//!   crate with state): [`TensorData`], a plain typed tensor; [`StateDict`], one component's
//!   named tensors (each optionally a [`Shard`] of a global tensor) and JSON metadata;
//!   [`Stateful`], the trait components implement (model, optimizer, scaler, schedule, data
//!   loader, [`RngState`], [`Step`]). Here: [`RankState`], all the parts one rank saves.
//! - [`Checkpointer`]: collective save (synchronous, or [`Checkpointer::save_async`] on a
//!   background thread; with [`Checkpointer::save_async_snapshot`] the copy of each
//!   [`Guarded`] component deferred into a [`Snapshot`] runs there too, and the loop's next
//!   write to it waits until it is copied, and a part added with [`Snapshot::build_later`] is
//!   built there with the writer's own communicator) of one safetensors file per rank plus a
//!   JSON [`Manifest`] with each
//!   file's sha256, committed by an atomic directory rename (a re-saved step's old copy is
//!   set aside, never deleted, until the new one is committed); [`Checkpointer::load_latest`]
//!   never returns an uncommitted or damaged checkpoint and reports what it skipped.
//!   [`SavePolicy`] says when to save, [`Retention`] what to keep.
//! - Resharding: [`Checkpointer::load_resharded`] loads a checkpoint saved with any layout
//!   (ZeRO flat shards, tensor-parallel dim shards, replicas) into the slices a
//!   [`ReshardRequest`] asks for ([`Want`]), bitwise.
//! - [`Storage`]: where checkpoints live ([`LocalFs`] with fsync of files and directories;
//!   an object store fits the same trait).
//! - The file format: rank files are plain safetensors (tensors `<part>/<name>`, part
//!   metadata as JSON strings in `__metadata__`), readable by Python's `safetensors`;
//!   [`encode_rank_file`] / [`decode_rank_file`] and [`Manifest::from_json`] are the
//!   (fuzzed) parsers.
//! - Errors are [`CkptError`]; malformed files and manifests are typed errors, never panics.
//!
//! ```
//! use kiln_ckpt::{CheckpointConfig, Checkpointer, Layout, LoadOptions, LocalFs, RankState, StateDict, Step};
//! use std::sync::Arc;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//!
//! let dir = std::env::temp_dir().join(format!("kiln-ckpt-doc-{}", std::process::id()));
//! let comm = kiln_comm::ThreadComm::group(1, Default::default())?.remove(0);
//! let storage = Arc::new(LocalFs::new(&dir)?);
//! let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(Layout::single(), "tiny"))?;
//!
//! let mut model = StateDict::new();
//! model.put("w", &[2, 2], &[1.0f32, 2.0, 3.0, 4.0])?;
//! let mut state = RankState::new();
//! state.insert("model", model)?;
//! state.capture("step", &Step(10))?;
//! ckpt.save(&comm, 10, &state)?;
//!
//! let latest = ckpt.load_latest(&comm)?;
//! let loaded = latest.loaded.ok_or("no checkpoint")?;
//! assert_eq!(loaded.step, 10);
//! let (mut restored, mut step) = (StateDict::new(), Step(0));
//! restored.put("w", &[2, 2], &[0.0f32; 4])?;
//! loaded.state.restore_all(&mut [("model", &mut restored), ("step", &mut step)], LoadOptions::default())?;
//! assert_eq!(restored.get::<f32>("w")?, [1.0, 2.0, 3.0, 4.0]);
//! assert_eq!(step, Step(10));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod checkpointer;
mod digest;
mod error;
mod gather;
mod layout;
mod load;
mod manifest;
mod policy;
mod rankfile;
mod reshard;
mod save;
mod snapshot;
mod state;
mod storage;

pub use checkpointer::{CheckpointConfig, Checkpointer};
pub use error::{CkptError, Result};
pub use layout::Layout;
pub use load::{Latest, Loaded, RankProblem, Skipped};
pub use manifest::{rank_file_name, FileEntry, Manifest, TensorEntry, MANIFEST_FORMAT};
pub use policy::{Retention, SavePolicy};
pub use rankfile::{decode_rank_file, encode_rank_file, FORMAT_VERSION};
pub use reshard::{GlobalTensor, ReshardRequest};
pub use save::{
    replaced_dir, step_dir, tmp_dir, SaveReport, LATEST_FILE, MANIFEST_FILE, MANIFEST_SHA_FILE,
};
pub use snapshot::{Guarded, GuardedWrite, Snapshot};
pub use state::{KeyReport, LoadOptions, RankState};
// How components describe their state lives in kiln-state, below every crate that has state;
// re-exported here so that a checkpoint's users need one import.
pub use kiln_state::{
    DType, Element, FlatShard, RngState, Shard, ShardSpec, StateDict, StateError, Stateful, Step,
    TensorData, TensorSpec, Want, ZeroStage,
};
pub use storage::{LocalFs, Storage, StorageReader, StorageWriter};
