//! The state a rank holds and how it is configured, read and restored: the optimizers on its
//! shards (replacing the configured one; weight-decay groups by parameter and by kind, each
//! shard's optimizer getting the ranges of its own chunk), the fp32 master values a checkpoint
//! reads and restores, the full parameters gathered from every rank, and the bytes it holds.

use super::DataParallel;
use crate::error::{ParallelError, Result};
use crate::flat::write_var;
use kiln_comm::{chunk_range, CommExt};
use kiln_optim::{DecayOverride, Optimizer, OptimizerFactory, ParamKind, WeightDecayGroups};
use kiln_state::ZeroStage;
use std::sync::Arc;

impl DataParallel {
    /// Runs the optimizer `factory` builds on every shard in place of the configured one
    /// ([`DataParallelConfig::optimizer`](crate::DataParallelConfig::optimizer)): an optimizer of your own, or a configured one with
    /// different options. Only before the first step (the optimizers' state starts at zero);
    /// weight-decay groups already set carry over.
    pub fn with_optimizer(mut self, factory: Arc<dyn OptimizerFactory>) -> Result<Self> {
        if self.steps() > 0 {
            return Err(ParallelError::Config(format!(
                "with_optimizer after {} steps: the optimizer can only be replaced before the first step",
                self.steps()
            )));
        }
        self.sync_host()?;
        let mut optim = Vec::with_capacity(self.master.len());
        for m in &self.master {
            optim.push(factory.build(m.len())?);
        }
        self.optim = optim;
        self.factory = factory;
        self.apply_decay()?;
        Ok(self)
    }

    /// Gives the named parameters their own weight decay (PyTorch's parameter groups); the
    /// others keep the optimizer's. Each shard's optimizer gets the ranges of its own chunk, so
    /// the result does not depend on the sharding. A name the engine does not hold is an error.
    pub fn with_weight_decay(mut self, per_param: &[(String, f64)]) -> Result<Self> {
        for (name, wd) in per_param {
            let i = self.param_index(name, "the weight-decay list")?;
            self.decay[i] = Some(*wd);
        }
        self.apply_decay()?;
        Ok(self)
    }

    /// Turns weight decay off on the parameters `groups` exempts, by kind (the model's list,
    /// for example `kiln_model::Gpt::param_kinds`): by default biases, normalisation gains and
    /// embeddings, as GPT-3 trains. See [`WeightDecayGroups`].
    pub fn with_decay_groups(
        self,
        kinds: &[(String, ParamKind)],
        groups: &WeightDecayGroups,
    ) -> Result<Self> {
        let off: Vec<(String, f64)> = groups
            .no_decay(kinds)?
            .into_iter()
            .map(|n| (n, 0.0))
            .collect();
        self.with_weight_decay(&off)
    }

    /// The weight decay each parameter has of its own (layout order; `None`: the optimizer's).
    pub fn weight_decay_overrides(&self) -> &[Option<f64>] {
        &self.decay
    }

    fn param_index(&self, name: &str, list: &str) -> Result<usize> {
        self.layout.index(name).ok_or_else(|| ParallelError::Param {
            name: name.to_string(),
            expected: "a parameter of the engine".into(),
            got: format!("an unknown name in {list}"),
        })
    }

    /// Hands each unit's optimizer the decay overrides of its chunk.
    fn apply_decay(&mut self) -> Result<()> {
        for (u, unit) in self.layout.units().iter().enumerate() {
            let mut whole: Vec<DecayOverride> = Vec::new();
            let mut params: Vec<usize> = unit.params.clone();
            params.sort_by_key(|&p| self.layout.params()[p].offset);
            for p in params {
                let Some(wd) = self.decay[p] else { continue };
                let slot = &self.layout.params()[p];
                let range = slot.offset..slot.offset + slot.numel;
                match whole.last_mut() {
                    Some(last) if last.range.end == range.start && last.weight_decay == wd => {
                        last.range.end = range.end;
                    }
                    _ => whole.push(DecayOverride {
                        range,
                        weight_decay: wd,
                    }),
                }
            }
            let mine = if self.cfg.stage == ZeroStage::Replicated {
                0..unit.len
            } else {
                chunk_range(unit.len, self.dp_size, self.dp_rank)
            };
            self.optim[u].set_decay_overrides(DecayOverride::for_shard(&whole, mine))?;
        }
        Ok(())
    }

    /// The optimizers, one per unit, holding this rank's chunk (the whole unit when
    /// replicated), for checkpoints.
    pub fn optimizers(&self) -> &[Box<dyn Optimizer>] {
        &self.optim
    }

    /// Mutable access to the optimizers (restoring a checkpoint).
    pub fn optimizers_mut(&mut self) -> &mut [Box<dyn Optimizer>] {
        &mut self.optim
    }

    /// This rank's fp32 master values per unit (the chunk it owns, or the whole unit), as the
    /// host holds them: when the step is device-resident ([`DataParallel::is_device_resident`])
    /// these are refreshed only by a restore; [`DataParallel::full_params`] and the engine's
    /// checkpoint state read the device.
    pub fn master(&self) -> &[Vec<f32>] {
        &self.master
    }

    /// Replaces this rank's master values (restoring a checkpoint) and refreshes the model's
    /// variables. Collective over the data-parallel group.
    pub fn load_master(&mut self, master: Vec<Vec<f32>>) -> Result<()> {
        if master.len() != self.master.len()
            || master
                .iter()
                .zip(&self.master)
                .any(|(a, b)| a.len() != b.len())
        {
            return Err(ParallelError::Param {
                name: "master".into(),
                expected: format!("{:?}", self.master.iter().map(Vec::len).collect::<Vec<_>>()),
                got: format!("{:?}", master.iter().map(Vec::len).collect::<Vec<_>>()),
            });
        }
        self.master = master;
        #[cfg(feature = "cuda")]
        self.resident_load_master()?;
        if self.cfg.stage != ZeroStage::Zero3 {
            self.gather_into_vars()?;
        }
        Ok(())
    }

    /// Bytes of model state this rank holds in its buffers: (weights, gradients, optimizer
    /// states). Weights are the model's variables (none under ZeRO-3); the optimizer states are
    /// the fp32 master copy and the optimizer's buffers (AdamW's two moments).
    pub fn model_state_bytes(&self) -> (u64, u64, u64) {
        let weights: u64 = self
            .vars
            .iter()
            .flatten()
            .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum();
        let grads: u64 = self
            .grads
            .iter()
            .chain(&self.grad_shards)
            .map(|g| g.len() as u64 * 4)
            .sum();
        let optim: u64 = self
            .master
            .iter()
            .zip(&self.optim)
            .map(|(m, o)| {
                let state: usize = o.state_buffers().iter().map(|(_, b)| b.len()).sum();
                (m.len() + state) as u64 * 4
            })
            .sum();
        (weights, grads, optim)
    }

    /// The full parameter vector in layout order, gathered from every rank (collective over the
    /// data-parallel group). For checks and checkpoints.
    pub fn full_params(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let mut out = Vec::with_capacity(self.layout.params().len());
        for (u, unit) in self.layout.units().iter().enumerate() {
            let full = self.gather_unit(u)?;
            for &p in &unit.params {
                let s = &self.layout.params()[p];
                out.push((s.name.clone(), full[s.offset..s.offset + s.numel].to_vec()));
            }
            debug_assert_eq!(full.len(), unit.len);
        }
        Ok(out)
    }

    fn gather_unit(&self, u: usize) -> Result<Vec<f32>> {
        #[cfg(feature = "cuda")]
        if let Some(full) = self.resident_unit(u)? {
            return Ok(full);
        }
        if self.cfg.stage == ZeroStage::Replicated {
            return Ok(self.master[u].clone());
        }
        let mut full = vec![0.0f32; self.layout.units()[u].len];
        self.comm.all_gather(&self.master[u], &mut full)?;
        Ok(full)
    }

    pub(super) fn gather_into_vars(&mut self) -> Result<()> {
        let mut gathered = Vec::new();
        for (u, unit) in self.layout.units().iter().enumerate() {
            // replicated: every rank holds the whole unit, written from where it is
            let full: &[f32] = if self.cfg.stage == ZeroStage::Replicated {
                &self.master[u]
            } else {
                gathered.resize(unit.len, 0.0);
                self.comm.all_gather(&self.master[u], &mut gathered)?;
                &gathered
            };
            for &p in &unit.params {
                let s = &self.layout.params()[p];
                if let Some(v) = &self.vars[p] {
                    write_var(v, &full[s.offset..s.offset + s.numel])?;
                }
            }
        }
        Ok(())
    }
}
