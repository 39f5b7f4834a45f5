//! [`ParamSource`]: where a layer reads its weights from on a given call.
//!
//! The model's layers own named `Var`s, but a call may take them from elsewhere: kiln-memory's
//! segmented executor hands each segment the parameters its provider supplies (ZeRO-3 gathers
//! them from the shards just before the segment runs and drops them after). Every forward has a
//! `_with` form reading its weights by name from a source; the plain forms use the layer's own.

use crate::error::{ModelError, Result};
use candle_core::{Tensor, Var};

/// Named parameters for one call.
pub trait ParamSource {
    /// The parameter called `name`.
    fn param(&self, name: &str) -> Result<Tensor>;
}

fn missing(name: &str) -> ModelError {
    ModelError::MissingParameter {
        name: name.to_string(),
    }
}

impl ParamSource for Vec<(String, Var)> {
    fn param(&self, name: &str) -> Result<Tensor> {
        self.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor().clone())
            .ok_or_else(|| missing(name))
    }
}

impl ParamSource for kiln_memory::SegmentParams {
    fn param(&self, name: &str) -> Result<Tensor> {
        self.vars()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor().clone())
            .ok_or_else(|| missing(name))
    }
}
