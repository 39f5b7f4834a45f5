//! Element types that collectives carry, type-erased buffers, and the reduction kernels.

use half::{bf16, f16};
use std::fmt;

/// The element type of a collective's buffer: kiln-state's [`DType`], the one element-type
/// enum of kiln's stored and communicated tensors. Collectives carry every type but `U8`
/// (see [`CommElem`]).
pub use kiln_state::DType;

/// How `all_reduce` and `reduce_scatter` combine the ranks' values.
///
/// `Max` and `Min` propagate NaN: if any rank holds NaN at a position, the result is NaN there,
/// so a non-finite gradient norm or loss is never hidden by a reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks, accumulated in rank order 0, 1, ..., n-1.
    Sum,
    /// Sum over ranks divided by the number of ranks (integer division for integer types).
    Avg,
    /// Largest value.
    Max,
    /// Smallest value.
    Min,
}

impl ReduceOp {
    /// Lowercase name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

impl fmt::Display for ReduceOp {
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
}

/// An element type that collectives can carry: f32, f64, f16, bf16, i64 and u32.
///
/// Sealed: backends implement every type in [`DType`], so the set is closed.
pub trait CommElem: sealed::Sealed + bytemuck::Pod + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// Wraps a shared slice as a type-erased buffer.
    fn buf(s: &[Self]) -> Buf<'_>;
    /// Wraps a mutable slice as a type-erased buffer.
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
}

macro_rules! impl_elem {
    ($t:ty, $variant:ident) => {
        impl CommElem for $t {
            const DTYPE: DType = DType::$variant;
            fn buf(s: &[Self]) -> Buf<'_> {
                Buf::$variant(s)
            }
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$variant(s)
            }
        }
    };
}
impl_elem!(f32, F32);
impl_elem!(f64, F64);
impl_elem!(f16, F16);
impl_elem!(bf16, BF16);
impl_elem!(i64, I64);
impl_elem!(u32, U32);

/// A type-erased shared buffer handed to a [`crate::Communicator`].
#[derive(Debug)]
#[allow(missing_docs)]
pub enum Buf<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    I64(&'a [i64]),
    U32(&'a [u32]),
}

/// A type-erased mutable buffer handed to a [`crate::Communicator`].
#[derive(Debug)]
#[allow(missing_docs)]
pub enum BufMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
    I64(&'a mut [i64]),
    U32(&'a mut [u32]),
}

macro_rules! each_variant {
    ($v:expr, $s:ident => $body:expr) => {
        match $v {
            Self::F32($s) => $body,
            Self::F64($s) => $body,
            Self::F16($s) => $body,
            Self::BF16($s) => $body,
            Self::I64($s) => $body,
            Self::U32($s) => $body,
        }
    };
}

impl Buf<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        buf_dtype_of(self)
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        each_variant!(self, s => s.len())
    }
    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        each_variant!(self, s => bytemuck::cast_slice(s))
    }
}

fn buf_dtype_of(b: &Buf<'_>) -> DType {
    match b {
        Buf::F32(_) => DType::F32,
        Buf::F64(_) => DType::F64,
        Buf::F16(_) => DType::F16,
        Buf::BF16(_) => DType::BF16,
        Buf::I64(_) => DType::I64,
        Buf::U32(_) => DType::U32,
    }
}

impl BufMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::F32(_) => DType::F32,
            BufMut::F64(_) => DType::F64,
            BufMut::F16(_) => DType::F16,
            BufMut::BF16(_) => DType::BF16,
            BufMut::I64(_) => DType::I64,
            BufMut::U32(_) => DType::U32,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        each_variant!(self, s => s.len())
    }
    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        each_variant!(self, s => bytemuck::cast_slice_mut(s))
    }
}

impl<'a, T: CommElem> From<&'a [T]> for Buf<'a> {
    fn from(s: &'a [T]) -> Self {
        T::buf(s)
    }
}

impl<'a, T: CommElem> From<&'a mut [T]> for BufMut<'a> {
    fn from(s: &'a mut [T]) -> Self {
        T::buf_mut(s)
    }
}

/// Arithmetic used by the reduction kernels. Half types accumulate in f32.
pub(crate) trait Reduce: Copy {
    type Acc: Copy + Default;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_reduce {
    ($t:ty, $acc:ty, $widen:expr, $narrow:expr) => {
        impl Reduce for $t {
            type Acc = $acc;
            #[inline(always)]
            fn widen(self) -> $acc {
                $widen(self)
            }
            #[inline(always)]
            fn narrow(a: $acc) -> Self {
                $narrow(a)
            }
            #[inline(always)]
            fn add(a: $acc, b: $acc) -> $acc {
                a + b
            }
            #[inline(always)]
            fn max(a: $acc, b: $acc) -> $acc {
                if a.is_nan() || b.is_nan() {
                    <$acc>::NAN
                } else if b > a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn min(a: $acc, b: $acc) -> $acc {
                if a.is_nan() || b.is_nan() {
                    <$acc>::NAN
                } else if b < a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn div(a: $acc, n: usize) -> $acc {
                a / n as $acc
            }
        }
    };
}
float_reduce!(f32, f32, |x| x, |a| a);
float_reduce!(f64, f64, |x| x, |a| a);
float_reduce!(f16, f32, f16::to_f32, f16::from_f32);
float_reduce!(bf16, f32, bf16::to_f32, bf16::from_f32);

impl Reduce for u8 {
    type Acc = u8;
    #[inline(always)]
    fn widen(self) -> u8 {
        self
    }
    #[inline(always)]
    fn narrow(a: u8) -> Self {
        a
    }
    #[inline(always)]
    fn add(a: u8, b: u8) -> u8 {
        a.wrapping_add(b)
    }
    #[inline(always)]
    fn max(a: u8, b: u8) -> u8 {
        Ord::max(a, b)
    }
    #[inline(always)]
    fn min(a: u8, b: u8) -> u8 {
        Ord::min(a, b)
    }
    #[inline(always)]
    fn div(a: u8, n: usize) -> u8 {
        // a world of more than 255 ranks does not fit a u8: divide in usize
        u8::try_from(usize::from(a) / n.max(1)).unwrap_or(0)
    }
}

macro_rules! int_reduce {
    ($t:ty) => {
        impl Reduce for $t {
            type Acc = $t;
            #[inline(always)]
            fn widen(self) -> $t {
                self
            }
            #[inline(always)]
            fn narrow(a: $t) -> Self {
                a
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t {
                // n is a world size, far below either type's range.
                a / (n as $t)
            }
        }
    };
}
int_reduce!(i64);
int_reduce!(u32);

/// Elements reduced per block: the accumulator lives on the stack.
const BLOCK: usize = 2048;

/// Reduces `srcs` element-wise in slice order and writes the result to every slice of `dsts`.
///
/// Every source must have `len` elements starting at its pointer; every destination too.
/// The accumulation order is fixed (sources in order), so the result does not depend on which
/// thread runs the kernel.
///
/// # Safety
/// Each pointer in `srcs` must be valid for reads of `len` elements and each in `dsts` for writes
/// of `len` elements, for the whole call, with no other thread accessing those ranges meanwhile.
/// A source may alias a destination exactly (the same range): a block is read completely before
/// it is written.
pub(crate) unsafe fn reduce_into<T: Reduce>(
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    op: ReduceOp,
) {
    let n = srcs.len();
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < len {
        let m = BLOCK.min(len - start);
        let acc = &mut acc[..m];
        for (j, &src) in srcs.iter().enumerate() {
            // SAFETY: the caller guarantees `src` is readable for `len` elements and that no
            // other thread writes the range; `start + m <= len`.
            let s = unsafe { std::slice::from_raw_parts(src.add(start), m) };
            if j == 0 {
                for (a, &x) in acc.iter_mut().zip(s) {
                    *a = x.widen();
                }
            } else {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        for (a, &x) in acc.iter_mut().zip(s) {
                            *a = T::add(*a, x.widen());
                        }
                    }
                    ReduceOp::Max => {
                        for (a, &x) in acc.iter_mut().zip(s) {
                            *a = T::max(*a, x.widen());
                        }
                    }
                    ReduceOp::Min => {
                        for (a, &x) in acc.iter_mut().zip(s) {
                            *a = T::min(*a, x.widen());
                        }
                    }
                }
            }
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = T::div(*a, n);
            }
        }
        for &dst in dsts {
            // SAFETY: the caller guarantees `dst` is writable for `len` elements with no
            // concurrent access; every source block was fully read into `acc` above.
            let d = unsafe { std::slice::from_raw_parts_mut(dst.add(start), m) };
            for (d, &a) in d.iter_mut().zip(acc.iter()) {
                *d = T::narrow(a);
            }
        }
        start += m;
    }
}

/// [`reduce_into`] for an element type known at run time, on byte pointers.
///
/// # Safety
/// As [`reduce_into`], with every pointer aligned for `dtype` and valid for `len` elements of it.
pub(crate) unsafe fn reduce_bytes(
    dtype: DType,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    len: usize,
    op: ReduceOp,
) {
    unsafe fn typed<T: Reduce>(srcs: &[*const u8], dsts: &[*mut u8], len: usize, op: ReduceOp) {
        let s: Vec<*const T> = srcs.iter().map(|p| p.cast::<T>()).collect();
        let d: Vec<*mut T> = dsts.iter().map(|p| p.cast::<T>()).collect();
        // SAFETY: forwarded from the caller of `reduce_bytes`.
        unsafe { reduce_into(&s, &d, len, op) }
    }
    // SAFETY: forwarded from the caller; `T` is the type `dtype` names.
    unsafe {
        match dtype {
            DType::F32 => typed::<f32>(srcs, dsts, len, op),
            DType::F64 => typed::<f64>(srcs, dsts, len, op),
            DType::F16 => typed::<f16>(srcs, dsts, len, op),
            DType::BF16 => typed::<bf16>(srcs, dsts, len, op),
            DType::I64 => typed::<i64>(srcs, dsts, len, op),
            DType::U32 => typed::<u32>(srcs, dsts, len, op),
            // no buffer is of bytes (`u8` is no `CommElem`); summed as the other integers
            DType::U8 => typed::<u8>(srcs, dsts, len, op),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_sizes_and_names() {
        assert_eq!(DType::BF16.size_in_bytes(), 2);
        assert_eq!(DType::I64.size_in_bytes(), 8);
        assert_eq!(DType::U32.to_string(), "u32");
        let v = [1.0f32, 2.0];
        let b: Buf<'_> = (&v[..]).into();
        assert_eq!(b.dtype(), DType::F32);
        assert_eq!(b.len(), 2);
        assert_eq!(b.as_bytes().len(), 8);
    }

    #[test]
    fn max_and_min_propagate_nan() {
        assert!(<f32 as Reduce>::max(1.0, f32::NAN).is_nan());
        assert!(<f32 as Reduce>::max(f32::NAN, 1.0).is_nan());
        assert!(<f64 as Reduce>::min(f64::NAN, 1.0).is_nan());
        assert_eq!(<f32 as Reduce>::max(1.0, f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn half_sums_accumulate_in_f32() {
        // 2048 + 1 + 1 in f16 steps would round to 2048 each time; in f32 it is 2050.
        let a = [f16::from_f32(2048.0)];
        let b = [f16::from_f32(1.0)];
        let c = [f16::from_f32(1.0)];
        let mut out = [f16::ZERO];
        let srcs = [a.as_ptr(), b.as_ptr(), c.as_ptr()];
        let dsts = [out.as_mut_ptr()];
        // SAFETY: every pointer covers one element owned by this test.
        unsafe { reduce_into(&srcs, &dsts, 1, ReduceOp::Sum) };
        assert_eq!(out[0].to_f32(), 2050.0);
    }
}
