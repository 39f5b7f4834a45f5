//! [`Want`]: which slice of a global tensor a rank asks a checkpoint for.

use crate::error::{Result, StateError};
use crate::shard::Shard;

/// Which slice of a global tensor a rank wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    /// The whole tensor.
    Full,
    /// Part `index` of `parts` equal slices along `dim` (tensor parallel: dim 0 for
    /// column-parallel weights, dim 1 for row-parallel ones); the dimension must be
    /// divisible by `parts` ([`StateError::NotDivisible`] otherwise).
    DimChunk {
        /// The split dimension.
        dim: usize,
        /// Number of slices.
        parts: usize,
        /// Which slice.
        index: usize,
    },
    /// Part `index` of `parts` of the flattened tensor under [`crate::chunk_range`]
    /// (ZeRO's flat shards; uneven sizes allowed).
    FlatChunk {
        /// Number of chunks.
        parts: usize,
        /// Which chunk.
        index: usize,
    },
    /// An explicit slice (its global shape must be the tensor's).
    Slice(Shard),
}

impl Want {
    /// The region of a tensor of `global_shape` this asks for (`None` for the whole tensor).
    pub fn resolve(&self, name: &str, global_shape: &[usize]) -> Result<Option<Shard>> {
        let named = |e: StateError| e.named(name);
        let s = match self {
            Want::Full => return Ok(None),
            Want::DimChunk { dim, parts, index } => {
                Shard::dim_chunk(global_shape, *dim, *parts, *index).map_err(named)?
            }
            Want::FlatChunk { parts, index } => {
                Shard::flat_chunk(global_shape, *parts, *index).map_err(named)?
            }
            Want::Slice(s) => {
                if s.global_shape() != global_shape {
                    return Err(StateError::BadShard {
                        name: name.to_string(),
                        reason: format!(
                            "requested slice {s} but the tensor's global shape is {global_shape:?}"
                        ),
                    });
                }
                s.validate().map_err(named)?;
                s.clone()
            }
        };
        Ok(Some(s))
    }
}
