//! The loader's resumable state.

use crate::error::{DataError, Result};
use crate::mixture::WeightChange;
use crate::sample::{SampleId, SkipSet};
use crate::sampler::{Cursor, TailPolicy};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// The version of [`LoaderState`]'s layout.
pub const LOADER_STATE_VERSION: u32 = 1;

/// Where one source stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceState {
    /// The source's name (checked on load).
    pub name: String,
    /// Its number of samples (checked on load: a change means the data changed).
    pub samples: u64,
    /// Its position: epoch and samples of that epoch's order consumed, across all ranks.
    pub cursor: Cursor,
}

/// Everything needed to continue a [`crate::DataLoader`] bitwise where it stopped.
///
/// There is no random-generator state to save: every random choice is keyed by counters kept
/// here (the permutation of a source by its epoch, the mixture draw by `step`, a transform by
/// sample and epoch). The cursors count samples across the whole data-parallel group, so the
/// state is the same on every rank and can be loaded into another dp size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoaderState {
    /// [`LOADER_STATE_VERSION`].
    pub version: u32,
    /// The seed of every keyed stream.
    pub seed: u64,
    /// Tokens per sample input.
    pub ctx: usize,
    /// The data-parallel size it was saved with.
    pub dp: usize,
    /// The rank that saved it (informational: the state is the same on every rank).
    pub rank: usize,
    /// Samples per rank per batch when saved.
    pub batch_size: usize,
    /// End-of-epoch policy (one source).
    pub tail: TailPolicy,
    /// Global batches delivered so far (the mixture's draw counter).
    pub step: u64,
    /// Per-source positions.
    pub sources: Vec<SourceState>,
    /// Mixture weights over time (the first at step 0).
    pub weights_history: Vec<WeightChange>,
    /// Samples never to yield.
    pub skip: SkipSet,
}

impl LoaderState {
    /// The epoch of the first source's cursor.
    pub fn epoch(&self) -> u64 {
        self.sources.first().map_or(0, |s| s.cursor.epoch)
    }

    /// Marks samples to skip from now on (say, those of a batch that produced a loss spike).
    pub fn skip_samples(&mut self, ids: impl IntoIterator<Item = SampleId>) {
        for id in ids {
            self.skip.insert(id);
        }
    }

    /// Marks the windows `range` of `source` to skip.
    pub fn skip_range(&mut self, source: u32, range: Range<u64>) {
        self.skip.insert_range(source, range);
    }

    /// JSON text of the state (all integers exact).
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|source| DataError::Json {
            what: "write loader state".into(),
            source,
        })
    }

    /// Parses [`LoaderState::to_json`]'s output; rejects another layout version.
    pub fn from_json(text: &str) -> Result<Self> {
        let s: LoaderState = serde_json::from_str(text).map_err(|source| DataError::Json {
            what: "read loader state".into(),
            source,
        })?;
        if s.version != LOADER_STATE_VERSION {
            return Err(DataError::StateMismatch {
                field: "version",
                saved: s.version.to_string(),
                current: LOADER_STATE_VERSION.to_string(),
            });
        }
        Ok(s)
    }
}

/// The loader as a kiln-state component: its [`LoaderState`] (skip set included) as the metadata
/// entry `loader`. Loading checks the seed, context, tail policy and sources, and reshards the
/// position to this loader's data-parallel degree (see [`crate::DataLoader::load_loader_state`]).
impl kiln_state::Stateful for crate::DataLoader {
    fn state(&self) -> kiln_state::Result<kiln_state::StateDict> {
        let mut sd = kiln_state::StateDict::new();
        sd.set_meta("loader", self.loader_state())?;
        Ok(sd)
    }

    fn load_state(&mut self, state: kiln_state::StateDict) -> kiln_state::Result<()> {
        let s: LoaderState = state.meta("loader")?;
        self.load_loader_state(s)
            .map_err(|e| kiln_state::StateError::component("data loader", e))
    }
}
