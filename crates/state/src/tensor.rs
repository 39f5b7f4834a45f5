//! Plain typed tensors: a dtype, a shape and little-endian bytes, independent of any tensor
//! library, so every crate can hand its state to a checkpoint.

use crate::error::{Result, StateError};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a stored tensor (exhaustive: the checkpoint format maps every one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit IEEE float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// 32-bit unsigned integer.
    U32,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::U32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Lowercase name, as in error messages and the manifest (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i64 {}
    impl Sealed for u32 {}
    impl Sealed for u8 {}
}

/// A Rust element type that maps to a [`DType`]: f32, f16, bf16, f64, i64, u32, u8.
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// Number of elements of a shape, `None` on overflow.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Byte count of a shape and dtype, saturating (for error messages).
fn bytes_needed(dtype: DType, shape: &[usize]) -> u128 {
    shape.iter().fold(dtype.size_in_bytes() as u128, |a, &d| {
        a.saturating_mul(d as u128)
    })
}

/// Reverses each `size`-byte element in place (little-endian <-> native on big-endian hosts).
fn swap_elements(bytes: &mut [u8], size: usize) {
    if size > 1 {
        for c in bytes.chunks_exact_mut(size) {
            c.reverse();
        }
    }
}

/// One tensor's contents: dtype, row-major shape, and the elements as little-endian bytes.
///
/// Construction checks that the byte count matches the dtype and shape, so a `TensorData` is
/// always well formed. Scalars have shape `[]` and one element.
#[derive(Clone, PartialEq, Eq)]
pub struct TensorData {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl fmt::Debug for TensorData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorData")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl TensorData {
    /// Wraps little-endian bytes; fails unless `bytes.len()` is the dtype size times the
    /// element count of `shape`.
    pub fn new(dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<Self> {
        let ok = numel(&shape)
            .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
            .is_some_and(|b| b == bytes.len());
        if !ok {
            return Err(StateError::ByteLength {
                name: String::new(),
                expected: bytes_needed(dtype, &shape),
                got: bytes.len(),
                dtype,
                shape,
            });
        }
        Ok(TensorData {
            dtype,
            shape,
            bytes,
        })
    }

    /// Copies a typed slice; fails unless `data.len()` is the element count of `shape`.
    pub fn from_slice<T: Element>(shape: &[usize], data: &[T]) -> Result<Self> {
        if numel(shape) != Some(data.len()) {
            return Err(StateError::ElementCount {
                name: String::new(),
                expected: numel(shape).unwrap_or(usize::MAX),
                got: data.len(),
            });
        }
        let mut bytes = bytemuck::cast_slice::<T, u8>(data).to_vec();
        if cfg!(target_endian = "big") {
            swap_elements(&mut bytes, T::DTYPE.size_in_bytes());
        }
        Ok(TensorData {
            dtype: T::DTYPE,
            shape: shape.to_vec(),
            bytes,
        })
    }

    /// A 1-D tensor copied from a slice.
    pub fn from_vec1<T: Element>(data: &[T]) -> Self {
        let mut bytes = bytemuck::cast_slice::<T, u8>(data).to_vec();
        if cfg!(target_endian = "big") {
            swap_elements(&mut bytes, T::DTYPE.size_in_bytes());
        }
        TensorData {
            dtype: T::DTYPE,
            shape: vec![data.len()],
            bytes,
        }
    }

    /// A scalar (shape `[]`).
    pub fn scalar<T: Element>(value: T) -> Self {
        let mut t = Self::from_vec1(&[value]);
        t.shape.clear();
        t
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The row-major shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.bytes.len() / self.dtype.size_in_bytes()
    }

    /// The little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Takes the bytes out.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Fails with [`StateError::DtypeMismatch`] unless the dtype is `T`'s.
    fn check_dtype<T: Element>(&self) -> Result<()> {
        if self.dtype != T::DTYPE {
            return Err(StateError::DtypeMismatch {
                name: String::new(),
                expected: T::DTYPE,
                got: self.dtype,
            });
        }
        Ok(())
    }

    /// Fails with [`StateError::ShapeMismatch`] unless the shape is `shape`.
    pub fn check_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            return Err(StateError::ShapeMismatch {
                name: String::new(),
                expected: shape.to_vec(),
                got: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// The elements as a typed vector; fails on a dtype other than `T`'s.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>()?;
        let mut out = vec![T::zeroed(); self.numel()];
        self.copy_unchecked(&mut out);
        Ok(out)
    }

    /// Copies the elements into `out`; fails on a dtype other than `T`'s or a length other
    /// than [`TensorData::numel`].
    pub fn copy_to<T: Element>(&self, out: &mut [T]) -> Result<()> {
        self.check_dtype::<T>()?;
        if out.len() != self.numel() {
            return Err(StateError::ElementCount {
                name: String::new(),
                expected: self.numel(),
                got: out.len(),
            });
        }
        self.copy_unchecked(out);
        Ok(())
    }

    /// The single element of a scalar or one-element tensor.
    pub fn to_scalar<T: Element>(&self) -> Result<T> {
        self.check_dtype::<T>()?;
        let mut out = [T::zeroed()];
        if self.numel() != 1 {
            return Err(StateError::ElementCount {
                name: String::new(),
                expected: 1,
                got: self.numel(),
            });
        }
        self.copy_unchecked(&mut out);
        Ok(out[0])
    }

    fn copy_unchecked<T: Element>(&self, out: &mut [T]) {
        let dst = bytemuck::cast_slice_mut::<T, u8>(out);
        dst.copy_from_slice(&self.bytes);
        if cfg!(target_endian = "big") {
            swap_elements(dst, T::DTYPE.size_in_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_little_endian() {
        let t = TensorData::from_slice(&[2], &[1.0f32, -2.5]).unwrap();
        let mut expected = 1.0f32.to_le_bytes().to_vec();
        expected.extend((-2.5f32).to_le_bytes());
        assert_eq!(t.bytes(), &expected[..]);
        let t = TensorData::scalar(0x0102_0304_0506_0708i64);
        assert_eq!(t.shape(), &[] as &[usize]);
        assert_eq!(t.bytes(), &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(t.to_scalar::<i64>().unwrap(), 0x0102_0304_0506_0708);
    }

    #[test]
    fn typed_round_trip_every_dtype() {
        let f = [1.5f32, -0.0, f32::MAX, f32::MIN_POSITIVE];
        assert_eq!(TensorData::from_vec1(&f).to_vec::<f32>().unwrap(), f);
        let h = [f16::from_f32(0.1), f16::NEG_INFINITY];
        assert_eq!(TensorData::from_vec1(&h).to_vec::<f16>().unwrap(), h);
        let b = [bf16::from_f32(3.0e38), bf16::from_f32(-1e-3)];
        assert_eq!(TensorData::from_vec1(&b).to_vec::<bf16>().unwrap(), b);
        let d = [std::f64::consts::PI];
        assert_eq!(TensorData::from_vec1(&d).to_vec::<f64>().unwrap(), d);
        let u = [u32::MAX, 7];
        assert_eq!(TensorData::from_vec1(&u).to_vec::<u32>().unwrap(), u);
        let by = [0u8, 255, 9];
        let t = TensorData::from_vec1(&by);
        assert_eq!(t.bytes(), &by);
        assert_eq!(t.dtype().size_in_bytes(), 1);
    }

    #[test]
    fn wrong_dtype_shape_and_length_are_typed_errors() {
        let t = TensorData::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        assert!(matches!(
            t.to_vec::<f64>(),
            Err(StateError::DtypeMismatch {
                expected: DType::F64,
                got: DType::F32,
                ..
            })
        ));
        assert!(matches!(
            t.check_shape(&[4]),
            Err(StateError::ShapeMismatch { .. })
        ));
        let mut out = [0.0f32; 3];
        assert!(matches!(
            t.copy_to(&mut out),
            Err(StateError::ElementCount {
                expected: 4,
                got: 3,
                ..
            })
        ));
        assert!(matches!(
            TensorData::from_slice(&[3], &[1.0f32, 2.0]),
            Err(StateError::ElementCount { .. })
        ));
        let e = TensorData::new(DType::F32, vec![3], vec![0; 11]).unwrap_err();
        assert_eq!(
            e.named("w").to_string(),
            "tensor w: f32 [3] needs 12 bytes, got 11"
        );
        // an overflowing shape is an error, not a panic
        assert!(TensorData::new(DType::F64, vec![usize::MAX, 3], vec![]).is_err());
    }
}
