//! Evaluation and the model's weights whole (ZeRO-3 gathered, tensor-parallel shards joined).

use crate::data::micro_batches;
use crate::error::Result;
use crate::model::TrainModel;
use candle_core::{Tensor, Var};
use kiln_comm::{CommExt, ReduceOp};
use kiln_data::{DataLoader, LoaderConfig};
use kiln_memory::SegmentParams;
use kiln_parallel::ZeroStage;

use super::Trainer;

impl<M: TrainModel> Trainer<M> {
    /// Mean loss over `RunConfig.eval.batches` validation batches per data-parallel rank (the
    /// same batches at every evaluation), averaged over the data-parallel group; `None`
    /// without validation data. Collective.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        if self.val_sources.is_empty() || self.cfg.eval.batches == 0 {
            return Ok(None);
        }
        let cfg = LoaderConfig {
            batch_size: self.cfg.train.micro_batch,
            seed: self.cfg.seed ^ 0x7661_6c69_6461_7465,
            workers: 0,
            ..self.loader_cfg.clone()
        };
        let mut val = DataLoader::new(self.val_sources.clone(), None, cfg)?;
        // every stage's trained weights into every rank's model, which then runs whole
        self.sync_pipeline_weights()?;
        let lists = self.model.segment_param_lists();
        let gathered: Option<std::collections::HashMap<String, Var>> =
            if self.engine.config().stage == ZeroStage::Zero3 {
                let layout = self.engine.layout();
                let mut map = std::collections::HashMap::new();
                for (name, values) in self.engine.full_params()? {
                    let shape = layout
                        .index(&name)
                        .map(|i| layout.params()[i].shape.clone())
                        .unwrap_or_else(|| vec![values.len()]);
                    let t = Tensor::from_vec(values, shape, self.engine.device())?;
                    map.insert(name, Var::from_tensor(&t)?);
                }
                Some(map)
            } else {
                None
            };
        let segs: Vec<SegmentParams> = lists
            .into_iter()
            .map(|seg| {
                SegmentParams::new(
                    seg.into_iter()
                        .map(|(n, v)| {
                            let v = gathered
                                .as_ref()
                                .and_then(|g| g.get(&n).cloned())
                                .unwrap_or(v);
                            (n, v)
                        })
                        .collect(),
                )
            })
            .collect();
        let mut sum = 0.0f64;
        for _ in 0..self.cfg.eval.batches {
            let b = val.next_batch()?;
            let mut mb = micro_batches(&b, 1, self.engine.device())?;
            let batch = mb.remove(0);
            let mut h = batch.inputs().clone();
            for (i, p) in segs.iter().enumerate() {
                h = self.model.forward_segment(i, &h, &batch, p)?;
            }
            sum += h.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        }
        let mean = sum / self.cfg.eval.batches as f64;
        Ok(Some(self.dp.all_reduce_scalar(mean, ReduceOp::Avg)?))
    }

    /// Makes the model's own variables hold the trained weights, so it can be used outside
    /// the engine (generation, export): under ZeRO-3 the engine keeps only shards and the
    /// model's variables still hold their initial values; this gathers the shards into them
    /// (collective over the data-parallel group). A no-op for the other stages, whose
    /// variables the engine updates after every step.
    pub fn materialize_weights(&self) -> Result<()> {
        self.sync_pipeline_weights()?;
        if self.engine.config().stage != ZeroStage::Zero3 {
            return Ok(());
        }
        let vars: std::collections::HashMap<String, Var> = self
            .model
            .segment_param_lists()
            .into_iter()
            .flatten()
            .collect();
        for (name, values) in self.engine.full_params()? {
            if let Some(v) = vars.get(&name) {
                kiln_parallel::write_var(v, &values)?;
            }
        }
        Ok(())
    }

    /// Under pipeline parallelism each rank's engine trains its own stage's parameters:
    /// this broadcasts every parameter from the pipeline rank that owns it over the pipeline
    /// group, so that every rank's model holds the whole trained model (for evaluation,
    /// generation and export; collective over the pipeline group). A no-op without a pipeline.
    pub fn sync_pipeline_weights(&self) -> Result<()> {
        let Some(sp) = &self.stage_plan else {
            return Ok(());
        };
        let mut seen = std::collections::HashSet::new();
        for (name, var) in self.model.segment_param_lists().into_iter().flatten() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let owner = sp.owner.get(&name).copied().unwrap_or(0);
            let mut values = var
                .as_tensor()
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?;
            self.pp.broadcast(&mut values, owner)?;
            if self.pp.rank() != owner {
                kiln_parallel::write_var(&var, &values)?;
            }
        }
        Ok(())
    }

    /// Every parameter, whole (tensor-parallel shards joined), by name in layout order: the
    /// same on every rank (collective over the world). Under pipeline parallelism, every
    /// stage's parameters in the model's order.
    pub fn dense_parameters(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let local = match &self.stage_plan {
            None => self.engine.full_params()?,
            Some(_) => {
                self.sync_pipeline_weights()?;
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                for (name, var) in self.model.segment_param_lists().into_iter().flatten() {
                    if seen.insert(name.clone()) {
                        let v = var
                            .as_tensor()
                            .flatten_all()?
                            .to_dtype(candle_core::DType::F32)?
                            .to_vec1::<f32>()?;
                        out.push((name, v));
                    }
                }
                out
            }
        };
        let tp = self.dims.tp;
        if tp == 1 {
            return Ok(local);
        }
        // each parameter's split and shard shape, from the model (which lists every stage's)
        let splits: std::collections::HashMap<String, kiln_parallel::tp::TpSplit> =
            self.model.param_splits().into_iter().collect();
        let shapes: std::collections::HashMap<String, Vec<usize>> = self
            .model
            .segment_param_lists()
            .into_iter()
            .flatten()
            .map(|(n, v)| (n, v.as_tensor().dims().to_vec()))
            .collect();
        let mut out = Vec::with_capacity(local.len());
        for (name, values) in local {
            let mut all = vec![0.0f32; values.len() * tp];
            self.tp.all_gather(&values, &mut all)?;
            let split = splits
                .get(&name)
                .copied()
                .unwrap_or(kiln_parallel::tp::TpSplit::Replicated);
            if split == kiln_parallel::tp::TpSplit::Replicated {
                out.push((name, values));
                continue;
            }
            let shape = shapes
                .get(&name)
                .cloned()
                .unwrap_or_else(|| vec![values.len()]);
            let shards: Vec<Tensor> = all
                .chunks(values.len())
                .map(|c| Tensor::from_slice(c, shape.as_slice(), &candle_core::Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let full = split.unshard(&shards)?;
            out.push((name, full.flatten_all()?.to_vec1::<f32>()?));
        }
        Ok(out)
    }
}
