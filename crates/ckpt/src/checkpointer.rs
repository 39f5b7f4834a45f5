//! [`Checkpointer`]: saves (synchronously or on a background thread) and loads checkpoints
//! through a [`Storage`], with the save policy and retention of its [`CheckpointConfig`].

use crate::error::{CkptError, Result};
use crate::gather::agree_step;
use crate::layout::Layout;
use crate::load::{
    into_rank_state, latest_agreed, load_agreed, read_manifest, read_manifest_in, read_rank_file,
    Latest, Loaded,
};
use crate::manifest::Manifest;
use crate::policy::{Retention, SavePolicy};
use crate::reshard::{load_resharded_local, ReshardRequest};
use crate::save::{
    committed_dir, committed_steps, parse_step_dir, write_checkpoint, SaveCtx, SaveReport,
    LATEST_FILE,
};
use crate::snapshot::Snapshot;
use crate::state::RankState;
use crate::storage::Storage;
use kiln_comm::{CommExt, Communicator, ReduceOp};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// What a [`Checkpointer`] is configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointConfig {
    /// This run's world layout, recorded in every manifest and required on load.
    pub layout: Layout,
    /// A hash (any string) of the model configuration; loading a checkpoint with another
    /// hash is [`CkptError::ModelMismatch`].
    pub model_hash: String,
    /// When [`Checkpointer::should_save`] says yes.
    pub policy: SavePolicy,
    /// Which checkpoints a commit leaves in place.
    pub retention: Retention,
}

impl CheckpointConfig {
    /// A configuration with no save policy and keeping every checkpoint.
    pub fn new(layout: Layout, model_hash: impl Into<String>) -> Self {
        CheckpointConfig {
            layout,
            model_hash: model_hash.into(),
            policy: SavePolicy::default(),
            retention: Retention::keep_all(),
        }
    }

    /// Sets the save policy.
    pub fn with_policy(mut self, policy: SavePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the retention.
    pub fn with_retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }
}

/// A save running on the background thread.
struct InFlight {
    step: u64,
    handle: JoinHandle<Result<SaveReport>>,
}

/// Saves and loads the checkpoints of one rank; every rank of the run holds one, over the
/// same storage, and calls the same methods in the same order (they are collective).
///
/// Layout on storage: `step-00000010/` holds `rank-00000.safetensors` ... (one per rank),
/// `manifest.json` and `manifest.sha256`; `latest` names the newest committed directory.
/// A save writes into `step-00000010.tmp/`, fsyncs every file and the directory, and
/// renames it to `step-00000010/`: the rename is the commit. Saving a step that is already
/// committed first renames the committed copy aside to `step-00000010.replaced/` and removes
/// it only after the new copy is committed and the pointer written, so a crash at any point
/// leaves step 10 loadable (old or new content); loading treats a `.replaced` directory as
/// its step when the `step-...` directory is absent, and the next commit renames it back.
/// Loading only ever considers committed directories, verifies every byte it reads against
/// the manifest's sha256, and [`Checkpointer::load_latest`] falls back to older checkpoints
/// past damaged ones.
///
/// Collectives: the communicator's timeout bounds how much later the slowest rank may finish
/// writing its file than the fastest.
pub struct Checkpointer {
    storage: Arc<dyn Storage>,
    config: CheckpointConfig,
    user: BTreeMap<String, Value>,
    last_save: Instant,
    inflight: Option<InFlight>,
    bg_comm: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointer")
            .field("config", &self.config)
            .field("saving", &self.inflight.as_ref().map(|i| i.step))
            .finish()
    }
}

impl Checkpointer {
    /// A checkpointer over `storage`; validates the configuration.
    pub fn new(storage: Arc<dyn Storage>, config: CheckpointConfig) -> Result<Self> {
        config.layout.validate()?;
        config.policy.validate()?;
        config.retention.validate()?;
        Ok(Checkpointer {
            storage,
            config,
            user: BTreeMap::new(),
            last_save: Instant::now(),
            inflight: None,
            bg_comm: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CheckpointConfig {
        &self.config
    }

    /// The storage.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Sets a free-form entry written into the manifest of every later save (rank 0's
    /// values are the ones recorded).
    pub fn set_user_meta<V: Serialize>(&mut self, key: &str, value: V) -> Result<()> {
        let v = serde_json::to_value(value).map_err(|e| kiln_state::StateError::Meta {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        self.user.insert(key.to_string(), v);
        Ok(())
    }

    fn ctx(&self) -> SaveCtx {
        SaveCtx {
            storage: Arc::clone(&self.storage),
            layout: self.config.layout,
            model_hash: self.config.model_hash.clone(),
            user: self.user.clone(),
            retention: self.config.retention,
        }
    }

    /// Whether the save policy calls for a checkpoint at `step` (collective when the policy
    /// has a wall-time interval: ranks' clocks differ, so all save if any rank's is due).
    pub fn should_save(&self, comm: &dyn Communicator, step: u64) -> Result<bool> {
        self.should_save_at(comm, step, Instant::now())
    }

    /// [`Checkpointer::should_save`] at a given instant (for deterministic tests).
    pub fn should_save_at(&self, comm: &dyn Communicator, step: u64, now: Instant) -> Result<bool> {
        let due = self
            .config
            .policy
            .due(step, now.saturating_duration_since(self.last_save));
        if self.config.policy.every.is_none() {
            return Ok(due);
        }
        Ok(comm.all_reduce_scalar(u32::from(due), ReduceOp::Max)? != 0)
    }

    /// Saves `state` as checkpoint `step` and returns once it is committed (collective).
    ///
    /// Waits for an async save in flight first and returns its error if it failed. Every
    /// rank must pass the same step ([`CkptError::StepMismatch`] otherwise).
    pub fn save(
        &mut self,
        comm: &dyn Communicator,
        step: u64,
        state: &RankState,
    ) -> Result<SaveReport> {
        self.wait()?;
        agree_step(comm, step)?;
        self.last_save = Instant::now();
        write_checkpoint(&self.ctx(), comm, step, Ok(state))
    }

    /// Hands `state` (already a copy: [`crate::Stateful::state`] copies) to a background
    /// thread that writes and commits checkpoint `step`; returns as soon as the ranks agreed
    /// on the step. The bytes written are identical to [`Checkpointer::save`]'s.
    ///
    /// A save still in flight is waited for first: its error, if any, is returned here (and
    /// this save does not start). The background thread talks over its own communicator,
    /// split from `comm` on first use, so it never interleaves with the caller's
    /// collectives.
    ///
    /// To keep the copy itself off the loop's thread, see
    /// [`Checkpointer::save_async_snapshot`].
    pub fn save_async(
        &mut self,
        comm: &dyn Communicator,
        step: u64,
        state: RankState,
    ) -> Result<()> {
        self.save_async_snapshot(comm, step, Snapshot::from(state))
    }

    /// [`Checkpointer::save_async`] of a [`Snapshot`]: the background thread first copies
    /// the snapshot's deferred parts (releasing each [`crate::Guarded`] component as soon as
    /// it is copied, so the loop's next write to it waits at most for that copy), builds the
    /// parts added with [`Snapshot::build_later`] with its own communicator, then writes and
    /// commits. The checkpoint holds every deferred component's value as of
    /// [`Snapshot::defer`]; the bytes are those a [`Checkpointer::save`] of the same values
    /// writes. A deferred copy that fails fails the save on every rank (seen on
    /// [`Checkpointer::wait`]).
    ///
    /// If the save cannot start (the previous one failed, the ranks disagree on the step),
    /// the snapshot is dropped and its components released.
    pub fn save_async_snapshot(
        &mut self,
        comm: &dyn Communicator,
        step: u64,
        snapshot: Snapshot,
    ) -> Result<()> {
        self.wait()?;
        agree_step(comm, step)?;
        let bg = self.bg_comm(comm)?;
        let ctx = self.ctx();
        self.last_save = Instant::now();
        let handle = std::thread::Builder::new()
            .name(format!("kiln-ckpt-writer-{}", comm.rank()))
            .spawn(move || match snapshot.into_state_with(&*bg) {
                Ok(state) => write_checkpoint(&ctx, &*bg, step, Ok(&state)),
                Err(e) => write_checkpoint(&ctx, &*bg, step, Err(e)),
            })?;
        self.inflight = Some(InFlight { step, handle });
        Ok(())
    }

    fn bg_comm(&mut self, comm: &dyn Communicator) -> Result<Arc<dyn Communicator>> {
        if let Some(c) = &self.bg_comm {
            if c.world_size() == comm.world_size() && c.rank() == comm.rank() {
                return Ok(Arc::clone(c));
            }
        }
        let key = u32::try_from(comm.rank())
            .map_err(|_| CkptError::Config(format!("rank {} exceeds u32", comm.rank())))?;
        let c: Arc<dyn Communicator> = Arc::from(comm.split(0, key)?);
        self.bg_comm = Some(Arc::clone(&c));
        Ok(c)
    }

    /// The step of the async save in flight, if any.
    pub fn saving(&self) -> Option<u64> {
        self.inflight.as_ref().map(|i| i.step)
    }

    /// Waits for the async save in flight, if any, and returns its report or error.
    pub fn wait(&mut self) -> Result<Option<SaveReport>> {
        let Some(f) = self.inflight.take() else {
            return Ok(None);
        };
        match f.handle.join() {
            Ok(r) => r.map(Some),
            Err(p) => Err(CkptError::WriterPanicked(
                p.downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_string()),
            )),
        }
    }

    /// Steps of the committed checkpoints, increasing (not verified), including a step whose
    /// only copy is the set-aside `step-N.replaced/` of a re-save that crashed.
    pub fn committed_steps(&self) -> Result<Vec<u64>> {
        committed_steps(&*self.storage)
    }

    /// The step the `latest` pointer names, if the pointer exists and parses. Loading does
    /// not rely on it: a crash between a commit and the pointer update leaves it one behind.
    pub fn latest_pointer(&self) -> Result<Option<u64>> {
        match self.storage.get(LATEST_FILE) {
            Ok(b) => Ok(parse_step_dir(String::from_utf8_lossy(&b).trim())),
            Err(CkptError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The verified manifest of checkpoint `step`.
    pub fn manifest(&self, step: u64) -> Result<Manifest> {
        read_manifest(&*self.storage, step)
    }

    /// Checks a manifest against this run: model hash, then layout and world size when
    /// `same_layout`.
    pub(crate) fn check_manifest(
        &self,
        m: &Manifest,
        world: usize,
        same_layout: bool,
    ) -> Result<()> {
        if m.model_hash != self.config.model_hash {
            return Err(CkptError::ModelMismatch {
                expected: self.config.model_hash.clone(),
                got: m.model_hash.clone(),
            });
        }
        if same_layout {
            if m.layout != self.config.layout {
                return Err(CkptError::LayoutMismatch {
                    expected: self.config.layout,
                    got: m.layout,
                });
            }
            if world != m.layout.world() {
                return Err(CkptError::WorldMismatch {
                    layout: m.layout,
                    expected: m.layout.world(),
                    got: world,
                });
            }
        }
        Ok(())
    }

    fn load_local(&self, rank: usize, world: usize, step: u64) -> Result<Loaded> {
        let dir = committed_dir(&*self.storage, step)?;
        let manifest = read_manifest_in(&*self.storage, &dir, step)?;
        self.check_manifest(&manifest, world, true)?;
        let entry = manifest.file(rank).ok_or_else(|| CkptError::Manifest {
            path: dir.clone(),
            reason: format!("no file for rank {rank}"),
        })?;
        let file = read_rank_file(&*self.storage, &dir, entry)?;
        let state = into_rank_state(file, entry)?;
        Ok(Loaded {
            step,
            manifest,
            state,
        })
    }

    /// Loads this rank's state of checkpoint `step` (collective: any rank's failure fails
    /// every rank). The checkpoint must have this run's layout and model hash.
    pub fn load_step(&self, comm: &dyn Communicator, step: u64) -> Result<Loaded> {
        agree_step(comm, step)?;
        let (rank, world) = (comm.rank(), comm.world_size());
        load_agreed(comm, step, |s| self.load_local(rank, world, s))
    }

    /// Loads the newest committed checkpoint that every rank can read and verify
    /// (collective). Damaged checkpoints (missing file, size or checksum mismatch,
    /// unparseable file or manifest) are skipped and listed in [`Latest::skipped`]; other
    /// errors (i/o, newer format version, other layout or model) stop the load on every
    /// rank. `loaded` is `None` when no checkpoint is usable.
    pub fn load_latest(&self, comm: &dyn Communicator) -> Result<Latest<Loaded>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        latest_agreed(&*self.storage, comm, |s| self.load_local(rank, world, s))
    }

    fn load_resharded_at(&self, world: usize, step: u64, req: &ReshardRequest) -> Result<Loaded> {
        req.layout.validate()?;
        if world != req.layout.world() {
            return Err(CkptError::WorldMismatch {
                layout: req.layout,
                expected: req.layout.world(),
                got: world,
            });
        }
        let dir = committed_dir(&*self.storage, step)?;
        let manifest = read_manifest_in(&*self.storage, &dir, step)?;
        self.check_manifest(&manifest, world, false)?;
        let state = load_resharded_local(&*self.storage, &manifest, &dir, req)?;
        Ok(Loaded {
            step,
            manifest,
            state,
        })
    }

    /// Loads checkpoint `step`, saved with any layout, into this rank's slices as `req`
    /// asks (collective: any rank's failure fails every rank). Each requested slice is
    /// assembled from every saved shard that overlaps it, flat (ZeRO) and dim-sliced (tensor
    /// parallel) alike, after verifying the sha256 of every file it reads.
    pub fn load_resharded(
        &self,
        comm: &dyn Communicator,
        step: u64,
        req: &ReshardRequest,
    ) -> Result<Loaded> {
        agree_step(comm, step)?;
        let world = comm.world_size();
        load_agreed(comm, step, |s| self.load_resharded_at(world, s, req))
    }

    /// [`Checkpointer::load_resharded`] of the newest checkpoint every rank can use, falling
    /// back past damaged ones as [`Checkpointer::load_latest`] does.
    pub fn load_latest_resharded(
        &self,
        comm: &dyn Communicator,
        req: &ReshardRequest,
    ) -> Result<Latest<Loaded>> {
        let world = comm.world_size();
        latest_agreed(&*self.storage, comm, |s| {
            self.load_resharded_at(world, s, req)
        })
    }
}

impl Drop for Checkpointer {
    /// Waits for a save in flight (its outcome is lost: call [`Checkpointer::wait`] first to
    /// see it).
    fn drop(&mut self) {
        if let Some(f) = self.inflight.take() {
            let _ = f.handle.join();
        }
    }
}
