//! Mixed precision for kiln: the precision policy, the f32 <-> f16/bf16 casts, and loss scaling
//! with torch.amp.GradScaler's semantics.
//!
//! - [`Precision`] / [`ComputeDType`]: compute in f32, f16 or bf16; master weights are always
//!   f32. [`cast_to_compute`] and [`cast_to_master`] convert slices (round to nearest even).
//! - [`LossScaler`]: `scale`, `unscale_and_check` (one fused pass: unscale and detect inf/NaN),
//!   `update(found_inf) -> ScaleEvent`, and `scaler_state`/`load_scaler_state` through the
//!   serde [`ScalerState`]; every scaler (and `dyn LossScaler`) is a kiln-state `Stateful`. [`ScaleEvent::skipped_step`] tells callers that the optimizer step was
//!   skipped (the LR schedule must not advance).
//! - [`DynamicLossScaler`]: GradScaler's defaults and rules, plus DeepSpeed's hysteresis, a
//!   minimum scale ([`PrecisionError::ScaleUnderflow`]) and a maximum. [`StaticLossScaler`]
//!   and [`NoScaler`] for a fixed scale and for f32/bf16.
//! - [`all_reduce_found_inf`] / [`LossScaler::unscale_and_check_global`]: the flag is
//!   all-reduced with MAX so that every rank skips the same steps.
//!
//! ```
//! use kiln_precision::{DynamicLossScaler, LossScaler, ScaleEvent};
//!
//! let mut scaler = DynamicLossScaler::default(); // scale 65536
//! // gradients of the scaled loss: unscale them and look for inf/NaN in one pass
//! let mut grads = vec![65536.0f32, -32768.0, 16384.0];
//! let found_inf = scaler.unscale_and_check(&mut grads);
//! assert_eq!((found_inf, grads.clone()), (false, vec![1.0, -0.5, 0.25]));
//! assert_eq!(scaler.update(found_inf)?, ScaleEvent::Stepped);
//! // an overflow: the step is skipped and the scale halves
//! grads[1] = f32::INFINITY;
//! let event = scaler.update(scaler.unscale_and_check(&mut grads))?;
//! assert!(event.skipped_step());
//! assert_eq!((event, scaler.scale()), (ScaleEvent::BackedOff, 32768.0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod check;
mod dynamic;
mod error;
mod policy;
mod scaler;
mod stateful;

pub use check::{all_reduce_found_inf, has_non_finite, unscale_and_check, unscale_and_check_from};
pub use dynamic::{DynamicLossScaler, DynamicScalerConfig};
pub use error::{PrecisionError, Result};
pub use policy::{
    cast_to_compute, cast_to_master, round_to_compute, ComputeDType, ComputeElem, Precision,
};
pub use scaler::{LossScaler, NoScaler, ScaleEvent, ScalerState, StaticLossScaler};
