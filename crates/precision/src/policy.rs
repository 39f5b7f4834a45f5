//! The precision policy: which dtype the forward and backward passes compute in, with master
//! weights always kept in f32, and the casts between the two.

use crate::dynamic::DynamicLossScaler;
use crate::error::{PrecisionError, Result};
use crate::scaler::{LossScaler, NoScaler};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The floating-point type of the forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ComputeDType {
    /// IEEE single precision: no mixed precision at all.
    F32,
    /// IEEE half precision (5-bit exponent): needs loss scaling, gradients underflow without it.
    F16,
    /// bfloat16 (f32's 8-bit exponent, 8-bit significand): no loss scaling needed.
    BF16,
}

impl ComputeDType {
    /// Lowercase name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            ComputeDType::F32 => "f32",
            ComputeDType::F16 => "f16",
            ComputeDType::BF16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            ComputeDType::F32 => 4,
            ComputeDType::F16 | ComputeDType::BF16 => 2,
        }
    }
}

impl fmt::Display for ComputeDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ComputeDType {
    type Err = PrecisionError;

    /// Parses `f32`/`fp32`/`float32`, `f16`/`fp16`/`half`/`float16`, `bf16`/`bfloat16`
    /// (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(ComputeDType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(ComputeDType::F16),
            "bf16" | "bfloat16" => Ok(ComputeDType::BF16),
            _ => Err(PrecisionError::UnknownDType { got: s.to_string() }),
        }
    }
}

/// A mixed-precision policy: parameters are cast to [`Precision::compute`] for the forward and
/// backward passes, gradients are cast back to f32, and the optimizer updates f32 master
/// weights. Only f16 needs a loss scaler ([`Precision::needs_loss_scaling`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Precision {
    compute: ComputeDType,
}

impl Precision {
    /// Everything in f32.
    pub const F32: Precision = Precision {
        compute: ComputeDType::F32,
    };
    /// f16 compute, f32 master weights, dynamic loss scaling.
    pub const F16: Precision = Precision {
        compute: ComputeDType::F16,
    };
    /// bf16 compute, f32 master weights, no loss scaling.
    pub const BF16: Precision = Precision {
        compute: ComputeDType::BF16,
    };

    /// The policy computing in `compute`.
    pub fn new(compute: ComputeDType) -> Self {
        Precision { compute }
    }

    /// The dtype of the forward and backward passes.
    pub fn compute(&self) -> ComputeDType {
        self.compute
    }

    /// True when compute differs from the f32 master weights.
    pub fn is_mixed(&self) -> bool {
        self.compute != ComputeDType::F32
    }

    /// True for f16, whose gradients underflow without a loss scale.
    pub fn needs_loss_scaling(&self) -> bool {
        self.compute == ComputeDType::F16
    }

    /// The scaler this policy calls for: a default [`DynamicLossScaler`] for f16 (torch
    /// GradScaler's defaults), [`NoScaler`] otherwise.
    pub fn default_scaler(&self) -> Box<dyn LossScaler> {
        if self.needs_loss_scaling() {
            Box::new(DynamicLossScaler::default())
        } else {
            Box::new(NoScaler)
        }
    }
}

impl Default for Precision {
    fn default() -> Self {
        Precision::F32
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type of the compute pass: f32, [`half::f16`] or [`half::bf16`] (sealed).
///
/// Conversions from f32 round to nearest, ties to even; NaN stays NaN and values beyond the
/// target's range become infinities (f16 overflows above 65504).
pub trait ComputeElem: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtype tag.
    const DTYPE: ComputeDType;
    /// Converts a whole slice from f32; lengths are equal.
    #[doc(hidden)]
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
    /// Converts a whole slice to f32 (exact); lengths are equal.
    #[doc(hidden)]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// Converts one value to f32 (exact).
    fn to_f32(self) -> f32;
}

impl ComputeElem for f32 {
    const DTYPE: ComputeDType = ComputeDType::F32;
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl ComputeElem for f16 {
    const DTYPE: ComputeDType = ComputeDType::F16;
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl ComputeElem for bf16 {
    const DTYPE: ComputeDType = ComputeDType::BF16;
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

fn check_len(op: &'static str, what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(PrecisionError::LengthMismatch {
            op,
            what,
            expected,
            got,
        })
    }
}

/// Casts f32 master values (parameters) to the compute type for the forward pass, rounding to
/// nearest even. `out` must have the length of `master`.
pub fn cast_to_compute<T: ComputeElem>(master: &[f32], out: &mut [T]) -> Result<()> {
    check_len("cast_to_compute", "output", master.len(), out.len())?;
    T::from_f32_slice(master, out);
    Ok(())
}

/// Casts compute-type values (gradients) back to f32, exactly. `out` must have the length of
/// `compute`.
pub fn cast_to_master<T: ComputeElem>(compute: &[T], out: &mut [f32]) -> Result<()> {
    check_len("cast_to_master", "output", compute.len(), out.len())?;
    T::to_f32_slice(compute, out);
    Ok(())
}

/// Rounds f32 values in place to the nearest value representable in `dtype` (what a round trip
/// through the compute type does), without a second buffer.
pub fn round_to_compute(dtype: ComputeDType, values: &mut [f32]) {
    match dtype {
        ComputeDType::F32 => {}
        ComputeDType::F16 => values
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(*x).to_f32()),
        ComputeDType::BF16 => values
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(*x).to_f32()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names() {
        assert_eq!("BF16".parse::<ComputeDType>().unwrap(), ComputeDType::BF16);
        assert_eq!("fp16".parse::<ComputeDType>().unwrap(), ComputeDType::F16);
        assert_eq!(
            "float32".parse::<ComputeDType>().unwrap(),
            ComputeDType::F32
        );
        let e = "f8".parse::<ComputeDType>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown compute dtype `f8`: expected f32, f16 or bf16"
        );
    }

    #[test]
    fn policy_flags() {
        assert!(Precision::F16.needs_loss_scaling());
        assert!(!Precision::BF16.needs_loss_scaling());
        assert!(Precision::BF16.is_mixed() && !Precision::F32.is_mixed());
        assert_eq!(Precision::F16.default_scaler().scale(), 65536.0);
        assert_eq!(Precision::BF16.default_scaler().scale(), 1.0);
        assert_eq!(ComputeDType::BF16.size_in_bytes(), 2);
    }

    /// Round to nearest even at `keep` significand bits computed with integer arithmetic on the
    /// f32 bits (normal numbers only): the reference for the bf16 cast.
    fn rne_bits(x: f32, drop: u32) -> f32 {
        let b = x.to_bits();
        let half = 1u32 << (drop - 1);
        let rem = b & ((1 << drop) - 1);
        let mut t = b >> drop;
        if rem > half || (rem == half && t & 1 == 1) {
            t += 1;
        }
        f32::from_bits(t << drop)
    }

    #[test]
    fn bf16_cast_rounds_to_nearest_even() {
        let eps = 2f32.powi(-7); // bf16 ulp at 1.0
        let xs = [
            1.0,
            1.0 + eps / 2.0,       // tie, rounds down to even 1.0
            1.0 + 3.0 * eps / 2.0, // tie, rounds up to even 1 + 2 eps
            1.0 + eps / 2.0 + 2f32.powi(-20),
            -2.71875e5,
            1.0e-3,
            65504.0,
            3.0e38,
        ];
        let mut out = vec![bf16::ZERO; xs.len()];
        cast_to_compute(&xs, &mut out).unwrap();
        let mut back = vec![0f32; xs.len()];
        cast_to_master(&out, &mut back).unwrap();
        let expected: Vec<f32> = xs.iter().map(|&x| rne_bits(x, 16)).collect();
        assert_eq!(back, expected);
        assert_eq!(back[1], 1.0);
        assert_eq!(back[2], 1.0 + 2.0 * eps);
        assert_eq!(back[3], 1.0 + eps);
    }

    #[test]
    fn f16_cast_rounds_and_overflows() {
        let xs = [
            1.0f32,
            1.0 + 2f32.powi(-11),
            65504.0,
            65520.0,
            -2.0e-8,
            f32::NAN,
        ];
        let mut out = vec![f16::ZERO; xs.len()];
        cast_to_compute(&xs, &mut out).unwrap();
        let mut back = vec![0f32; xs.len()];
        cast_to_master(&out, &mut back).unwrap();
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], 1.0); // tie at f16's 10-bit significand rounds to even
        assert_eq!(back[2], 65504.0); // largest f16
        assert_eq!(back[3], f32::INFINITY); // halfway to 2^16 rounds up, out of range
        assert_eq!(back[4], 0.0); // below half the smallest f16 subnormal (2^-25): -0
        assert!(back[4].is_sign_negative());
        assert!(back[5].is_nan());
        let mut r = xs.to_vec();
        round_to_compute(ComputeDType::F16, &mut r);
        assert_eq!(&r[..4], &back[..4]);
    }

    #[test]
    fn cast_checks_lengths() {
        let mut out = vec![f16::ZERO; 2];
        let e = cast_to_compute(&[1.0f32, 2.0, 3.0], &mut out).unwrap_err();
        assert_eq!(
            e.to_string(),
            "cast_to_compute: output has 2 elements, expected 3"
        );
    }
}
