//! Global-norm gradient clipping over shards: the sum of squares is computed exactly, so the
//! norm, and therefore the clipped gradients, are bitwise the same however the gradients are
//! sharded over ranks.

use crate::error::{OptimError, Result};
use kiln_comm::{CommExt, Communicator, ReduceOp};

/// 32-bit limbs of the fixed-point accumulator: the square of an f32 is `mant^2 * 2^(2e - 300)`
/// with `mant < 2^24` and `1 <= e <= 254`, so in units of 2^-298 it has at most
/// `48 + 506 = 554` bits; 640 bits leave room for 2^86 terms.
const LIMBS: usize = 20;
/// Elements per block of the binning loop: each exponent bin (a u64) receives at most this many
/// squares below 2^48, so it cannot overflow (2^15 * 2^48 = 2^63).
const BIN_BLOCK: usize = 1 << 15;
/// Independent bin arrays, so consecutive elements of equal exponent do not serialise on one
/// memory location.
const LANES: usize = 8;

/// The exact sum of squares of f32 values, independent of the order in which they are added and
/// of how they are split over ranks: `add` every local slice, [`SquareSum::all_reduce`] over the
/// ranks, read [`SquareSum::value`] (rounded once to f64) or [`SquareSum::norm`].
///
/// Each square is binned by exponent into integer accumulators, so the sum is exact (no
/// rounding until the final conversion); inf and NaN are recorded as flags, and then the value
/// is inf or NaN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SquareSum {
    /// Little-endian 32-bit limbs of the sum in units of 2^-298 (each below 2^32 after
    /// normalisation).
    limbs: [u64; LIMBS],
    /// Any NaN added.
    nan: bool,
    /// Any infinity added.
    inf: bool,
}

/// Adds the square of `x`'s significand to the bin of its exponent, without a branch:
/// `x = mant * 2^(e - 150)` with `mant = 2^23 + frac`, so `x^2 = mant^2 * 2^(2e - 300)` with
/// `mant^2 < 2^48`. Zeros and subnormals (exponent field 0) have no implicit bit: bin 0 gets
/// `frac^2` (nothing for a zero), a subnormal `frac * 2^(1 - 150)` squared at exponent 1's
/// scale, which the flush applies to bin 0. Bin 255 (inf and NaN) is junk, and rare: the caller
/// redoes it.
#[inline(always)]
fn bin(lane: &mut [u64; 256], x: f32) {
    let bits = x.to_bits();
    let e = ((bits >> 23) & 0xff) as usize;
    let mant = ((bits & 0x7f_ffff) | (u32::from(e != 0) << 23)) as u64;
    lane[e] += mant * mant;
}

impl Default for SquareSum {
    fn default() -> Self {
        Self::new()
    }
}

impl SquareSum {
    /// Zero.
    pub fn new() -> Self {
        SquareSum {
            limbs: [0; LIMBS],
            nan: false,
            inf: false,
        }
    }

    /// The exact sum of squares of `values`.
    pub fn of(values: &[f32]) -> Self {
        let mut s = Self::new();
        s.add(values);
        s
    }

    /// [`SquareSum::of`] split over `threads` scoped threads: the same value, bit for bit
    /// (the partial sums are exact), in less time on large buffers.
    pub fn of_threads(values: &[f32], threads: usize) -> Self {
        let threads = threads.clamp(1, values.len().div_ceil(BIN_BLOCK).max(1));
        if threads == 1 {
            return Self::of(values);
        }
        let part = values.len().div_ceil(threads);
        std::thread::scope(|s| {
            let handles: Vec<_> = values
                .chunks(part)
                .map(|c| s.spawn(move || SquareSum::of(c)))
                .collect();
            let mut total = SquareSum::new();
            for h in handles {
                match h.join() {
                    Ok(partial) => total.merge(&partial),
                    // `SquareSum::of` does not panic; should a thread die anyway, recount here
                    Err(_) => return SquareSum::of(values),
                }
            }
            total
        })
    }

    /// Adds the squares of `values`.
    pub fn add(&mut self, values: &[f32]) {
        let mut bins = [[0u64; 256]; LANES];
        for block in values.chunks(BIN_BLOCK) {
            let mut groups = block.chunks_exact(LANES);
            for group in &mut groups {
                for (lane, &x) in bins.iter_mut().zip(group) {
                    bin(lane, x);
                }
            }
            for &x in groups.remainder() {
                bin(&mut bins[0], x);
            }
            // bin 255 is junk (see `bin`): redo inf and NaN exactly. (Zeros, which a block of
            // gradients often holds, the rows of tokens a batch does not use, once sent every
            // block through this pass.)
            let special = bins.iter().any(|l| l[255] != 0);
            for lane in bins.iter_mut() {
                lane[255] = 0;
            }
            if special {
                for &x in block {
                    let bits = x.to_bits();
                    if (bits >> 23) & 0xff == 255 {
                        if bits & 0x7f_ffff != 0 {
                            self.nan = true;
                        } else {
                            self.inf = true;
                        }
                    }
                }
            }
            for lane in bins.iter_mut() {
                for (e, b) in lane.iter_mut().enumerate() {
                    if *b != 0 {
                        // bin 0 (subnormals) at exponent 1's scale
                        self.add_shifted(*b, 2 * e.max(1) - 2);
                        *b = 0;
                    }
                }
            }
            self.normalize();
        }
    }

    /// Adds squares binned elsewhere, as a GPU kernel bins them (kiln-parallel's CUDA step):
    /// for each exponent field `e` in `1..=254`, `high[e] * 2^24 + low[e]` is a sum of squared
    /// significands `mant^2` of values `mant * 2^(e - 150)` (subnormals counted at `e = 1`
    /// without the implicit bit, as [`SquareSum::add`] does); `nan` and `inf` say whether a NaN or
    /// an infinity was met. Entries 0 and 255 must be zero (a non-zero one makes the sum NaN:
    /// the binning was wrong). Integer bins are exact, so the result is the same as adding the
    /// values here, bit for bit.
    pub fn add_bins(&mut self, high: &[u64; 256], low: &[u64; 256], nan: bool, inf: bool) {
        for e in 1..255 {
            if low[e] != 0 {
                self.add_shifted(low[e], 2 * e - 2);
            }
            if high[e] != 0 {
                self.add_shifted(high[e], 2 * e - 2 + 24);
            }
        }
        self.nan |= nan || high[0] != 0 || low[0] != 0 || high[255] != 0 || low[255] != 0;
        self.inf |= inf;
        self.normalize();
    }

    /// Adds `val * 2^shift` (units of 2^-298) to the limbs.
    fn add_shifted(&mut self, val: u64, shift: usize) {
        let limb = shift / 32;
        let wide = (val as u128) << (shift % 32);
        self.limbs[limb] += (wide & 0xffff_ffff) as u64;
        self.limbs[limb + 1] += ((wide >> 32) & 0xffff_ffff) as u64;
        self.limbs[limb + 2] += (wide >> 64) as u64;
    }

    fn normalize(&mut self) {
        let mut carry = 0u64;
        for l in self.limbs.iter_mut() {
            let t = *l + carry;
            *l = t & 0xffff_ffff;
            carry = t >> 32;
        }
        debug_assert_eq!(carry, 0, "square sum exceeded 640 bits");
    }

    /// Adds another partial sum (exact).
    pub fn merge(&mut self, other: &SquareSum) {
        for (a, b) in self.limbs.iter_mut().zip(&other.limbs) {
            *a += b;
        }
        self.nan |= other.nan;
        self.inf |= other.inf;
        self.normalize();
    }

    /// Sums the partial sums of all ranks of `comm` (an all-reduce of 22 integers); every rank
    /// ends with the same, exact total.
    pub fn all_reduce(&mut self, comm: &dyn Communicator) -> Result<()> {
        let mut buf = [0i64; LIMBS + 2];
        for (b, &l) in buf.iter_mut().zip(&self.limbs) {
            *b = l as i64; // each limb is below 2^32
        }
        buf[LIMBS] = self.nan as i64;
        buf[LIMBS + 1] = self.inf as i64;
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        // a sum of `world` limbs below 2^32 each fits in 63 bits for any world below 2^31
        for (l, &b) in self.limbs.iter_mut().zip(&buf) {
            *l = b as u64;
        }
        self.nan = buf[LIMBS] != 0;
        self.inf = buf[LIMBS + 1] != 0;
        self.normalize();
        Ok(())
    }

    /// True when no inf or NaN was added.
    pub fn is_finite(&self) -> bool {
        !self.nan && !self.inf
    }

    /// The sum, correctly rounded to f64; NaN if a NaN was added, else inf if an inf was.
    pub fn value(&self) -> f64 {
        if self.nan {
            return f64::NAN;
        }
        if self.inf {
            return f64::INFINITY;
        }
        let Some(top) = self.limbs.iter().rposition(|&l| l != 0) else {
            return 0.0;
        };
        // a window of three limbs holds at least 65 significant bits when top >= 2; any bit
        // below it only matters as "something below", so OR it into the lowest bit (sticky)
        // and let the u128 -> f64 conversion round to nearest even
        let lo = top.saturating_sub(2);
        let mut window = 0u128;
        for i in (lo..=top).rev() {
            window = (window << 32) | self.limbs[i] as u128;
        }
        if self.limbs[..lo].iter().any(|&l| l != 0) {
            window |= 1;
        }
        // exact power of two: 32 * lo - 298 lies in [-298, 278]
        let exp = 32 * lo as i64 - 298;
        window as f64 * f64::from_bits(((exp + 1023) as u64) << 52)
    }

    /// `sqrt(value())`: the L2 norm.
    pub fn norm(&self) -> f64 {
        self.value().sqrt()
    }
}

/// What [`clip_grad_norm`] found and did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipReport {
    /// The global L2 norm of the gradients before clipping (inf or NaN when a gradient is).
    pub norm: f64,
    /// The factor the gradients were multiplied by (1 when not clipped).
    pub coef: f32,
    /// True when the gradients were scaled down.
    pub clipped: bool,
}

impl ClipReport {
    /// False when the norm is inf or NaN: the gradients were left unchanged, and the step
    /// should be skipped.
    pub fn is_finite(&self) -> bool {
        self.norm.is_finite()
    }
}

/// Clips `grads` to a global norm already computed (over every shard of every rank): when
/// `norm > max_norm`, multiplies by PyTorch's `clip_coef = max_norm / (norm + 1e-6)`, clamped
/// to 1 (computed in f64, rounded once to f32). A non-finite norm leaves the gradients
/// unchanged and is reported ([`ClipReport::is_finite`]).
pub fn clip_to_norm(grads: &mut [f32], norm: f64, max_norm: f32) -> Result<ClipReport> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(OptimError::InvalidHyperparameter {
            name: "max_norm",
            value: max_norm as f64,
            reason: "must be finite and positive",
        });
    }
    if !norm.is_finite() {
        return Ok(ClipReport {
            norm,
            coef: 1.0,
            clipped: false,
        });
    }
    let coef = ((max_norm as f64 / (norm + 1e-6)) as f32).min(1.0);
    let clipped = coef < 1.0;
    if clipped {
        grads.iter_mut().for_each(|g| *g *= coef);
    }
    Ok(ClipReport {
        norm,
        coef,
        clipped,
    })
}

/// The global L2 norm of gradients sharded over the ranks of `comm` (each rank passes its own
/// shard); exact up to the final rounding, and bitwise independent of the sharding.
pub fn global_grad_norm(comm: &dyn Communicator, grads: &[f32]) -> Result<f64> {
    let mut s = SquareSum::of(grads);
    s.all_reduce(comm)?;
    Ok(s.norm())
}

/// Clips gradients sharded over the ranks of `comm` to the global L2 norm `max_norm`
/// (PyTorch's `clip_grad_norm_` over the union of the shards). Every rank gets the same report;
/// sharded and unsharded clipping give bitwise the same gradients. With several buffers per
/// rank, add them all to one [`SquareSum`], all-reduce it once, and call [`clip_to_norm`] on
/// each buffer.
pub fn clip_grad_norm(
    comm: &dyn Communicator,
    grads: &mut [f32],
    max_norm: f32,
) -> Result<ClipReport> {
    let norm = global_grad_norm(comm, grads)?;
    clip_to_norm(grads, norm, max_norm)
}

/// [`clip_grad_norm`] for gradients that all live in this process (no communicator).
pub fn clip_grad_norm_local(grads: &mut [f32], max_norm: f32) -> Result<ClipReport> {
    let norm = SquareSum::of(grads).norm();
    clip_to_norm(grads, norm, max_norm)
}
