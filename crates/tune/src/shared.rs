//! [`Shared`]: a layer the model owns as a box while its factory keeps a handle to it, so the
//! handle ([`crate::Lora`], [`crate::Qat`]) reaches the layers after the model is built.

use candle_core::{Tensor, Var};
use kiln_model::{LinearLayer, ParamSource};
use kiln_optim::ParamKind;
use kiln_parallel::tp::TpSplit;
use std::sync::Arc;

/// Delegates every [`LinearLayer`] method to the shared layer.
#[derive(Debug)]
pub(crate) struct Shared<T: LinearLayer>(pub(crate) Arc<T>);

impl<T: LinearLayer> LinearLayer for Shared<T> {
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> kiln_model::Result<Tensor> {
        self.0.forward_with(x, params)
    }
    fn forward_gelu_with(
        &self,
        x: &Tensor,
        params: &dyn ParamSource,
    ) -> kiln_model::Result<Tensor> {
        self.0.forward_gelu_with(x, params)
    }
    fn parameters(&self) -> Vec<(String, Var)> {
        self.0.parameters()
    }
    fn local_out_features(&self) -> usize {
        self.0.local_out_features()
    }
    fn param_splits(&self) -> Option<Vec<(String, TpSplit)>> {
        self.0.param_splits()
    }
    fn param_kinds(&self) -> Option<Vec<(String, ParamKind)>> {
        self.0.param_kinds()
    }
}
