//! Splitting whole parameters into tensor-parallel shards and joining them back (for
//! initialisation from a dense model and for checkpoint resharding).

use crate::error::{ParallelError, Result};
use candle_core::Tensor;
use std::ops::Range;

/// How one parameter is split over the `tp` ranks of a tensor-parallel group.
///
/// Every split cuts a dimension into `tp` equal blocks and gives block `rank` to rank `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TpSplit {
    /// Every rank holds the whole tensor: LayerNorms, the position embedding and the bias of
    /// a row-parallel layer.
    Replicated,
    /// Split along dim 0: the weight `[out, in]` and bias `[out]` of a column-parallel layer
    /// (output features), and the rows `[vocab, d]` of a vocab-parallel embedding.
    Rows,
    /// Split along the last dim: the weight `[out, in]` of a row-parallel layer (input
    /// features).
    Cols,
    /// The fused query/key/value projection, weight `[3d, in]` or bias `[3d]` laid out
    /// `[q | k | v]`: each third is split along dim 0 and rank `r` holds `[q_r | k_r | v_r]`.
    /// When `tp` divides the number of heads, `q_r`, `k_r`, `v_r` are whole heads
    /// `r * h / tp .. (r + 1) * h / tp`, so attention runs locally on `h / tp` heads.
    Qkv,
    /// The fused gate and up projection of a SwiGLU MLP, weight `[2f, in]` laid out
    /// `[gate | up]`: each half is split along dim 0 and rank `r` holds `[gate_r | up_r]`, so
    /// the activation runs locally on `f / tp` units.
    GateUp,
}

fn check_group(tp: usize, rank: usize) -> Result<()> {
    if tp == 0 || rank >= tp {
        return Err(ParallelError::Config(format!(
            "tensor-parallel rank ({rank}) must be below the tensor-parallel degree ({tp}), which must be at least 1"
        )));
    }
    Ok(())
}

fn bad_shape(what: &str, expected: String, t: &Tensor) -> ParallelError {
    ParallelError::Param {
        name: what.to_string(),
        expected,
        got: format!("{:?}", t.dims()),
    }
}

/// A fresh contiguous copy of `t`, detached from any graph (a shard never keeps its source
/// alive).
fn owned(t: &Tensor) -> Result<Tensor> {
    Ok(t.force_contiguous()?.detach())
}

impl TpSplit {
    /// The dimension this split cuts, for a tensor of `rank` dimensions; `None` when
    /// replicated.
    fn dim(self, ndims: usize) -> Option<usize> {
        match self {
            TpSplit::Replicated => None,
            TpSplit::Rows | TpSplit::Qkv | TpSplit::GateUp => Some(0),
            TpSplit::Cols => Some(ndims.saturating_sub(1)),
        }
    }

    /// The number of fused parts each rank holds a slice of: 3 for [`TpSplit::Qkv`], 2 for
    /// [`TpSplit::GateUp`], 1 otherwise.
    pub fn parts(self) -> usize {
        match self {
            TpSplit::Qkv => 3,
            TpSplit::GateUp => 2,
            _ => 1,
        }
    }

    /// The number of equal blocks dim [`TpSplit::dim`] must divide into.
    fn blocks(self, tp: usize) -> usize {
        self.parts() * tp
    }

    /// The dimensions of one rank's shard of a tensor with dimensions `full`.
    pub fn local_dims(self, full: &[usize], tp: usize) -> Result<Vec<usize>> {
        check_group(tp, 0)?;
        let mut dims = full.to_vec();
        if let Some(d) = self.dim(full.len()) {
            let blocks = self.blocks(tp);
            match dims.get_mut(d) {
                Some(n) if *n > 0 && *n % blocks == 0 => *n /= tp,
                _ => {
                    return Err(ParallelError::Param {
                        name: format!("{self:?} split"),
                        expected: format!("a dim {d} that is a positive multiple of {blocks}"),
                        got: format!("{full:?}"),
                    })
                }
            }
        }
        Ok(dims)
    }

    /// Rank `rank`'s shard of the whole tensor `full`, as a fresh contiguous tensor.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use kiln_parallel::tp::TpSplit;
    /// // a [q | k | v] bias for d = 4: q = 0..4, k = 4..8, v = 8..12
    /// let b = Tensor::arange(0f32, 12., &Device::Cpu)?;
    /// let r1 = TpSplit::Qkv.shard(&b, 2, 1)?;
    /// assert_eq!(r1.to_vec1::<f32>()?, [2., 3., 6., 7., 10., 11.]);
    /// let r0 = TpSplit::Qkv.shard(&b, 2, 0)?;
    /// let back = TpSplit::Qkv.unshard(&[r0, r1])?;
    /// assert_eq!(back.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
    /// # Ok::<(), kiln_parallel::ParallelError>(())
    /// ```
    pub fn shard(self, full: &Tensor, tp: usize, rank: usize) -> Result<Tensor> {
        check_group(tp, rank)?;
        self.local_dims(full.dims(), tp)?;
        let Some(d) = self.dim(full.rank()) else {
            return owned(full);
        };
        let n = full.dim(d)? / self.blocks(tp);
        match self {
            TpSplit::Qkv | TpSplit::GateUp => {
                let parts = (0..self.parts())
                    .map(|i| full.narrow(0, (i * tp + rank) * n, n))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Tensor::cat(&parts, 0)?.detach())
            }
            _ => owned(&full.narrow(d, rank * n, n)?),
        }
    }

    /// Joins the shards of every rank (in rank order) back into the whole tensor: the inverse
    /// of [`TpSplit::shard`]. For [`TpSplit::Replicated`] the first shard is returned (every
    /// rank holds the same values).
    pub fn unshard(self, shards: &[Tensor]) -> Result<Tensor> {
        let Some(first) = shards.first() else {
            return Err(ParallelError::Param {
                name: format!("{self:?} unshard"),
                expected: "at least one shard".into(),
                got: "none".into(),
            });
        };
        if let Some(bad) = shards.iter().find(|s| s.dims() != first.dims()) {
            return Err(bad_shape(
                &format!("{self:?} unshard shard"),
                format!("{:?} as the first shard", first.dims()),
                bad,
            ));
        }
        let tp = shards.len();
        match (self, self.dim(first.rank())) {
            (_, None) => owned(first),
            (TpSplit::Qkv | TpSplit::GateUp, Some(_)) => {
                let (n0, k) = (first.dim(0)?, self.parts());
                if n0 % k != 0 {
                    return Err(bad_shape(
                        &format!("{self:?} unshard shard"),
                        format!("a dim 0 that is a multiple of {k}"),
                        first,
                    ));
                }
                let n = n0 / k;
                let mut parts = Vec::with_capacity(k * tp);
                for i in 0..k {
                    for s in shards {
                        parts.push(s.narrow(0, i * n, n)?);
                    }
                }
                Ok(Tensor::cat(&parts, 0)?.detach())
            }
            (_, Some(d)) => Ok(Tensor::cat(shards, d)?.detach()),
        }
    }
}

/// Rank `rank`'s shard of a column-parallel layer: rows `rank * out / tp ..` of the weight
/// `[out, in]` and of the bias `[out]`.
pub fn shard_column(
    weight: &Tensor,
    bias: Option<&Tensor>,
    tp: usize,
    rank: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let (out, _) = weight.dims2()?;
    check_bias(bias, out, "column-parallel bias")?;
    Ok((
        TpSplit::Rows.shard(weight, tp, rank)?,
        bias.map(|b| TpSplit::Rows.shard(b, tp, rank)).transpose()?,
    ))
}

/// Rank `rank`'s shard of a row-parallel layer: columns `rank * in / tp ..` of the weight
/// `[out, in]`; the bias `[out]` is replicated (added once, after the reduction).
pub fn shard_row(
    weight: &Tensor,
    bias: Option<&Tensor>,
    tp: usize,
    rank: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let (out, _) = weight.dims2()?;
    check_bias(bias, out, "row-parallel bias")?;
    Ok((
        TpSplit::Cols.shard(weight, tp, rank)?,
        bias.map(owned).transpose()?,
    ))
}

/// Rank `rank`'s shard of the fused QKV projection (weight `[3d, in]`, bias `[3d]`, output
/// `[q | k | v]` each `n_heads * head_dim = d` wide): the q, k and v rows of heads
/// `rank * n_heads / tp .. (rank + 1) * n_heads / tp`, laid out `[q_r | k_r | v_r]`.
/// `tp` must divide `n_heads`, and `n_heads` must divide `d`.
pub fn shard_qkv(
    weight: &Tensor,
    bias: Option<&Tensor>,
    n_heads: usize,
    tp: usize,
    rank: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    check_group(tp, rank)?;
    let (out, _) = weight.dims2()?;
    if out % 3 != 0 || n_heads == 0 || (out / 3) % n_heads != 0 || n_heads % tp != 0 {
        return Err(ParallelError::Config(format!(
            "fused qkv weight {:?}: 3 * d_model (d_model = n_heads x head_dim) rows are needed \
             with n_heads ({n_heads}) dividing d_model and tensor_parallel_degree ({tp}) dividing n_heads",
            weight.dims()
        )));
    }
    check_bias(bias, out, "qkv bias")?;
    Ok((
        TpSplit::Qkv.shard(weight, tp, rank)?,
        bias.map(|b| TpSplit::Qkv.shard(b, tp, rank)).transpose()?,
    ))
}

/// Rank `rank`'s rows of the token embedding `[vocab, d]` (see [`vocab_range`]).
pub fn shard_vocab(wte: &Tensor, tp: usize, rank: usize) -> Result<Tensor> {
    wte.dims2()?;
    TpSplit::Rows.shard(wte, tp, rank)
}

/// The token ids rank `rank` holds in a vocab-parallel embedding of `vocab` rows:
/// `rank * vocab / tp .. (rank + 1) * vocab / tp`. `tp` must divide `vocab`.
pub fn vocab_range(vocab: usize, tp: usize, rank: usize) -> Result<Range<usize>> {
    check_group(tp, rank)?;
    if vocab == 0 || vocab % tp != 0 {
        return Err(ParallelError::Config(format!(
            "tensor_parallel_degree ({tp}) must divide vocab_size ({vocab})"
        )));
    }
    let n = vocab / tp;
    Ok(rank * n..(rank + 1) * n)
}

fn check_bias(bias: Option<&Tensor>, out: usize, what: &str) -> Result<()> {
    match bias {
        Some(b) if b.dims() != [out] => Err(bad_shape(what, format!("[{out}]"), b)),
        _ => Ok(()),
    }
}
