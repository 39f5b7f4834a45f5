//! `FlatLayout`: the model's trainable parameters laid out in flat f32 units (buckets), and the
//! copies between candle tensors and those buffers.

use crate::error::{ParallelError, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor, Var};
use std::collections::HashMap;

/// DDP's default bucket size: 25 MB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// Where one parameter lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// Parameter name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Number of elements.
    pub numel: usize,
    /// The unit (bucket) holding it.
    pub unit: usize,
    /// Offset inside the unit.
    pub offset: usize,
    /// The segment that owns it: the first segment that lists it. Its gradient is complete once
    /// this segment's backward has run.
    pub owner: usize,
    /// How many segments use it (2 for a tied embedding).
    pub uses: usize,
}

/// A contiguous run of parameters communicated as one buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// Elements.
    pub len: usize,
    /// Indices into [`FlatLayout::params`].
    pub params: Vec<usize>,
    /// Gradient contributions that complete the unit in one backward (sum of the params' uses).
    pub contributions: usize,
}

/// The parameters of a segmented model in flat f32 units.
///
/// Units are built segment by segment in backward order (the head's parameters first), never
/// mixing segments, and split when they exceed the bucket size; so a unit is complete as soon as
/// its segment's backward is done and can be communicated while the segments below run (DDP's
/// bucketing). ZeRO shards every unit over the data-parallel group with
/// [`kiln_comm::chunk_range`].
#[derive(Debug, Clone)]
pub struct FlatLayout {
    params: Vec<ParamSlot>,
    units: Vec<Unit>,
    by_name: HashMap<String, usize>,
    /// Per segment, the parameters it uses, in its listing order.
    segment_params: Vec<Vec<usize>>,
}

impl FlatLayout {
    /// Lays out `segments` (per segment, the names and shapes of the parameters it uses; a name
    /// repeated in two segments is one tied parameter) in units of at most `bucket_elems`
    /// elements (a single larger parameter gets a unit of its own).
    pub fn new(segments: &[Vec<(String, Vec<usize>)>], bucket_elems: usize) -> Result<Self> {
        let mut params: Vec<ParamSlot> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut segment_params = Vec::with_capacity(segments.len());
        for (s, seg) in segments.iter().enumerate() {
            let mut mine = Vec::with_capacity(seg.len());
            for (name, shape) in seg {
                let numel = shape.iter().product();
                let idx = match by_name.get(name) {
                    Some(&i) => {
                        if params[i].shape != *shape {
                            return Err(ParallelError::Param {
                                name: name.clone(),
                                expected: format!(
                                    "shape {:?} (as listed by segment {})",
                                    params[i].shape, params[i].owner
                                ),
                                got: format!("shape {shape:?} in segment {s}"),
                            });
                        }
                        params[i].uses += 1;
                        i
                    }
                    None => {
                        params.push(ParamSlot {
                            name: name.clone(),
                            shape: shape.clone(),
                            numel,
                            unit: 0,
                            offset: 0,
                            owner: s,
                            uses: 1,
                        });
                        by_name.insert(name.clone(), params.len() - 1);
                        params.len() - 1
                    }
                };
                if mine.contains(&idx) {
                    return Err(ParallelError::Param {
                        name: name.clone(),
                        expected: "listed once per segment".into(),
                        got: format!("listed twice by segment {s}"),
                    });
                }
                mine.push(idx);
            }
            segment_params.push(mine);
        }
        let mut units: Vec<Unit> = Vec::new();
        for s in (0..segments.len()).rev() {
            let owned: Vec<usize> = segment_params[s]
                .iter()
                .copied()
                .filter(|&i| params[i].owner == s)
                .collect();
            let mut current: Option<Unit> = None;
            for i in owned {
                let numel = params[i].numel;
                if let Some(u) = current.as_ref() {
                    if u.len > 0 && u.len + numel > bucket_elems.max(1) {
                        units.extend(current.take());
                    }
                }
                let u = current.get_or_insert_with(|| Unit {
                    len: 0,
                    params: Vec::new(),
                    contributions: 0,
                });
                params[i].unit = units.len();
                params[i].offset = u.len;
                u.len += numel;
                u.params.push(i);
                u.contributions += params[i].uses;
            }
            units.extend(current);
        }
        Ok(Self {
            params,
            units,
            by_name,
            segment_params,
        })
    }

    /// Every parameter, in first-listed order.
    pub fn params(&self) -> &[ParamSlot] {
        &self.params
    }

    /// The units, in backward order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// The index of parameter `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The parameters segment `s` uses.
    pub fn segment_params(&self, s: usize) -> &[usize] {
        self.segment_params.get(s).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Number of segments.
    pub fn num_segments(&self) -> usize {
        self.segment_params.len()
    }

    /// Total elements.
    pub fn total_len(&self) -> usize {
        self.units.iter().map(|u| u.len).sum()
    }
}

/// Copies (or adds, when `accumulate`) the values of `t` into `dst`, reading candle's storage
/// directly when it is contiguous f32 (no intermediate `Vec`); other dtypes are widened.
pub fn tensor_into_slice(t: &Tensor, dst: &mut [f32], accumulate: bool, name: &str) -> Result<()> {
    if t.elem_count() != dst.len() {
        return Err(ParallelError::Param {
            name: name.to_string(),
            expected: format!("{} elements", dst.len()),
            got: format!("{} elements (shape {:?})", t.elem_count(), t.dims()),
        });
    }
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            copy_or_add(dst, &data[start..end], accumulate);
            return Ok(());
        }
    }
    let v = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if accumulate {
        for (d, s) in dst.iter_mut().zip(&v) {
            *d += *s;
        }
    } else {
        dst.copy_from_slice(&v);
    }
    Ok(())
}

/// `dst = src` (or `dst += src`) of equal-length slices, in blocks on candle's worker pool
/// when they are long: the flat buffers' copies are a step's largest serial memory passes.
fn copy_or_add(dst: &mut [f32], src: &[f32], accumulate: bool) {
    const BLOCK: usize = 1 << 16;
    kiln_kernels::pool::for_each_slot(&kiln_kernels::pool::slots(dst, BLOCK), BLOCK, |i, d| {
        // the callers checked the lengths equal
        let s = src.get(i * BLOCK..).unwrap_or_default();
        if accumulate {
            for (d, s) in d.iter_mut().zip(s) {
                *d += *s;
            }
        } else {
            for (d, s) in d.iter_mut().zip(s) {
                *d = *s;
            }
        }
    });
}

/// Writes `src` into a variable's storage in place (no new tensor, no reallocation), converting
/// to the variable's dtype.
struct WriteInPlace<'a>(&'a [f32]);

impl InplaceOp1 for WriteInPlace<'_> {
    fn name(&self) -> &'static str {
        "kiln-write-params"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("kiln-write-params: variable is not contiguous".into())
        })?;
        if end - start != self.0.len() {
            return Err(candle_core::Error::Msg(format!(
                "kiln-write-params: variable holds {} elements, got {}",
                end - start,
                self.0.len()
            )));
        }
        match storage {
            CpuStorage::F32(d) => copy_or_add(&mut d[start..end], self.0, false),
            CpuStorage::F64(d) => {
                for (d, s) in d[start..end].iter_mut().zip(self.0) {
                    *d = *s as f64;
                }
            }
            CpuStorage::F16(d) => {
                for (d, s) in d[start..end].iter_mut().zip(self.0) {
                    *d = half::f16::from_f32(*s);
                }
            }
            CpuStorage::BF16(d) => {
                for (d, s) in d[start..end].iter_mut().zip(self.0) {
                    *d = half::bf16::from_f32(*s);
                }
            }
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "kiln-write-params: unsupported variable dtype {:?}",
                    other.dtype()
                )))
            }
        }
        Ok(())
    }

    /// The host values copied into the device buffer (converted on the host first for f16 and
    /// bf16): one host-to-device copy of the variable.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("kiln-write-params: variable is not contiguous".into())
        })?;
        if end - start != self.0.len() {
            return Err(candle_core::Error::Msg(format!(
                "kiln-write-params: variable holds {} elements, got {}",
                end - start,
                self.0.len()
            )));
        }
        let dev = storage.device.clone();
        match &mut storage.slice {
            S::F32(d) => dev.memcpy_htod(self.0, &mut d.slice_mut(start..end)),
            S::F16(d) => {
                let h: Vec<half::f16> = self.0.iter().map(|&v| half::f16::from_f32(v)).collect();
                dev.memcpy_htod(&h, &mut d.slice_mut(start..end))
            }
            S::BF16(d) => {
                let h: Vec<half::bf16> = self.0.iter().map(|&v| half::bf16::from_f32(v)).collect();
                dev.memcpy_htod(&h, &mut d.slice_mut(start..end))
            }
            S::F64(d) => {
                let h: Vec<f64> = self.0.iter().map(|&v| v as f64).collect();
                dev.memcpy_htod(&h, &mut d.slice_mut(start..end))
            }
            _ => Err(candle_core::Error::Msg(
                "kiln-write-params: unsupported variable dtype".into(),
            )),
        }
    }
}

/// Writes `src` into `var` in place.
pub fn write_var(var: &Var, src: &[f32]) -> Result<()> {
    var.as_tensor().inplace_op1(&WriteInPlace(src))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn seg(list: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
        list.iter()
            .map(|(n, s)| (n.to_string(), s.to_vec()))
            .collect()
    }

    #[test]
    fn units_follow_backward_order_and_bucket_size() {
        let segments = vec![
            seg(&[("wte", &[10, 4]), ("wpe", &[8, 4])]),
            seg(&[("h0.w", &[4, 4]), ("h0.b", &[4])]),
            seg(&[("h1.w", &[4, 4]), ("h1.b", &[4])]),
            seg(&[("ln_f", &[4]), ("wte", &[10, 4])]),
        ];
        let l = FlatLayout::new(&segments, 16).unwrap();
        // head: ln_f only (wte is owned by segment 0), then h1 split at 16, h0, then embed
        let names: Vec<Vec<&str>> = l
            .units()
            .iter()
            .map(|u| {
                u.params
                    .iter()
                    .map(|&i| l.params()[i].name.as_str())
                    .collect()
            })
            .collect();
        assert_eq!(
            names,
            vec![
                vec!["ln_f"],
                vec!["h1.w"],
                vec!["h1.b"],
                vec!["h0.w"],
                vec!["h0.b"],
                vec!["wte"],
                vec!["wpe"]
            ]
        );
        let wte = &l.params()[l.index("wte").unwrap()];
        assert_eq!((wte.owner, wte.uses), (0, 2));
        assert_eq!(l.units()[5].contributions, 2);
        assert_eq!(l.total_len(), 40 + 32 + 20 + 20 + 4);
        assert_eq!(l.segment_params(3).len(), 2);
    }

    #[test]
    fn inconsistent_shapes_are_errors() {
        let segments = vec![seg(&[("wte", &[10, 4])]), seg(&[("wte", &[4, 10])])];
        let e = FlatLayout::new(&segments, 100).unwrap_err().to_string();
        assert!(
            e.contains("wte") && e.contains("[10, 4]") && e.contains("[4, 10]"),
            "{e}"
        );
    }

    #[test]
    fn copies_in_and_out_of_candle_storage() {
        let v = Var::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let mut buf = vec![10.0f32; 4];
        tensor_into_slice(v.as_tensor(), &mut buf, true, "v").unwrap();
        assert_eq!(buf, vec![11.0, 12.0, 13.0, 14.0]);
        // a transposed view goes through the slow path and still reads logical order
        tensor_into_slice(&v.as_tensor().t().unwrap(), &mut buf, false, "v").unwrap();
        assert_eq!(buf, vec![1.0, 3.0, 2.0, 4.0]);
        write_var(&v, &[5.0, 6.0, 7.0, 8.0]).unwrap();
        assert_eq!(
            v.as_tensor().to_vec2::<f32>().unwrap(),
            vec![vec![5.0, 6.0], vec![7.0, 8.0]]
        );
        assert!(write_var(&v, &[1.0]).is_err());
        assert!(tensor_into_slice(v.as_tensor(), &mut buf[..3], false, "v").is_err());
    }
}
