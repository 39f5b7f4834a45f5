//! The engine's state per parameter, so that it reshards: every parameter (and each of its
//! optimizer's buffers, AdamW's two moments) is stored under its own name with the shape of the **whole** (tensor-parallel
//! unsplit) tensor, and each rank's piece records which slice it is ([`Shard`]), so the state
//! loads at any data-parallel degree, ZeRO stage and tensor-parallel degree:
//!
//! - `tp == 1`: each rank saves, per parameter, the flat range its ZeRO chunk of the flat unit
//!   buffer covers ([`Shard::Flat`]; with plain data parallelism every rank still saves only
//!   its [`chunk_range`] of each unit, so nothing is written twice). No collective.
//! - `tp > 1`: the ranks of each data-parallel group first all-gather their units, then the
//!   data-parallel rank 0 of every tensor-parallel rank saves its tensor-parallel shard of each
//!   parameter as a [`Shard::Dim`] slice: rows for [`TpSplit::Rows`], the last dimension for
//!   [`TpSplit::Cols`]. The fused QKV ([`TpSplit::Qkv`], rank `r` holding `[q_r | k_r | v_r]`)
//!   is stored with the shape `[3, d, ...]` (the same bytes as `[3d, ...]`), where each rank's
//!   part is the dim-1 slice `r * d / tp ..`; a SwiGLU's fused gate and up
//!   ([`TpSplit::GateUp`]) likewise as `[2, f, ...]`. Replicated parameters are saved whole by
//!   tensor-parallel rank 0. The gather costs one extra copy of the unit buffers.
//!
//! Loading asks the checkpoint for exactly the slices this rank needs
//! ([`Stateful::state_wants`]: a flat range per parameter at `tp == 1`, the rank's
//! tensor-parallel shard otherwise) and copies its ZeRO chunk out of them, so the values are
//! bitwise the saved ones.
//!
//! [`DataParallel`] as a [`Stateful`]: tensors `param/<name>` and `<buffer>/<name>` for each of
//! the optimizer's state buffers (AdamW: `exp_avg/<name>`, `exp_avg_sq/<name>`; SGD with
//! momentum: `momentum_buffer/<name>`); metadata `step` (optimizer steps) and `optimizer` (its
//! name: loading another optimizer's state is an error).

use crate::engine::DataParallel;
use crate::error::{ParallelError, Result};
use crate::flat::FlatLayout;
use crate::tp::TpSplit;
use kiln_comm::{chunk_range, CommExt, Communicator};
use kiln_state::ZeroStage;
use kiln_state::{DType, Shard, StateDict, StateError, Stateful, TensorData, TensorSpec, Want};
use std::collections::BTreeMap;
use std::ops::Range;

fn engine_err(e: impl std::fmt::Display) -> StateError {
    StateError::component("data-parallel engine", e)
}

const PARAM: &str = "param/";

/// One parameter's place in the flat units and in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedParam {
    /// The parameter name.
    pub name: String,
    /// Its unit.
    pub unit: usize,
    /// Its offset in the unit.
    pub offset: usize,
    /// Elements this rank holds of it (the tensor-parallel shard).
    pub numel: usize,
    /// The shape of the whole tensor as the checkpoint stores it.
    pub global_shape: Vec<usize>,
    /// This tensor-parallel rank's slice of the whole tensor (`None`: the whole tensor).
    pub region: Option<Shard>,
    /// The elements of this rank's (tensor-parallel) tensor that its master buffer holds.
    pub mine: Range<usize>,
    /// The elements it saves at `tp == 1`: those in its [`chunk_range`] of the unit (equal to
    /// `mine` under ZeRO; a part of it with plain data parallelism, so no element is saved
    /// twice).
    pub save: Range<usize>,
}

/// Where every parameter of a [`FlatLayout`] goes in a checkpoint, for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    params: Vec<PlannedParam>,
    /// Per unit, the range of the unit this rank's master buffer holds.
    chunks: Vec<Range<usize>>,
    unit_lens: Vec<usize>,
    stage: ZeroStage,
    dp: usize,
    dp_rank: usize,
    tp: usize,
    tp_rank: usize,
    /// Pipeline stages and this rank's (1 and 0 without a pipeline).
    pp: usize,
    pp_rank: usize,
}

/// The checkpoint shape of a parameter whose tensor-parallel shard has shape `local`, and the
/// shard's slice of it (`None` when the rank holds the whole tensor).
pub fn checkpoint_geometry(
    name: &str,
    split: TpSplit,
    local: &[usize],
    tp: usize,
    tp_rank: usize,
) -> Result<(Vec<usize>, Option<Shard>)> {
    let bad = |why: &str| {
        ParallelError::Config(format!(
            "parameter {name} of shape {local:?} split {split:?}: {why}"
        ))
    };
    if local.is_empty() {
        return Ok((local.to_vec(), None));
    }
    let (global, dim, n) = match split {
        TpSplit::Replicated => return Ok((local.to_vec(), None)),
        TpSplit::Rows => {
            let mut g = local.to_vec();
            g[0] *= tp;
            (g, 0, local[0])
        }
        TpSplit::Cols => {
            let last = local.len() - 1;
            let mut g = local.to_vec();
            g[last] *= tp;
            (g, last, local[last])
        }
        TpSplit::Qkv | TpSplit::GateUp => {
            let k = split.parts();
            if local[0] % k != 0 {
                return Err(bad(&format!(
                    "the fused dimension is not a multiple of {k}"
                )));
            }
            let m = local[0] / k;
            let mut g = vec![k, m * tp];
            g.extend_from_slice(&local[1..]);
            (g, 1, m)
        }
    };
    let region = (tp > 1).then(|| Shard::dim(&global, dim, tp_rank * n, n));
    Ok((global, region))
}

impl ShardPlan {
    /// The plan of rank (`dp_rank`, `tp_rank`) for `layout` under `stage`; `split` tells how
    /// each parameter is split over the `tp` ranks.
    pub fn new(
        layout: &FlatLayout,
        stage: ZeroStage,
        (dp, dp_rank): (usize, usize),
        (tp, tp_rank): (usize, usize),
        split: impl Fn(&str) -> TpSplit,
    ) -> Result<Self> {
        let chunks: Vec<Range<usize>> = layout
            .units()
            .iter()
            .map(|u| {
                if stage == ZeroStage::Replicated {
                    0..u.len
                } else {
                    chunk_range(u.len, dp, dp_rank)
                }
            })
            .collect();
        let mut params = Vec::with_capacity(layout.params().len());
        for slot in layout.params() {
            let (global_shape, region) =
                checkpoint_geometry(&slot.name, split(&slot.name), &slot.shape, tp, tp_rank)?;
            let overlap = |c: &Range<usize>| {
                let lo = slot.offset.max(c.start);
                let hi = (slot.offset + slot.numel).min(c.end);
                if lo < hi {
                    lo - slot.offset..hi - slot.offset
                } else {
                    0..0
                }
            };
            let mine = overlap(&chunks[slot.unit]);
            let save = overlap(&chunk_range(layout.units()[slot.unit].len, dp, dp_rank));
            params.push(PlannedParam {
                name: slot.name.clone(),
                unit: slot.unit,
                offset: slot.offset,
                numel: slot.numel,
                global_shape,
                region,
                mine,
                save,
            });
        }
        Ok(ShardPlan {
            params,
            chunks,
            unit_lens: layout.units().iter().map(|u| u.len).collect(),
            stage,
            dp,
            dp_rank,
            tp,
            tp_rank,
            pp: 1,
            pp_rank: 0,
        })
    }

    /// The same plan on stage `pp_rank` of a pipeline of `pp` stages (the stage's own
    /// parameters; the data-parallel group of a staged state is then the stage's).
    pub fn on_stage(mut self, (pp_rank, pp): (usize, usize)) -> Self {
        self.pp = pp.max(1);
        self.pp_rank = pp_rank;
        self
    }

    /// The planned parameters, in layout order.
    pub fn params(&self) -> &[PlannedParam] {
        &self.params
    }

    /// What this rank asks a resharding loader for: per parameter overlapping its chunk, the
    /// slice it needs, under each of `prefixes` (`param/`, `exp_avg/`, ...).
    pub fn wants(&self, prefixes: &[&str]) -> BTreeMap<String, Want> {
        let mut out = BTreeMap::new();
        for p in self.params.iter().filter(|p| !p.mine.is_empty()) {
            for prefix in prefixes {
                out.insert(format!("{prefix}{}", p.name), self.want(p));
            }
        }
        out
    }

    fn want(&self, p: &PlannedParam) -> Want {
        if self.tp == 1 {
            Want::Slice(Shard::flat(&p.global_shape, p.mine.start, p.mine.len()))
        } else {
            match &p.region {
                Some(s) => Want::Slice(s.clone()),
                None => Want::Full,
            }
        }
    }

    fn expected_shape(&self, p: &PlannedParam) -> Vec<usize> {
        if self.tp == 1 {
            vec![p.mine.len()]
        } else {
            p.region
                .as_ref()
                .map_or_else(|| p.global_shape.clone(), Shard::local_shape)
        }
    }

    /// The tensors a load expects under each of `prefixes`, with this rank's shapes.
    pub fn spec(&self, prefixes: &[&str]) -> BTreeMap<String, TensorSpec> {
        let mut out = BTreeMap::new();
        for p in self.params.iter().filter(|p| !p.mine.is_empty()) {
            for prefix in prefixes {
                out.insert(
                    format!("{prefix}{}", p.name),
                    TensorSpec {
                        dtype: DType::F32,
                        shape: self.expected_shape(p),
                    },
                );
            }
        }
        out
    }

    /// The whole (tensor-parallel local) unit `u` from this rank's chunk `mine` of it:
    /// all-gathered over the data-parallel group under ZeRO.
    fn full_unit(
        &self,
        dp: &dyn Communicator,
        u: usize,
        mine: &[f32],
    ) -> kiln_state::Result<Vec<f32>> {
        if self.stage == ZeroStage::Replicated {
            return Ok(mine.to_vec());
        }
        let mut full = vec![0.0f32; self.unit_lens[u]];
        dp.all_gather(mine, &mut full).map_err(engine_err)?;
        Ok(full)
    }

    /// Puts into `sd` the tensors of this rank's pieces of the per-unit buffers `units` (this rank's chunks),
    /// each named `{prefix}{param}`. Collective over `dp` when `tp > 1`.
    pub fn save_buffers(
        &self,
        dp: &dyn Communicator,
        sd: &mut StateDict,
        prefix: &str,
        units: &[&[f32]],
    ) -> kiln_state::Result<()> {
        if self.tp == 1 {
            for p in self.params.iter().filter(|p| !p.save.is_empty()) {
                let base = p.offset + p.save.start - self.chunks[p.unit].start;
                let data = &units[p.unit][base..base + p.save.len()];
                let t = TensorData::from_slice(&[data.len()], data)?;
                let shard = Shard::flat(&p.global_shape, p.save.start, p.save.len());
                sd.insert_sharded(&format!("{prefix}{}", p.name), t, shard)?;
            }
            return Ok(());
        }
        let full: Vec<Vec<f32>> = units
            .iter()
            .enumerate()
            .map(|(u, mine)| self.full_unit(dp, u, mine))
            .collect::<kiln_state::Result<_>>()?;
        if self.dp_rank != 0 {
            return Ok(());
        }
        for p in &self.params {
            let data = &full[p.unit][p.offset..p.offset + p.numel];
            let name = format!("{prefix}{}", p.name);
            match &p.region {
                Some(s) => {
                    let t = TensorData::from_slice(&s.local_shape(), data)?;
                    sd.insert_sharded(&name, t, s.clone())?;
                }
                None if self.tp_rank == 0 => {
                    sd.insert(&name, TensorData::from_slice(&p.global_shape, data)?)?;
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Copies the loaded tensors `{prefix}{param}` into this rank's per-unit chunks `units`.
    pub fn load_buffers(
        &self,
        sd: &StateDict,
        prefix: &str,
        units: &mut [Vec<f32>],
    ) -> kiln_state::Result<()> {
        for p in self.params.iter().filter(|p| !p.mine.is_empty()) {
            let name = format!("{prefix}{}", p.name);
            let values: Vec<f32> = sd.get(&name)?;
            let src = if self.tp == 1 {
                if values.len() != p.mine.len() {
                    return Err(engine_err(format!(
                        "tensor {name} holds {} elements but this rank needs {} (elements {}..{} \
                         of the parameter): with plain data parallelism each rank saves only its \
                         part, so load through a checkpoint, which assembles every rank's part \
                         (kiln-ckpt's load_resharded with ReshardRequest::component)",
                        values.len(),
                        p.mine.len(),
                        p.mine.start,
                        p.mine.end
                    )));
                }
                &values[..]
            } else {
                values.get(p.mine.clone()).ok_or_else(|| {
                    engine_err(format!(
                        "tensor {name} has {} elements, fewer than {}",
                        values.len(),
                        p.mine.end
                    ))
                })?
            };
            let base = p.offset + p.mine.start - self.chunks[p.unit].start;
            let dst = units
                .get_mut(p.unit)
                .and_then(|b| b.get_mut(base..base + src.len()))
                .ok_or_else(|| engine_err(format!("tensor {name} does not fit unit {}", p.unit)))?;
            dst.copy_from_slice(src);
        }
        Ok(())
    }
}

/// A [`DataParallel`]'s checkpoint state copied on the training thread
/// ([`DataParallel::stage_state`]: plain copies of the master weights and the optimizer's
/// buffers into buffers kept from the previous save) and turned into its [`StateDict`] later,
/// on any thread ([`StagedState::state`]): the engine's part of an asynchronous checkpoint
/// whose gathers over the data-parallel group and tensor building run on the checkpoint
/// writer's thread (`kiln_ckpt::Snapshot::build_later`). The state is bitwise what the
/// engine's [`Stateful::state`] gives at the time of the copy.
#[derive(Debug, Default)]
pub struct StagedState {
    plan: Option<ShardPlan>,
    master: Vec<Vec<f32>>,
    /// Per optimizer buffer, per unit.
    buffers: Vec<Vec<Vec<f32>>>,
    prefixes: Vec<String>,
    optimizer: &'static str,
    step: u64,
}

/// Copies `src` into `dst`, keeping `dst`'s allocations.
fn copy_units(dst: &mut Vec<Vec<f32>>, src: &[&[f32]]) {
    dst.resize_with(src.len(), Vec::new);
    for (d, s) in dst.iter_mut().zip(src) {
        d.clear();
        d.extend_from_slice(s);
    }
}

impl StagedState {
    /// An empty stage; [`DataParallel::stage_state`] fills it.
    pub fn new() -> Self {
        Self::default()
    }

    /// The staged state as a checkpoint part. Where the engine splits parameters over a
    /// tensor-parallel group (`tp > 1`) or the model into pipeline stages, this gathers each
    /// data-parallel group's chunks: `comm` must then span the engine's whole world (data x
    /// tensor x pipeline parallel) in its rank order, as a checkpoint writer's communicator does; it is split into the data-parallel
    /// groups (`ParallelDims::build_groups`' colours), collectively. With `tp == 1` nothing is
    /// communicated.
    pub fn state(&self, comm: &dyn Communicator) -> kiln_state::Result<StateDict> {
        let plan = self
            .plan
            .as_ref()
            .ok_or_else(|| engine_err("nothing staged: call DataParallel::stage_state first"))?;
        let group;
        let dp: &dyn Communicator = if plan.tp > 1 || plan.pp > 1 {
            let world = plan.dp * plan.tp * plan.pp;
            let rank = (plan.pp_rank * plan.dp + plan.dp_rank) * plan.tp + plan.tp_rank;
            if comm.world_size() != world || comm.rank() != rank {
                let pp = if plan.pp > 1 {
                    format!(" x pp {}", plan.pp)
                } else {
                    String::new()
                };
                return Err(engine_err(format!(
                    "staged state of rank {rank} of dp {} x tp {}{pp} = {world}: the \
                     communicator is rank {} of {}",
                    plan.dp,
                    plan.tp,
                    comm.rank(),
                    comm.world_size()
                )));
            }
            group = comm
                .split((plan.pp_rank * plan.tp + plan.tp_rank) as u32, rank as u32)
                .map_err(engine_err)?;
            &*group
        } else {
            comm
        };
        let master: Vec<&[f32]> = self.master.iter().map(Vec::as_slice).collect();
        let bufs: Vec<Vec<&[f32]>> = self
            .buffers
            .iter()
            .map(|b| b.iter().map(Vec::as_slice).collect())
            .collect();
        engine_state(
            plan,
            dp,
            &master,
            &bufs,
            (&self.prefixes, self.optimizer, self.step),
        )
    }
}

impl DataParallel {
    /// Copies this rank's checkpoint state into `staged`, reusing its buffers: the master
    /// weights and the optimizer's buffers (from the device when the step is
    /// device-resident), with what [`StagedState::state`] needs to make the checkpoint part
    /// later. No communication.
    pub fn stage_state(&self, staged: &mut StagedState) -> Result<()> {
        staged.plan = Some(self.shard_plan()?);
        let device = self.device_snapshot()?;
        let master: Vec<&[f32]> = match &device {
            Some((m, _)) => m.iter().map(Vec::as_slice).collect(),
            None => self.master().iter().map(Vec::as_slice).collect(),
        };
        copy_units(&mut staged.master, &master);
        let opt = self.optimizers();
        let (name, prefixes) = self.optimizer_layout();
        staged.buffers.resize_with(prefixes.len(), Vec::new);
        for (b, dst) in staged.buffers.iter_mut().enumerate() {
            let bufs: Vec<&[f32]> = match &device {
                Some((_, ob)) => ob[b].iter().map(Vec::as_slice).collect(),
                None => opt.iter().map(|o| o.state_buffers()[b].1).collect(),
            };
            copy_units(dst, &bufs);
        }
        staged.prefixes = prefixes;
        staged.optimizer = name;
        staged.step = opt.first().map_or(0, |o| o.step_count());
        Ok(())
    }
}

impl DataParallel {
    /// Where this rank's pieces of every parameter go in a checkpoint.
    pub fn shard_plan(&self) -> Result<ShardPlan> {
        let splits = self.param_splits().to_vec();
        let names: Vec<String> = self
            .layout()
            .params()
            .iter()
            .map(|p| p.name.clone())
            .collect();
        ShardPlan::new(
            self.layout(),
            self.config().stage,
            self.dp_dims(),
            self.tp_dims(),
            |n| {
                names
                    .iter()
                    .position(|m| m == n)
                    .map_or(TpSplit::Replicated, |i| splits[i])
            },
        )
        .map(|p| p.on_stage(self.pipeline_dims()))
    }
}

impl DataParallel {
    /// The optimizer's name and the checkpoint prefixes of its state buffers.
    fn optimizer_layout(&self) -> (&'static str, Vec<String>) {
        let first = self.optimizers().first();
        let name = first.map_or("none", |o| o.name());
        let prefixes = first.map_or_else(Vec::new, |o| {
            o.state_buffers()
                .iter()
                .map(|(b, _)| format!("{b}/"))
                .collect()
        });
        (name, prefixes)
    }

    /// Every tensor prefix of the engine's state: the parameters, then the optimizer's buffers.
    fn state_prefixes(&self) -> Vec<String> {
        let mut all = vec![PARAM.to_string()];
        all.extend(self.optimizer_layout().1);
        all
    }
}

/// The checkpoint state of `master` and the optimizer's buffers `bufs[b]` (named
/// `prefixes[b]`) under `plan`: what [`DataParallel`]'s [`Stateful::state`] gives, from the
/// engine itself or from a [`StagedState`]. Collective over `dp` when `tp > 1`.
fn engine_state(
    plan: &ShardPlan,
    dp: &dyn Communicator,
    master: &[&[f32]],
    bufs: &[Vec<&[f32]>],
    (prefixes, name, step): (&[String], &str, u64),
) -> kiln_state::Result<StateDict> {
    let mut sd = StateDict::new();
    plan.save_buffers(dp, &mut sd, PARAM, master)?;
    for (prefix, b) in prefixes.iter().zip(bufs) {
        plan.save_buffers(dp, &mut sd, prefix, b)?;
    }
    sd.set_meta("step", step)?;
    sd.set_meta("optimizer", name)?;
    Ok(sd)
}

/// The master weights and the optimizer's buffers and step count, per parameter. `state` is
/// collective over the data-parallel group when `tp > 1`; `load_state` is collective over it
/// always (the model's variables are refreshed from the loaded master).
impl Stateful for DataParallel {
    fn state(&self) -> kiln_state::Result<StateDict> {
        let plan = self.shard_plan().map_err(engine_err)?;
        // a device-resident step's buffers are copied to the host here, and only here
        let device = self.device_snapshot().map_err(engine_err)?;
        let master: Vec<&[f32]> = match &device {
            Some((m, _)) => m.iter().map(Vec::as_slice).collect(),
            None => self.master().iter().map(Vec::as_slice).collect(),
        };
        let opt = self.optimizers();
        let (name, prefixes) = self.optimizer_layout();
        let bufs: Vec<Vec<&[f32]>> = (0..prefixes.len())
            .map(|b| match &device {
                Some((_, ob)) => ob[b].iter().map(Vec::as_slice).collect(),
                None => opt.iter().map(|o| o.state_buffers()[b].1).collect(),
            })
            .collect();
        let step = opt.first().map_or(0, |o| o.step_count());
        engine_state(
            &plan,
            self.dp_comm(),
            &master,
            &bufs,
            (&prefixes, name, step),
        )
    }

    fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
        let plan = self.shard_plan().map_err(engine_err)?;
        let steps: u64 = state.meta("step")?;
        let (name, prefixes) = self.optimizer_layout();
        // checkpoints written before the optimizer became pluggable hold AdamW's state
        let saved: String = if state.meta_map().contains_key("optimizer") {
            state.meta("optimizer")?
        } else {
            "adamw".into()
        };
        if saved != name {
            return Err(engine_err(format!(
                "the checkpoint holds the state of optimizer {saved:?}, this engine runs {name:?}"
            )));
        }
        self.sync_host().map_err(engine_err)?;
        let mut master: Vec<Vec<f32>> = self.master().to_vec();
        plan.load_buffers(&state, PARAM, &mut master)?;
        let mut loaded: Vec<Vec<Vec<f32>>> = Vec::with_capacity(prefixes.len());
        for (b, prefix) in prefixes.iter().enumerate() {
            let mut bufs: Vec<Vec<f32>> = self
                .optimizers()
                .iter()
                .map(|o| o.state_buffers()[b].1.to_vec())
                .collect();
            plan.load_buffers(&state, prefix, &mut bufs)?;
            loaded.push(bufs);
        }
        for (u, o) in self.optimizers_mut().iter_mut().enumerate() {
            for (b, (buf_name, buf)) in o.state_buffers_mut().into_iter().enumerate() {
                let src = &loaded[b][u];
                if buf.len() != src.len() {
                    return Err(engine_err(format!(
                        "optimizer buffer {buf_name} of {} elements, checkpoint chunk of {}",
                        buf.len(),
                        src.len()
                    )));
                }
                buf.copy_from_slice(src);
            }
            o.set_step_count(steps);
        }
        self.load_master(master).map_err(engine_err)
    }

    fn state_spec(&self) -> kiln_state::Result<BTreeMap<String, TensorSpec>> {
        let plan = self.shard_plan().map_err(engine_err)?;
        let prefixes = self.state_prefixes();
        let refs: Vec<&str> = prefixes.iter().map(String::as_str).collect();
        Ok(plan.spec(&refs))
    }

    fn state_wants(&self) -> Option<BTreeMap<String, Want>> {
        let plan = self.shard_plan().ok()?;
        let prefixes = self.state_prefixes();
        let refs: Vec<&str> = prefixes.iter().map(String::as_str).collect();
        Some(plan.wants(&refs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_is_a_dim_one_slice_of_a_three_way_tensor() {
        // d = 4, tp = 2: rank 1 holds rows [2, 3, 6, 7, 10, 11] of [12, 5]
        let (g, r) = checkpoint_geometry("qkv", TpSplit::Qkv, &[6, 5], 2, 1).unwrap();
        assert_eq!(g, [3, 4, 5]);
        let r = r.unwrap();
        assert_eq!(r, Shard::dim(&[3, 4, 5], 1, 2, 2));
        assert_eq!(r.local_shape(), [3, 2, 5]);
        let (g, r) = checkpoint_geometry("qkv", TpSplit::Qkv, &[12, 5], 1, 0).unwrap();
        assert_eq!((g, r), (vec![3, 4, 5], None));
        let (g, r) = checkpoint_geometry("w", TpSplit::Cols, &[8, 3], 4, 2).unwrap();
        assert_eq!((g.clone(), r), (vec![8, 12], Some(Shard::dim(&g, 1, 6, 3))));
        let (g, r) = checkpoint_geometry("b", TpSplit::Rows, &[8], 2, 1).unwrap();
        assert_eq!((g.clone(), r), (vec![16], Some(Shard::dim(&g, 0, 8, 8))));
        assert!(checkpoint_geometry("x", TpSplit::Qkv, &[7, 2], 2, 0).is_err());
    }

    /// The flat bytes of a Qkv shard equal the dim-1 slice of the `[3, d, ..]` view: checked
    /// against `TpSplit::shard` on real tensors.
    #[test]
    fn qkv_region_matches_tp_split_shard() {
        use candle_core::{Device, Tensor};
        let full = Tensor::arange(0f32, 60., &Device::Cpu)
            .unwrap()
            .reshape((12, 5))
            .unwrap();
        for rank in 0..2 {
            let shard = TpSplit::Qkv.shard(&full, 2, rank).unwrap();
            let got: Vec<f32> = shard.flatten_all().unwrap().to_vec1().unwrap();
            let (g, r) = checkpoint_geometry("qkv", TpSplit::Qkv, shard.dims(), 2, rank).unwrap();
            let Some(Shard::Dim(s)) = r else { panic!() };
            let view = full.reshape(g.as_slice()).unwrap();
            let want: Vec<f32> = view
                .narrow(s.dim, s.start, s.len)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn plan_covers_every_element_once_across_ranks() {
        let segs = vec![
            vec![
                ("a".to_string(), vec![7usize]),
                ("b".to_string(), vec![2, 3]),
            ],
            vec![("c".to_string(), vec![5])],
        ];
        let layout = FlatLayout::new(&segs, 9).unwrap();
        for stage in [ZeroStage::Replicated, ZeroStage::Zero1, ZeroStage::Zero3] {
            let mut seen: BTreeMap<String, Vec<usize>> = BTreeMap::new();
            for r in 0..3 {
                let plan = ShardPlan::new(&layout, stage, (3, r), (1, 0), |_| TpSplit::Replicated)
                    .unwrap();
                for p in plan.params() {
                    seen.entry(p.name.clone())
                        .or_default()
                        .extend(p.save.clone());
                    if stage == ZeroStage::Replicated {
                        assert_eq!(p.mine, 0..p.numel);
                    } else {
                        assert_eq!(p.mine, p.save);
                    }
                }
            }
            for (name, mut v) in seen {
                v.sort_unstable();
                let n = layout.params()[layout.index(&name).unwrap()].numel;
                assert_eq!(v, (0..n).collect::<Vec<_>>(), "{name}");
            }
        }
    }
}
