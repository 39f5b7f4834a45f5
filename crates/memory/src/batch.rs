//! [`MicroBatch`]: what one forward and backward of a segmented model consumes, as named
//! tensors.

use crate::error::{MemoryError, Result};
use candle_core::{DType, Device, Tensor};

/// One micro-batch: the model's inputs, its targets, an optional loss mask, and any other
/// per-example tensors an objective needs, by name (DPO's reference log-probabilities, a
/// reward model's labels).
///
/// The [`Executor`](crate::Executor) hands the inputs to the first segment and the whole
/// micro-batch to every segment; the last one reads what its loss needs. Every tensor's first
/// dimension is the example (row) dimension, checked when a tensor is added.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_memory::MicroBatch;
/// let x = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
/// let y = Tensor::new(&[[2u32, 3, 4], [5, 6, 7]], &Device::Cpu)?;
/// // the loss counts the last two positions of each row only
/// let mask = Tensor::new(&[[0u8, 1, 1], [0, 1, 1]], &Device::Cpu)?;
/// let b = MicroBatch::new(x, y)?
///     .with_loss_mask(mask)?
///     .with("weight", Tensor::new(&[1f32, 0.5], &Device::Cpu)?)?;
/// assert_eq!(b.rows(), 2);
/// assert_eq!(b.require("weight")?.to_vec1::<f32>()?, [1.0, 0.5]);
/// assert!(b.get("labels").is_none());
/// # Ok::<(), kiln_memory::MemoryError>(())
/// ```
#[derive(Debug, Clone)]
pub struct MicroBatch {
    inputs: Tensor,
    targets: Tensor,
    loss_mask: Option<Tensor>,
    extra: Vec<(String, Tensor)>,
}

impl MicroBatch {
    /// Inputs and targets with the same number of rows (the first dimension).
    pub fn new(inputs: Tensor, targets: Tensor) -> Result<Self> {
        let rows = first_dim(&inputs, "inputs")?;
        let b = MicroBatch {
            inputs,
            targets,
            loss_mask: None,
            extra: Vec::new(),
        };
        b.check_rows("targets", &b.targets, rows)?;
        Ok(b)
    }

    /// Adds a loss mask of the targets' shape (u8 or u32): the loss counts the positions where
    /// it is not zero.
    pub fn with_loss_mask(mut self, mask: Tensor) -> Result<Self> {
        if mask.dims() != self.targets.dims() {
            return Err(MemoryError::Batch {
                tensor: "loss_mask".into(),
                expected: format!("the targets' shape {:?}", self.targets.dims()),
                got: format!("{:?}", mask.dims()),
            });
        }
        if !matches!(mask.dtype(), DType::U8 | DType::U32) {
            return Err(MemoryError::Batch {
                tensor: "loss_mask".into(),
                expected: "dtype u8 or u32".into(),
                got: format!("{:?}", mask.dtype()),
            });
        }
        self.loss_mask = Some(mask);
        Ok(self)
    }

    /// Adds the per-example tensor `name` (its first dimension is the rows). A name already
    /// present, or one of `inputs`, `targets` and `loss_mask`, is an error.
    pub fn with(mut self, name: impl Into<String>, tensor: Tensor) -> Result<Self> {
        let name = name.into();
        if matches!(name.as_str(), "inputs" | "targets" | "loss_mask") || self.get(&name).is_some()
        {
            return Err(MemoryError::Batch {
                tensor: name,
                expected: "a name not yet in the micro-batch".into(),
                got: "a second tensor of that name".into(),
            });
        }
        self.check_rows(&name, &tensor, self.rows())?;
        self.extra.push((name, tensor));
        Ok(self)
    }

    /// The model's inputs (for a language model, token ids `[rows, t]`).
    pub fn inputs(&self) -> &Tensor {
        &self.inputs
    }

    /// The targets (for a language model, the next token ids `[rows, t]`).
    pub fn targets(&self) -> &Tensor {
        &self.targets
    }

    /// The loss mask, when one was given.
    pub fn loss_mask(&self) -> Option<&Tensor> {
        self.loss_mask.as_ref()
    }

    /// The targets with every masked position (loss mask zero) replaced by `ignore`: what a
    /// cross-entropy that leaves out the targets equal to `ignore` needs. Without a mask, the
    /// targets as they are.
    pub fn masked_targets(&self, ignore: u32) -> Result<Tensor> {
        let Some(mask) = &self.loss_mask else {
            return Ok(self.targets.clone());
        };
        let fill = Tensor::full(ignore, self.targets.shape(), self.targets.device())?
            .to_dtype(self.targets.dtype())?;
        Ok(mask.ne(0u32)?.where_cond(&self.targets, &fill)?)
    }

    /// The per-example tensor `name`, if present.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.extra.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The per-example tensor `name`; its absence is an error naming it.
    pub fn require(&self, name: &str) -> Result<&Tensor> {
        self.get(name).ok_or_else(|| MemoryError::Batch {
            tensor: name.into(),
            expected: "present in the micro-batch".into(),
            got: format!(
                "only {}",
                std::iter::once("inputs, targets")
                    .chain(self.loss_mask.as_ref().map(|_| "loss_mask"))
                    .chain(self.extra.iter().map(|(n, _)| n.as_str()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }

    /// The names of the per-example tensors, in the order they were added.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.extra.iter().map(|(n, _)| n.as_str())
    }

    /// Number of examples (rows).
    pub fn rows(&self) -> usize {
        self.inputs.dims().first().copied().unwrap_or(0)
    }

    /// Every tensor copied to `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(MicroBatch {
            inputs: self.inputs.to_device(device)?,
            targets: self.targets.to_device(device)?,
            loss_mask: self
                .loss_mask
                .as_ref()
                .map(|m| m.to_device(device))
                .transpose()?,
            extra: self
                .extra
                .iter()
                .map(|(n, t)| Ok((n.clone(), t.to_device(device)?)))
                .collect::<Result<_>>()?,
        })
    }

    fn check_rows(&self, name: &str, t: &Tensor, rows: usize) -> Result<()> {
        let got = first_dim(t, name)?;
        if got != rows {
            return Err(MemoryError::Batch {
                tensor: name.into(),
                expected: format!("{rows} rows, as the inputs"),
                got: format!("{got} rows (shape {:?})", t.dims()),
            });
        }
        Ok(())
    }
}

fn first_dim(t: &Tensor, name: &str) -> Result<usize> {
    t.dims().first().copied().ok_or_else(|| MemoryError::Batch {
        tensor: name.into(),
        expected: "a first (row) dimension".into(),
        got: "a scalar".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[[u32; 3]]) -> Tensor {
        let flat: Vec<u32> = v.iter().flatten().copied().collect();
        Tensor::from_vec(flat, (v.len(), 3), &Device::Cpu).unwrap()
    }

    #[test]
    fn masked_targets_replace_exactly_the_masked_positions() {
        let y = t(&[[5, 6, 7], [8, 9, 10]]);
        let b = MicroBatch::new(t(&[[1, 2, 3], [4, 5, 6]]), y.clone()).unwrap();
        // no mask: the targets themselves
        assert_eq!(
            b.masked_targets(u32::MAX)
                .unwrap()
                .to_vec2::<u32>()
                .unwrap(),
            y.to_vec2::<u32>().unwrap()
        );
        let mask = Tensor::new(&[[0u8, 1, 1], [1, 0, 1]], &Device::Cpu).unwrap();
        let b = b.with_loss_mask(mask).unwrap();
        assert_eq!(
            b.masked_targets(u32::MAX)
                .unwrap()
                .to_vec2::<u32>()
                .unwrap(),
            [[u32::MAX, 6, 7], [8, u32::MAX, 10]]
        );
    }

    #[test]
    fn bad_tensors_are_errors_naming_them() {
        let x = t(&[[1, 2, 3], [4, 5, 6]]);
        let e = MicroBatch::new(x.clone(), t(&[[1, 2, 3]])).unwrap_err();
        assert!(
            e.to_string().contains("targets") && e.to_string().contains("2 rows"),
            "{e}"
        );
        let b = MicroBatch::new(x.clone(), x.clone()).unwrap();
        let e = b
            .clone()
            .with_loss_mask(Tensor::new(&[1u8, 1], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("loss_mask"), "{e}");
        let e = b
            .clone()
            .with_loss_mask(x.to_dtype(DType::F32).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("u8 or u32"), "{e}");
        let e = b
            .clone()
            .with("w", Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(
            e.to_string().contains("`w`") && e.to_string().contains("3 rows"),
            "{e}"
        );
        let b = b
            .with("w", Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap())
            .unwrap();
        let e = b
            .clone()
            .with("w", Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("second tensor"), "{e}");
        let e = b.require("labels").unwrap_err();
        assert!(
            e.to_string().contains("`labels`") && e.to_string().contains("inputs, targets, w"),
            "{e}"
        );
        assert_eq!(b.names().collect::<Vec<_>>(), ["w"]);
    }
}
