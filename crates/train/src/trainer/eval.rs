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

    /// Every parameter, whole (tensor-parallel shards joined), by name in layout order: the
    /// same on every rank (collective over the world).
    pub fn dense_parameters(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let local = self.engine.full_params()?;
        let tp = self.dims.tp;
        if tp == 1 {
            return Ok(local);
        }
        let layout = self.engine.layout();
        let mut out = Vec::with_capacity(local.len());
        for (name, values) in local {
            let mut all = vec![0.0f32; values.len() * tp];
            self.tp.all_gather(&values, &mut all)?;
            let split = layout
                .index(&name)
                .map_or(kiln_parallel::tp::TpSplit::Replicated, |i| {
                    self.engine.param_splits()[i]
                });
            if split == kiln_parallel::tp::TpSplit::Replicated {
                out.push((name, values));
                continue;
            }
            let shape = layout
                .index(&name)
                .map(|i| layout.params()[i].shape.clone())
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
