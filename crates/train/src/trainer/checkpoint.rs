//! Saving, resuming and rolling back: the checkpoint parts are the components' own state.

use crate::data::decode_sample_id;
use crate::error::{Result, TrainError};
use crate::model::TrainModel;
use kiln_ckpt::{Latest, Layout, LoadOptions, Loaded, RankState, Snapshot};
use kiln_monitor::{Event, EventKind};
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use super::{RollbackRecord, Trainer};

impl<M: TrainModel> Trainer<M> {
    /// The reshard request of this rank's layout.
    pub(super) fn request(&self) -> Result<kiln_ckpt::ReshardRequest> {
        let p = &self.cfg.parallel;
        let mut req =
            kiln_ckpt::ReshardRequest::new(Layout::new(p.dp, p.tp, p.zero)?.with_pp(p.pp)?)
                .component("engine", &self.engine);
        if self.drift.is_some() {
            // replicated on every rank: the whole window, whatever its saved length
            req = req.part("drift", kiln_ckpt::Want::Full);
        }
        Ok(req)
    }

    /// Loads the checkpoint `resume_step` or the latest good one, when the configuration asks.
    /// A run that does not resume refuses a checkpoint folder that already holds committed
    /// checkpoints: a later `--resume` would otherwise pick up the earlier run's newest one.
    pub(super) fn resume_if_asked(&mut self) -> Result<()> {
        let ck = &self.cfg.checkpoint;
        if !(ck.resume || ck.resume_step.is_some()) {
            if let Some(c) = &self.ckpt {
                if let Some(newest) = c.committed_steps()?.into_iter().max() {
                    return Err(TrainError::config(
                        "RunConfig.checkpoint.resume",
                        format!(
                            "{} already holds checkpoints of an earlier run (the newest of step \
                             {newest}): set checkpoint.resume = true (--resume) to continue it, or \
                             output_dir (--out DIR) to start a new run in another folder",
                            self.cfg.checkpoint_dir().display()
                        ),
                    ));
                }
            }
            return Ok(());
        }
        let req = self.request()?;
        let Some(c) = &self.ckpt else {
            return Ok(());
        };
        let loaded = match ck.resume_step {
            Some(step) => Some(c.load_resharded(&*self.world, step, &req)?),
            None => {
                let Latest { loaded, skipped } = c.load_latest_resharded(&*self.world, &req)?;
                for s in &skipped {
                    self.skipped_checkpoints.push(s.step);
                    let why: Vec<String> = s
                        .problems
                        .iter()
                        .map(|p| format!("rank {}: {}", p.rank, p.reason))
                        .collect();
                    self.pending_events.push(Event::new(
                        EventKind::Info,
                        s.step,
                        format!(
                            "skipped the damaged checkpoint of step {}: {}",
                            s.step,
                            why.join("; ")
                        ),
                    ));
                }
                loaded
            }
        };
        let Some(Loaded {
            step,
            manifest,
            state,
        }) = loaded
        else {
            self.pending_events.push(Event::new(
                EventKind::Info,
                0,
                "no checkpoint to resume from: starting at step 0",
            ));
            return Ok(());
        };
        self.restore(state, true)?;
        if self.progress.step != step {
            return Err(TrainError::Checkpoint {
                step,
                reason: format!("its trainer state says step {}", self.progress.step),
            });
        }
        self.last_ckpt = Some(step);
        self.resumed_from = Some(step);
        let mut msg = format!(
            "resumed from the checkpoint of step {step} (saved as {})",
            manifest.layout
        );
        if self.progress.run_hash != self.cfg.trajectory_hash() {
            msg.push_str(&format!(
                "; its run configuration differs from this one (hash {} vs {})",
                self.progress.run_hash,
                self.cfg.trajectory_hash()
            ));
            self.progress.run_hash = self.cfg.trajectory_hash();
        }
        self.pending_events
            .push(Event::new(EventKind::Info, step, msg));
        Ok(())
    }

    /// Restores every part of a loaded checkpoint (the breaker and the detectors only when
    /// `with_breaker`: a rollback keeps their memory of what went wrong) and makes the loader
    /// skip every sample the breaker has skipped.
    pub(super) fn restore(&mut self, mut st: RankState, with_breaker: bool) -> Result<()> {
        let strict = LoadOptions::default();
        st.restore("engine", &mut self.engine, strict)?;
        st.restore("scaler", &mut self.scaler, strict)?;
        st.restore("loader", &mut self.loader, strict)?;
        st.restore("trainer", &mut self.progress, strict)?;
        st.restore("rng", &mut self.rng, strict)?;
        if with_breaker {
            if let (Some(b), true) = (self.breaker.as_mut(), st.part("breaker").is_some()) {
                st.restore("breaker", b, strict)?;
            }
            if let (Some(d), true) = (self.detectors.as_mut(), st.part("detectors").is_some()) {
                st.restore("detectors", d, strict)?;
            }
        }
        if let Some(m) = self.drift.as_mut() {
            match st.part("drift") {
                // the window's length varies, so the monitor checks the part itself
                Some(sd) => kiln_ckpt::Stateful::load_state(m, sd.clone())
                    .map_err(kiln_ckpt::CkptError::from)?,
                // a checkpoint without the monitor's window starts it empty
                None => m.reset(),
            }
        }
        if let Some(b) = &self.breaker {
            let ids: Vec<_> = b
                .breaker_state()
                .skipped_sample_ids()
                .into_iter()
                .map(decode_sample_id)
                .collect();
            if !ids.is_empty() {
                self.loader.skip_samples(ids);
            }
        }
        Ok(())
    }

    /// This rank's state, as a checkpoint saves it (collective over the data-parallel group
    /// when `tp > 1`).
    pub fn capture_state(&mut self) -> Result<RankState> {
        let mut st = RankState::new();
        st.capture("engine", &self.engine)?;
        self.capture_parts(&mut st)?;
        Ok(st)
    }

    /// Every part but the engine's into `st`.
    fn capture_parts(&self, st: &mut RankState) -> Result<()> {
        st.capture("scaler", &self.scaler)?;
        st.capture("loader", &self.loader)?;
        if let Some(b) = self.breaker.as_ref() {
            st.capture("breaker", b)?;
        }
        if let Some(d) = self.detectors.as_ref() {
            st.capture("detectors", d)?;
        }
        if let Some(m) = self.drift.as_ref() {
            st.capture("drift", m)?;
        }
        st.capture("trainer", &self.progress)?;
        st.capture("rng", &self.rng)?;
        Ok(())
    }

    /// Starts an async save of the current step: the engine's state is copied here into
    /// buffers kept from the last save (once that save has finished), and the writer thread
    /// gathers it and builds its tensors ([`StagedState`]) before writing; the small parts
    /// are captured here. The checkpoint is bitwise the one [`Trainer::capture_state`] and a
    /// synchronous save give.
    fn save_staged(&mut self, step: u64) -> Result<()> {
        let Some(c) = self.ckpt.as_mut() else {
            return Ok(());
        };
        // the previous save still reads the staged buffers until it is done
        c.wait()?;
        let staged = Arc::clone(&self.staged);
        self.engine
            .stage_state(&mut staged.lock().unwrap_or_else(PoisonError::into_inner))?;
        let mut parts = RankState::new();
        self.capture_parts(&mut parts)?;
        let mut snap = Snapshot::from(parts);
        snap.build_later("engine", move |comm| {
            let st = staged.lock().unwrap_or_else(PoisonError::into_inner);
            Ok(st.state(comm)?)
        })?;
        let Some(c) = self.ckpt.as_mut() else {
            return Ok(());
        };
        c.save_async_snapshot(&*self.world, step, snap)?;
        Ok(())
    }

    /// Saves a checkpoint of the current step (collective); returns the seconds the training
    /// loop spent on it.
    pub fn save_checkpoint(&mut self) -> Result<f64> {
        let t = Instant::now();
        let step = self.progress.step;
        if self.ckpt.is_none() {
            return Err(TrainError::Builder(
                "no checkpointer: set RunConfig.checkpoint.every_steps or a storage".into(),
            ));
        }
        if self.cfg.checkpoint.async_save {
            self.save_staged(step)?;
        } else {
            let state = self.capture_state()?;
            if let Some(c) = self.ckpt.as_mut() {
                c.save(&*self.world, step, &state)?;
            }
        }
        self.last_ckpt = Some(step);
        self.checkpoints.push(step);
        if let Some(b) = self.breaker.as_mut() {
            b.checkpoint_saved(step);
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Loads the checkpoint of `step` (saved with any layout) into this rank, every part but
    /// the breaker's (collective).
    pub(super) fn load_checkpoint(&mut self, step: u64) -> Result<()> {
        let req = self.request()?;
        let Some(c) = self.ckpt.as_mut() else {
            return Err(TrainError::Checkpoint {
                step,
                reason: "no checkpointer to load it from".into(),
            });
        };
        c.wait()?;
        let loaded = c.load_resharded(&*self.world, step, &req)?;
        self.restore(loaded.state, false)
    }

    pub(super) fn rollback(&mut self, at_step: u64, to_step: u64, skip: Vec<u64>) -> Result<()> {
        self.load_checkpoint(to_step)?;
        if self.progress.step != to_step {
            return Err(TrainError::Checkpoint {
                step: to_step,
                reason: format!("its trainer state says step {}", self.progress.step),
            });
        }
        if let Some(d) = self.detectors.as_mut() {
            d.rollback(to_step);
        }
        self.losses.retain(|(s, _)| *s <= to_step);
        self.val_losses.retain(|(s, _)| *s <= to_step);
        self.rollbacks.push(RollbackRecord {
            at_step,
            to_step,
            skipped_samples: skip,
        });
        Ok(())
    }
}
