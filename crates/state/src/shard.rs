//! Which part of a global tensor one rank holds: a slice along one dimension (tensor
//! parallel) or a flat range of the row-major flattened tensor (ZeRO's flat buffers).

use crate::error::{Result, StateError};
use crate::tensor::numel;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A slice `start..start + len` along dimension `dim` of a tensor of shape `global_shape`.
///
/// Tensor parallelism splits column-parallel weights along dim 0 and row-parallel weights
/// along dim 1. The local tensor's shape is `global_shape` with `dim` replaced by `len`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardSpec {
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// The split dimension.
    pub dim: usize,
    /// First index held along `dim`.
    pub start: usize,
    /// Number of indices held along `dim`.
    pub len: usize,
}

/// Elements `start..start + len` of the row-major flattening of a tensor of shape
/// `global_shape`, as ZeRO shards its flat parameter and optimizer buffers (rank `r` of `n`
/// holding [`chunk_range`]`(numel, n, r)`). The local tensor's shape is `[len]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FlatShard {
    /// Shape of the whole tensor (`[n]` for a flat buffer).
    pub global_shape: Vec<usize>,
    /// First element held.
    pub start: usize,
    /// Number of elements held.
    pub len: usize,
}

/// The chunking rule for `reduce_scatter` and `all_gather` over `world` ranks.
///
/// A logical buffer of `len` elements is cut into `world` contiguous chunks in rank order; the
/// first `len % world` ranks get one element more than the others
/// (`len / world + 1`, then `len / world`). Rank `r`'s chunk is `chunk_range(len, world, r)`.
/// The same rule serves ZeRO's parameter and optimizer shards ([`Shard::flat_chunk`]), and
/// kiln-comm's `reduce_scatter` and `all_gather` re-export it.
///
/// ```
/// use kiln_state::chunk_range;
/// assert_eq!(chunk_range(7, 3, 0), 0..3);
/// assert_eq!(chunk_range(7, 3, 1), 3..5);
/// assert_eq!(chunk_range(7, 3, 2), 5..7);
/// assert_eq!(chunk_range(2, 4, 3), 2..2);
/// ```
pub fn chunk_range(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    if world == 0 {
        return 0..0;
    }
    let base = len / world;
    let extra = len % world;
    let start = |r: usize| r * base + r.min(extra);
    let r = rank.min(world);
    start(r)..start((r + 1).min(world))
}

/// How a rank's tensor relates to the global tensor it is part of.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Shard {
    /// A slice along one dimension.
    Dim(ShardSpec),
    /// A range of the flattened tensor.
    Flat(FlatShard),
}

impl Shard {
    /// A slice `start..start + len` along `dim`.
    pub fn dim(global_shape: &[usize], dim: usize, start: usize, len: usize) -> Shard {
        Shard::Dim(ShardSpec {
            global_shape: global_shape.to_vec(),
            dim,
            start,
            len,
        })
    }

    /// Elements `start..start + len` of the flattened tensor.
    pub fn flat(global_shape: &[usize], start: usize, len: usize) -> Shard {
        Shard::Flat(FlatShard {
            global_shape: global_shape.to_vec(),
            start,
            len,
        })
    }

    /// Part `index` of `parts` equal slices along `dim`, as tensor parallelism splits; fails
    /// with [`StateError::NotDivisible`] unless `parts` divides the dimension.
    pub fn dim_chunk(
        global_shape: &[usize],
        dim: usize,
        parts: usize,
        index: usize,
    ) -> Result<Shard> {
        let Some(&size) = global_shape.get(dim) else {
            return Err(StateError::BadShard {
                name: String::new(),
                reason: format!("dim {dim} out of range for shape {global_shape:?}"),
            });
        };
        if parts == 0 || size % parts != 0 {
            return Err(StateError::NotDivisible {
                name: String::new(),
                dim,
                size,
                factor: parts,
            });
        }
        if index >= parts {
            return Err(StateError::BadShard {
                name: String::new(),
                reason: format!("part {index} of {parts} does not exist"),
            });
        }
        let len = size / parts;
        Ok(Shard::dim(global_shape, dim, index * len, len))
    }

    /// Part `index` of `parts` of the flattened tensor under [`chunk_range`]
    /// (uneven sizes allowed, as ZeRO shards).
    pub fn flat_chunk(global_shape: &[usize], parts: usize, index: usize) -> Result<Shard> {
        let n = numel(global_shape).ok_or_else(|| StateError::BadShard {
            name: String::new(),
            reason: format!("shape {global_shape:?} overflows"),
        })?;
        if parts == 0 || index >= parts {
            return Err(StateError::BadShard {
                name: String::new(),
                reason: format!("part {index} of {parts} does not exist"),
            });
        }
        let r = chunk_range(n, parts, index);
        Ok(Shard::flat(global_shape, r.start, r.len()))
    }

    /// Shape of the whole tensor.
    pub fn global_shape(&self) -> &[usize] {
        match self {
            Shard::Dim(s) => &s.global_shape,
            Shard::Flat(s) => &s.global_shape,
        }
    }

    /// Shape of the part a rank holds.
    pub fn local_shape(&self) -> Vec<usize> {
        match self {
            Shard::Dim(s) => {
                let mut shape = s.global_shape.clone();
                if let Some(d) = shape.get_mut(s.dim) {
                    *d = s.len;
                }
                shape
            }
            Shard::Flat(s) => vec![s.len],
        }
    }

    /// Checks that the slice lies inside the global tensor.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(StateError::BadShard {
                name: String::new(),
                reason,
            })
        };
        let Some(total) = numel(self.global_shape()) else {
            return bad(format!("global shape {:?} overflows", self.global_shape()));
        };
        match self {
            Shard::Dim(s) => {
                let Some(&size) = s.global_shape.get(s.dim) else {
                    return bad(format!(
                        "dim {} out of range for shape {:?}",
                        s.dim, s.global_shape
                    ));
                };
                if s.start.checked_add(s.len).is_none_or(|end| end > size) {
                    return bad(format!(
                        "slice {}..{}+{} exceeds dim {} of size {size}",
                        s.start, s.start, s.len, s.dim
                    ));
                }
            }
            Shard::Flat(s) => {
                if s.start.checked_add(s.len).is_none_or(|end| end > total) {
                    return bad(format!(
                        "flat range {}..{}+{} exceeds {total} elements",
                        s.start, s.start, s.len
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks that the slice lies inside the global tensor and that a local tensor of shape
    /// `local` fits it.
    pub fn validate_local(&self, local: &[usize]) -> Result<()> {
        self.validate()?;
        let expected = self.local_shape();
        if expected != local {
            return Err(StateError::BadShard {
                name: String::new(),
                reason: format!("local shape {local:?} but the shard {self} holds {expected:?}"),
            });
        }
        Ok(())
    }

    /// The element runs of the row-major flattened global tensor this shard covers, as
    /// `(global start, length)` in increasing order, adjacent runs merged. The shard must be
    /// valid ([`Shard::validate`]).
    pub fn runs(&self) -> Vec<(usize, usize)> {
        match self {
            Shard::Flat(s) => {
                if s.len == 0 {
                    Vec::new()
                } else {
                    vec![(s.start, s.len)]
                }
            }
            Shard::Dim(s) => {
                let g = &s.global_shape;
                let outer: usize = g[..s.dim].iter().product();
                let inner: usize = g[s.dim + 1..].iter().product();
                let size = g[s.dim];
                dim_runs(outer, size, inner, s.start, s.len)
            }
        }
    }
}

/// Runs of a dim-slice: `outer` blocks of `size * inner` elements, each contributing
/// `len * inner` elements at offset `start * inner`.
pub fn dim_runs(
    outer: usize,
    size: usize,
    inner: usize,
    start: usize,
    len: usize,
) -> Vec<(usize, usize)> {
    let run = len * inner;
    let mut out: Vec<(usize, usize)> = Vec::new();
    if run == 0 {
        return out;
    }
    for o in 0..outer {
        let s = o * size * inner + start * inner;
        match out.last_mut() {
            Some(last) if last.0 + last.1 == s => last.1 += run,
            _ => out.push((s, run)),
        }
    }
    out
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shard::Dim(s) => write!(
                f,
                "dim {} [{}..{}] of {:?}",
                s.dim,
                s.start,
                s.start.saturating_add(s.len),
                s.global_shape
            ),
            Shard::Flat(s) => write!(
                f,
                "flat [{}..{}] of {:?}",
                s.start,
                s.start.saturating_add(s.len),
                s.global_shape
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: enumerate every multi-index and keep those inside the slice.
    fn runs_by_enumeration(g: &[usize], dim: usize, start: usize, len: usize) -> Vec<usize> {
        let n: usize = g.iter().product();
        let mut out = Vec::new();
        for flat in 0..n {
            let mut rem = flat;
            let mut idx = vec![0; g.len()];
            for d in (0..g.len()).rev() {
                idx[d] = rem % g[d];
                rem /= g[d];
            }
            if idx[dim] >= start && idx[dim] < start + len {
                out.push(flat);
            }
        }
        out
    }

    #[test]
    fn dim_runs_match_enumeration() {
        for g in [vec![4usize, 6], vec![3, 4, 5], vec![6], vec![2, 1, 3]] {
            for dim in 0..g.len() {
                for start in 0..g[dim] {
                    for len in 0..=g[dim] - start {
                        let s = Shard::dim(&g, dim, start, len);
                        s.validate().unwrap();
                        let got: Vec<usize> =
                            s.runs().into_iter().flat_map(|(a, l)| a..a + l).collect();
                        assert_eq!(got, runs_by_enumeration(&g, dim, start, len), "{s}");
                        let local: usize = s.local_shape().iter().product();
                        assert_eq!(local, got.len());
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_and_errors() {
        assert_eq!(
            Shard::dim_chunk(&[8, 6], 1, 3, 2).unwrap(),
            Shard::dim(&[8, 6], 1, 4, 2)
        );
        let e = Shard::dim_chunk(&[6, 6], 0, 4, 0).unwrap_err();
        assert_eq!(
            e.named("model/w").to_string(),
            "cannot reshard tensor model/w: dim 0 of size 6 is not divisible by 4"
        );
        assert_eq!(
            Shard::flat_chunk(&[7], 3, 1).unwrap(),
            Shard::flat(&[7], 3, 2)
        );
        assert!(Shard::dim(&[4], 1, 0, 1).validate().is_err());
        assert!(Shard::dim(&[4], 0, 3, 2).validate().is_err());
        assert!(Shard::dim(&[4], 0, usize::MAX, 2).validate().is_err());
        assert!(Shard::flat(&[4, 2], 6, 3).validate().is_err());
        assert!(Shard::flat(&[usize::MAX, 2], 0, 1).validate().is_err());
        assert!(Shard::dim(&[4, 2], 0, 1, 2).validate_local(&[2, 2]).is_ok());
        assert!(Shard::dim(&[4, 2], 0, 1, 2)
            .validate_local(&[2, 1])
            .is_err());
    }

    #[test]
    fn serde_form() {
        let s = Shard::flat(&[10], 3, 4);
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(
            j,
            r#"{"kind":"flat","global_shape":[10],"start":3,"len":4}"#
        );
        let back: Shard = serde_json::from_str(&j).unwrap();
        assert_eq!(back, s);
    }
}
