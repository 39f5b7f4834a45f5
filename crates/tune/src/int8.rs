//! Real int8: the export of a quantization-aware-trained model (int8 weights with their f32
//! per-channel scales, and the input scales its observers learned) as one safetensors file,
//! and an inference model that computes the block linear layers with integer arithmetic.
//!
//! With input scales (W8A8) a layer computes `y = s_x s_w[o] * sum_k q_x[k] q_w[o, k] + b[o]`
//! with the products summed in i32, where `q_x = clamp(round(x / s_x), -127, 127)`; without
//! them (W8A32) `y = s_w[o] * sum_k x[k] q_w[o, k] + b[o]` in f32. The fake-quantized model
//! computes the same sums with the rounded values scaled back first, so the two agree up to
//! f32 rounding. Embeddings, LayerNorms, biases and the tied head stay f32.

use crate::error::{Result, TuneError};
use crate::qat::{weight_scales, Qat, QMAX};
use candle_core::{DType, Device, Tensor, Var};
use kiln_model::{
    Gpt, GptConfig, GptOptions, Initializer, LayerFactory, LinearLayer, LinearSpec, ParamSource,
};
use kiln_optim::ParamKind;
use kiln_parallel::tp::TpSplit;
use kiln_state::TensorData;
use std::collections::HashMap;
use std::path::Path;

/// The safetensors metadata key holding the model's [`GptConfig`] as JSON.
pub const CONFIG_KEY: &str = "kiln_gpt_config";
/// The suffix of a weight's per-channel scales (`h.0.mlp.c_fc.weight_scale`, f32 `[out]`).
pub const WEIGHT_SCALE_SUFFIX: &str = "_scale";
/// The suffix of a layer's input scale (`h.0.mlp.c_fc.input_scale`, f32 `[1]`).
pub const INPUT_SCALE: &str = "input_scale";

/// What [`export_int8`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportReport {
    /// Bytes of the file.
    pub file_bytes: u64,
    /// Bytes the same parameters take in f32.
    pub f32_bytes: u64,
    /// Int8 weight tensors written.
    pub int8_tensors: usize,
}

struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn f32_raw(t: &Tensor) -> Result<Raw> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(Raw {
        dtype: safetensors::Dtype::F32,
        shape: t.dims().to_vec(),
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}

/// The int8 values `clamp(round(w / s), -127, 127)` and scales `[out]` of a weight `[out, in]`,
/// exactly as the fake-quantized forward rounds them.
pub fn quantize_weight(w: &Tensor) -> Result<(Vec<i8>, Vec<f32>)> {
    let w = w.to_dtype(DType::F32)?;
    let s = weight_scales(&w, None)?;
    let q: Vec<f32> = w
        .broadcast_div(&s)?
        .round()?
        .clamp(-QMAX, QMAX)?
        .flatten_all()?
        .to_vec1()?;
    Ok((
        q.into_iter().map(|v| v as i8).collect(),
        s.flatten_all()?.to_vec1()?,
    ))
}

/// Writes `model` (trained with fake quantization through `qat`, at tp = 1) as int8: every
/// fake-quantized weight as I8 with its `_scale`, each layer's `input_scale` when its inputs
/// are quantized, every other parameter as f32, and the [`GptConfig`] in the metadata.
pub fn export_int8(model: &Gpt, qat: &Qat, path: &Path) -> Result<ExportReport> {
    if let Some(tp) = model.tp_group() {
        return Err(TuneError::input(
            "the model to export",
            "a tp = 1 model (consolidate a tensor-parallel checkpoint first, e.g. with kiln_train::Pretrained)",
            format!("a shard of tp = {}", tp.world_size()),
        ));
    }
    let layers: HashMap<String, Option<f32>> = qat
        .layers()
        .iter()
        .map(|l| (format!("{}.weight", l.name()), l.input_scale()))
        .collect();
    let mut raws: Vec<(String, Raw)> = Vec::new();
    let (mut f32_bytes, mut int8_tensors) = (0u64, 0usize);
    for (name, var) in model.named_parameters() {
        f32_bytes += var.elem_count() as u64 * 4;
        match layers.get(&name) {
            Some(input_scale) => {
                let (q, s) = quantize_weight(var.as_tensor())?;
                raws.push((
                    name.clone(),
                    Raw {
                        dtype: safetensors::Dtype::I8,
                        shape: var.dims().to_vec(),
                        bytes: q.iter().map(|&v| v as u8).collect(),
                    },
                ));
                raws.push((
                    format!("{name}{WEIGHT_SCALE_SUFFIX}"),
                    Raw {
                        dtype: safetensors::Dtype::F32,
                        shape: vec![s.len()],
                        bytes: s.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    },
                ));
                if let Some(sx) = input_scale {
                    let layer = name.trim_end_matches(".weight");
                    raws.push((
                        format!("{layer}.{INPUT_SCALE}"),
                        Raw {
                            dtype: safetensors::Dtype::F32,
                            shape: vec![1],
                            bytes: sx.to_le_bytes().to_vec(),
                        },
                    ));
                }
                int8_tensors += 1;
            }
            None => raws.push((name, f32_raw(var.as_tensor())?)),
        }
    }
    let views = raws
        .iter()
        .map(|(n, r)| {
            safetensors::tensor::TensorView::new(r.dtype, r.shape.clone(), &r.bytes)
                .map(|v| (n.clone(), v))
                .map_err(|e| TuneError::Tensor {
                    name: n.clone(),
                    file: path.display().to_string(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let cfg = serde_json::to_string(model.config())
        .map_err(|e| TuneError::config("model config", e.to_string()))?;
    let meta: HashMap<String, String> = [
        ("format".to_string(), "kiln-int8".to_string()),
        (CONFIG_KEY.to_string(), cfg),
    ]
    .into();
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| TuneError::Tensor {
        name: "(file)".into(),
        file: path.display().to_string(),
        reason: e.to_string(),
    })?;
    std::fs::write(path, &bytes).map_err(|e| TuneError::io(path, e))?;
    Ok(ExportReport {
        file_bytes: bytes.len() as u64,
        f32_bytes,
        int8_tensors,
    })
}

/// One block linear layer in int8.
#[derive(Debug)]
pub struct Int8Linear {
    name: String,
    out_f: usize,
    in_f: usize,
    weight: Vec<i8>,
    scales: Vec<f32>,
    input_scale: Option<f32>,
    bias: Option<Var>,
}

impl Int8Linear {
    /// `y` `[rows, out]` of `x` `[rows, in]`, row-major.
    fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (o, k) = (self.out_f, self.in_f);
        let mut y = vec![0f32; rows * o];
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(rows.max(1));
        let per = rows.div_ceil(threads.max(1)).max(1);
        let quantized: Option<(Vec<i8>, f32)> = self.input_scale.map(|sx| {
            (
                x.iter()
                    .map(|&v| (v / sx).round().clamp(-QMAX as f32, QMAX as f32) as i8)
                    .collect(),
                sx,
            )
        });
        std::thread::scope(|s| {
            for (c, out) in y.chunks_mut(per * o).enumerate() {
                let quantized = &quantized;
                s.spawn(move || {
                    for (r_local, yr) in out.chunks_mut(o).enumerate() {
                        let r = c * per + r_local;
                        match quantized {
                            Some((xq, sx)) => {
                                let xr = &xq[r * k..(r + 1) * k];
                                for (j, yj) in yr.iter_mut().enumerate() {
                                    let wr = &self.weight[j * k..(j + 1) * k];
                                    let acc: i32 = xr
                                        .iter()
                                        .zip(wr)
                                        .map(|(&a, &b)| i32::from(a) * i32::from(b))
                                        .sum();
                                    *yj = acc as f32 * (sx * self.scales[j]);
                                }
                            }
                            None => {
                                let xr = &x[r * k..(r + 1) * k];
                                for (j, yj) in yr.iter_mut().enumerate() {
                                    let wr = &self.weight[j * k..(j + 1) * k];
                                    let acc: f32 =
                                        xr.iter().zip(wr).map(|(&a, &b)| a * f32::from(b)).sum();
                                    *yj = acc * self.scales[j];
                                }
                            }
                        }
                    }
                });
            }
        });
        y
    }
}

impl LinearLayer for Int8Linear {
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> kiln_model::Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.last() != Some(&self.in_f) {
            return Err(kiln_model::ModelError::Shape {
                op: "int8 linear",
                what: "x",
                expected: format!("[.., {}]", self.in_f),
                got: format!("{dims:?}"),
            });
        }
        let rows = x.elem_count() / self.in_f;
        let xs: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let y = self.matmul(&xs, rows);
        let mut out_dims = dims;
        if let Some(l) = out_dims.last_mut() {
            *l = self.out_f;
        }
        let mut y = Tensor::from_vec(y, (rows, self.out_f), x.device())?;
        if self.bias.is_some() {
            let b = params.param(&format!("{}.bias", self.name))?;
            y = y.broadcast_add(&b.to_dtype(DType::F32)?)?;
        }
        Ok(y.reshape(out_dims)?.to_dtype(x.dtype())?)
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        self.bias
            .iter()
            .map(|b| (format!("{}.bias", self.name), b.clone()))
            .collect()
    }

    fn local_out_features(&self) -> usize {
        self.out_f
    }

    fn param_splits(&self) -> Option<Vec<(String, TpSplit)>> {
        Some(
            self.bias
                .iter()
                .map(|_| (format!("{}.bias", self.name), TpSplit::Replicated))
                .collect(),
        )
    }

    fn param_kinds(&self) -> Option<Vec<(String, ParamKind)>> {
        Some(
            self.bias
                .iter()
                .map(|_| (format!("{}.bias", self.name), ParamKind::Bias))
                .collect(),
        )
    }
}

struct Int8Factory<'a> {
    tensors: &'a HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    file: String,
}

impl Int8Factory<'_> {
    fn build(&self, init: &Initializer, spec: &LinearSpec) -> Result<Int8Linear> {
        let wname = format!("{}.weight", spec.name);
        let bad = |name: &str, reason: String| TuneError::Tensor {
            name: name.to_string(),
            file: self.file.clone(),
            reason,
        };
        let (dt, shape, bytes) = self
            .tensors
            .get(&wname)
            .ok_or_else(|| bad(&wname, "missing".into()))?;
        let want = [spec.out_features, spec.in_features];
        if *dt != safetensors::Dtype::I8 || shape.as_slice() != want {
            return Err(bad(
                &wname,
                format!("{dt:?} {shape:?}, expected I8 {want:?}"),
            ));
        }
        let sname = format!("{wname}{WEIGHT_SCALE_SUFFIX}");
        let scales = f32s(self.tensors.get(&sname), &[spec.out_features]).ok_or_else(|| {
            bad(
                &sname,
                format!("missing or not F32 [{}]", spec.out_features),
            )
        })?;
        let iname = format!("{}.{INPUT_SCALE}", spec.name);
        let input_scale = match self.tensors.get(&iname) {
            None => None,
            Some(t) => Some(
                f32s(Some(t), &[1])
                    .and_then(|v| v.first().copied())
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| bad(&iname, "not one positive F32".into()))?,
            ),
        };
        let bias = if spec.bias {
            Some(Var::zeros(spec.out_features, DType::F32, init.device())?)
        } else {
            None
        };
        Ok(Int8Linear {
            name: spec.name.clone(),
            out_f: spec.out_features,
            in_f: spec.in_features,
            weight: bytes.iter().map(|&b| b as i8).collect(),
            scales,
            input_scale,
            bias,
        })
    }
}

fn f32s(
    t: Option<&(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    shape: &[usize],
) -> Option<Vec<f32>> {
    let (dt, s, b) = t?;
    if *dt != safetensors::Dtype::F32 || s.as_slice() != shape {
        return None;
    }
    Some(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

impl LayerFactory for Int8Factory<'_> {
    fn linear(
        &self,
        init: &Initializer,
        spec: &LinearSpec,
    ) -> kiln_model::Result<Box<dyn LinearLayer>> {
        self.build(init, spec)
            .map(|l| Box::new(l) as Box<dyn LinearLayer>)
            .map_err(|e| kiln_model::ModelError::Candle(candle_core::Error::wrap(e)))
    }
}

/// Reads an [`export_int8`] file into a GPT whose block linear layers run in int8. The model
/// is built on the CPU, where the integer kernels run, whatever `opts.device` says; `opts`
/// sets the compute dtype of the floating-point parts (f32 by default). Its `forward` gives
/// the int8 model's logits.
pub fn load_int8(path: &Path, opts: &GptOptions) -> Result<Gpt> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| TuneError::io(path, e))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| TuneError::Tensor {
            name: "(header)".into(),
            file: file.clone(),
            reason: format!("not a safetensors file: {e}"),
        })?;
    let cfg_json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(CONFIG_KEY).cloned())
        .ok_or_else(|| TuneError::Tensor {
            name: CONFIG_KEY.into(),
            file: file.clone(),
            reason: "no model config in the metadata: not a kiln int8 export".into(),
        })?;
    let cfg: GptConfig = serde_json::from_str(&cfg_json).map_err(|e| TuneError::Tensor {
        name: CONFIG_KEY.into(),
        file: file.clone(),
        reason: e.to_string(),
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| TuneError::Tensor {
        name: "(file)".into(),
        file: file.clone(),
        reason: e.to_string(),
    })?;
    let tensors: HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    let factory = Int8Factory {
        tensors: &tensors,
        file: file.clone(),
    };
    let opts = GptOptions {
        device: Device::Cpu,
        ..opts.clone()
    };
    let model = Gpt::with_factory(&cfg, &opts, &factory)?;
    let wanted: std::collections::HashSet<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut floats = Vec::new();
    for (name, (dt, shape, b)) in &tensors {
        if !wanted.contains(name) {
            continue;
        }
        if *dt != safetensors::Dtype::F32 {
            return Err(TuneError::Tensor {
                name: name.clone(),
                file: file.clone(),
                reason: format!("{dt:?}, expected F32"),
            });
        }
        floats.push((
            name.clone(),
            TensorData::new(kiln_state::DType::F32, shape.clone(), b.clone())?,
        ));
    }
    model.load_full_parameters(&floats)?;
    Ok(model)
}
