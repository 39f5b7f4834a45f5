//! The collective test suite, run by every backend against the same sequential references:
//! the thread backend in `collectives.rs` (worlds 1, 2, 3, 4, 8 in one process), the MPI
//! backend in `mpi.rs` (one rank per process under `mpirun -np N`). The point-to-point checks
//! (`check_p2p_*`) compare what arrives with what the sender computed, bit for bit.
#![allow(dead_code)]

use half::{bf16, f16};
use kiln_comm::{chunk_range, CommExt, Communicator, P2pOp, ReduceOp};

pub const LENS: [usize; 4] = [0, 1, 7, 1 << 20];
pub const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// The closure a suite check runs on every rank.
pub type RankFn<'a, R> = &'a (dyn Fn(&dyn Communicator) -> anyhow::Result<R> + Sync);

/// A way to run a closure on the ranks of a world: every rank's result it can see, as
/// `(rank, result)` (all ranks for threads, this process's rank for MPI).
pub trait Ranks {
    /// The world sizes this runner checks.
    fn worlds(&self) -> Vec<usize>;
    /// Runs `f` on `world` ranks.
    fn run<R: Send>(&self, world: usize, f: RankFn<'_, R>) -> Vec<(usize, R)>;
}

/// A deterministic pseudo-random value for (rank, index), with sign and a spread of exponents.
pub fn value(rank: usize, i: usize) -> f64 {
    let mut x = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64);
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    let u = (x >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    (u - 0.5) * 200.0
}

pub trait Elem: kiln_comm::CommElem + PartialEq + std::fmt::Debug {
    fn from_f64(x: f64) -> Self;
    /// The reference reduction in rank order, accumulating as the backend documents.
    fn reduce(vals: &[Self], op: ReduceOp) -> Self;
    fn bits(self) -> u64;
}

macro_rules! float_elem {
    ($t:ty, $acc:ty, $to:expr, $from:expr) => {
        impl Elem for $t {
            fn from_f64(x: f64) -> Self {
                $from(x as $acc)
            }
            fn reduce(vals: &[Self], op: ReduceOp) -> Self {
                let mut acc: $acc = $to(vals[0]);
                for &v in &vals[1..] {
                    let v: $acc = $to(v);
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc + v,
                        ReduceOp::Max => acc.max(v),
                        ReduceOp::Min => acc.min(v),
                    };
                }
                if op == ReduceOp::Avg {
                    acc /= vals.len() as $acc;
                }
                $from(acc)
            }
            fn bits(self) -> u64 {
                let acc: $acc = $to(self);
                acc.to_bits() as u64
            }
        }
    };
}
float_elem!(f32, f32, |x: f32| x, |a: f32| a);
float_elem!(f64, f64, |x: f64| x, |a: f64| a);
float_elem!(f16, f32, f16::to_f32, f16::from_f32);
float_elem!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn from_f64(x: f64) -> Self {
                (x.abs() * 1000.0) as $t
            }
            fn reduce(vals: &[Self], op: ReduceOp) -> Self {
                let mut acc = vals[0];
                for &v in &vals[1..] {
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(v),
                        ReduceOp::Max => acc.max(v),
                        ReduceOp::Min => acc.min(v),
                    };
                }
                if op == ReduceOp::Avg {
                    acc /= vals.len() as $t;
                }
                acc
            }
            fn bits(self) -> u64 {
                self as u64
            }
        }
    };
}
int_elem!(i64);
int_elem!(u32);

fn inputs<T: Elem>(world: usize, len: usize) -> Vec<Vec<T>> {
    (0..world)
        .map(|r| (0..len).map(|i| T::from_f64(value(r, i))).collect())
        .collect()
}

fn reference<T: Elem>(inputs: &[Vec<T>], len: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| {
            let column: Vec<T> = inputs.iter().map(|v| v[i]).collect();
            T::reduce(&column, op)
        })
        .collect()
}

pub fn assert_bits_eq<T: Elem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].bits() != want[i].bits()) {
        panic!(
            "{what}: first difference at {i} of {}: got {:?} want {:?}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

fn check_all_reduce<T: Elem>(ranks: &impl Ranks, world: usize, len: usize, op: ReduceOp) {
    let ins = inputs::<T>(world, len);
    let want = reference(&ins, len, op);
    let outs = ranks.run(world, &|comm| {
        let mut buf = ins[comm.rank()].clone();
        comm.all_reduce(&mut buf, op)?;
        Ok(buf)
    });
    for (r, out) in &outs {
        assert_bits_eq(
            out,
            &want,
            &format!("all_reduce {op} world {world} len {len} rank {r}"),
        );
    }
}

fn check_reduce_scatter<T: Elem>(ranks: &impl Ranks, world: usize, len: usize, op: ReduceOp) {
    let ins = inputs::<T>(world, len);
    let want = reference(&ins, len, op);
    let outs = ranks.run(world, &|comm| {
        let mut out = vec![T::from_f64(0.0); chunk_range(len, world, comm.rank()).len()];
        comm.reduce_scatter(&ins[comm.rank()], &mut out, op)?;
        Ok(out)
    });
    for (r, out) in &outs {
        let c = chunk_range(len, world, *r);
        assert_bits_eq(
            out,
            &want[c],
            &format!("reduce_scatter {op} world {world} len {len} rank {r}"),
        );
    }
}

fn check_all_gather<T: Elem>(ranks: &impl Ranks, world: usize, len: usize) {
    let full: Vec<T> = (0..len).map(|i| T::from_f64(value(99, i))).collect();
    let outs = ranks.run(world, &|comm| {
        let mine = &full[chunk_range(len, world, comm.rank())];
        let mut out = vec![T::from_f64(0.0); len];
        comm.all_gather(mine, &mut out)?;
        Ok(out)
    });
    for (r, out) in &outs {
        assert_bits_eq(
            out,
            &full,
            &format!("all_gather world {world} len {len} rank {r}"),
        );
    }
}

fn check_broadcast<T: Elem>(ranks: &impl Ranks, world: usize, len: usize) {
    let ins = inputs::<T>(world, len);
    for root in 0..world {
        let outs = ranks.run(world, &|comm| {
            let mut buf = ins[comm.rank()].clone();
            comm.broadcast(&mut buf, root)?;
            Ok(buf)
        });
        for (r, out) in &outs {
            assert_bits_eq(
                out,
                &ins[root],
                &format!("broadcast root {root} world {world} rank {r}"),
            );
        }
    }
}

/// Every collective of one element type, for every world of the runner and every length.
pub fn check_dtype<T: Elem>(ranks: &impl Ranks, lens: &[usize]) {
    for world in ranks.worlds() {
        for &len in lens {
            for op in OPS {
                check_all_reduce::<T>(ranks, world, len, op);
                check_reduce_scatter::<T>(ranks, world, len, op);
            }
            check_all_gather::<T>(ranks, world, len);
            check_broadcast::<T>(ranks, world, len.min(1000));
        }
    }
}

/// The whole dtype matrix: f32 at lengths 0, 1, 7 and 1M; f64, f16 and bf16 up to 100,003;
/// the integer types up to 10,007.
pub fn check_every_dtype(ranks: &impl Ranks) {
    check_dtype::<f32>(ranks, &LENS);
    check_dtype::<f64>(ranks, &[0, 1, 7, 100_003]);
    check_dtype::<f16>(ranks, &[0, 1, 7, 100_003]);
    check_dtype::<bf16>(ranks, &[0, 1, 7, 100_003]);
    check_dtype::<i64>(ranks, &[0, 1, 7, 10_007]);
    check_dtype::<u32>(ranks, &[0, 1, 7, 10_007]);
}

/// Max propagates NaN from any rank and keeps infinities.
pub fn check_nan_max(ranks: &impl Ranks) {
    for world in ranks.worlds().into_iter().filter(|&w| w >= 2) {
        let outs = ranks.run(world, &|comm| {
            let mut v = [1.0f32, 2.0, -1.0];
            if comm.rank() == 1 {
                v = [f32::NAN, f32::INFINITY, -1.0];
            }
            comm.all_reduce(&mut v, ReduceOp::Max)?;
            Ok(v)
        });
        for (_, v) in outs {
            assert!(v[0].is_nan());
            assert_eq!(v[1], f32::INFINITY);
            assert_eq!(v[2], -1.0);
        }
    }
}

/// World 4 as dp=2 x tp=2 through `split`, reversed keys and a nested split.
pub fn check_split(ranks: &impl Ranks) {
    if !ranks.worlds().contains(&4) {
        return;
    }
    let outs = ranks.run(4, &|comm| {
        let r = comm.rank();
        let tp = comm.split((r / 2) as u32, r as u32)?;
        let dp = comm.split((r % 2) as u32, r as u32)?;
        let mut t = [r as f64];
        tp.all_reduce(&mut t, ReduceOp::Sum)?;
        let mut d = [r as f64];
        dp.all_reduce(&mut d, ReduceOp::Sum)?;
        // a split with reversed keys reverses the order
        let rev = comm.split(0, (10 - r) as u32)?;
        let mut g = vec![0.0f64; 4];
        rev.all_gather(&[r as f64], &mut g)?;
        // nested split: the dp group split again into singletons
        let single = dp.split(dp.rank() as u32, 0)?;
        single.barrier()?;
        Ok((
            tp.rank(),
            tp.world_size(),
            t[0],
            dp.rank(),
            d[0],
            rev.rank(),
            g,
            single.world_size(),
        ))
    });
    let want_t = [1.0, 1.0, 5.0, 5.0];
    let want_d = [2.0, 4.0, 2.0, 4.0];
    for (r, o) in &outs {
        let r = *r;
        assert_eq!(o.0, r % 2);
        assert_eq!(o.1, 2);
        assert_eq!(o.2, want_t[r]);
        assert_eq!(o.3, r / 2);
        assert_eq!(o.4, want_d[r]);
        assert_eq!(o.5, 3 - r);
        assert_eq!(o.6, vec![3.0, 2.0, 1.0, 0.0]);
        assert_eq!(o.7, 1);
    }
}

/// 500 scalar all-reduces with a barrier every 50: sequence numbers and sums stay in step.
pub fn check_many_small(ranks: &impl Ranks) {
    for world in ranks.worlds() {
        let outs = ranks.run(world, &|world_comm| {
            // a fresh communicator, so that the sequence numbers start at 0
            let comm = world_comm.split(0, world_comm.rank() as u32)?;
            let mut acc = 0.0f64;
            for step in 0..500 {
                let v = comm.all_reduce_scalar((comm.rank() * step) as f64, ReduceOp::Sum)?;
                acc += v;
                if step % 50 == 0 {
                    comm.barrier()?;
                }
            }
            Ok((acc, comm.last_collective().map(|d| d.seq)))
        });
        let ranksum = (world * (world - 1) / 2) as f64;
        let want: f64 = (0..500).map(|s| ranksum * s as f64).sum();
        for (_, o) in outs {
            assert_eq!(o.0, want);
            assert_eq!(o.1, Some(509));
        }
    }
}

/// What rank `src` sends as message `msg` of `len` elements.
fn message<T: Elem>(src: usize, msg: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(value(src * 1000 + msg, i)))
        .collect()
}

/// A ring shift by one in both directions through `p2p_batch` (receives listed first, so only
/// posting everything before waiting avoids a deadlock), every rank checking both messages.
fn check_p2p_ring<T: Elem>(ranks: &impl Ranks, world: usize, len: usize) {
    let outs = ranks.run(world, &|comm| {
        let (n, r) = (comm.world_size(), comm.rank());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let to_next = message::<T>(r, 0, len);
        let to_prev = message::<T>(r, 1, len);
        let mut from_prev = vec![T::from_f64(0.0); len];
        let mut from_next = vec![T::from_f64(0.0); len];
        comm.p2p_batch(&mut [
            P2pOp::recv(&mut from_prev, prev, 10),
            P2pOp::recv(&mut from_next, next, 11),
            P2pOp::send(&to_next, next, 10),
            P2pOp::send(&to_prev, prev, 11),
        ])?;
        Ok((from_prev, from_next))
    });
    for (r, (from_prev, from_next)) in &outs {
        let (prev, next) = ((r + world - 1) % world, (r + 1) % world);
        let what = format!("ring world {world} len {len} rank {r}");
        assert_bits_eq(from_prev, &message::<T>(prev, 0, len), &what);
        assert_bits_eq(from_next, &message::<T>(next, 1, len), &what);
    }
}

/// Every rank sends to the next rank first and receives from the previous one second, with
/// plain `send` and `recv`: only an eager send lets the ring complete. `len` elements of f32.
fn check_p2p_send_first(ranks: &impl Ranks, world: usize, len: usize) {
    let outs = ranks.run(world, &|comm| {
        let (n, r) = (comm.world_size(), comm.rank());
        comm.send(&message::<f32>(r, 2, len), (r + 1) % n, 3)?;
        let mut got = vec![0.0f32; len];
        comm.recv(&mut got, (r + n - 1) % n, 3)?;
        Ok(got)
    });
    for (r, got) in &outs {
        let prev = (r + world - 1) % world;
        let what = format!("send first world {world} len {len} rank {r}");
        assert_bits_eq(got, &message::<f32>(prev, 2, len), &what);
    }
}

/// 100 messages of varying lengths and tags from each even rank to the odd rank after it,
/// received one by one and in order; then 100 back in one batch.
fn check_p2p_in_order(ranks: &impl Ranks, world: usize) {
    let lens = |m: usize| (m * 37) % 101;
    let outs = ranks.run(world, &|comm| {
        let r = comm.rank();
        let partner = r ^ 1;
        if partner >= comm.world_size() {
            return Ok(Vec::new());
        }
        let mut got = Vec::new();
        if r % 2 == 0 {
            for m in 0..100 {
                comm.send(&message::<f64>(r, m, lens(m)), partner, m as u32)?;
            }
            let mut bufs: Vec<Vec<f64>> = (0..100).map(|m| vec![0.0; lens(m)]).collect();
            let mut ops: Vec<P2pOp<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(m, b)| P2pOp::recv(b, partner, 1000 + m as u32))
                .collect();
            comm.p2p_batch(&mut ops)?;
            drop(ops);
            got = bufs;
        } else {
            for m in 0..100 {
                let mut b = vec![0.0f64; lens(m)];
                comm.recv(&mut b, partner, m as u32)?;
                got.push(b);
            }
            let msgs: Vec<Vec<f64>> = (0..100).map(|m| message(r, 100 + m, lens(m))).collect();
            let mut ops: Vec<P2pOp<'_>> = msgs
                .iter()
                .enumerate()
                .map(|(m, b)| P2pOp::send(b, partner, 1000 + m as u32))
                .collect();
            comm.p2p_batch(&mut ops)?;
        }
        Ok(got)
    });
    for (r, got) in &outs {
        let partner = r ^ 1;
        if partner >= world {
            continue;
        }
        assert_eq!(got.len(), 100, "rank {r}");
        for (m, g) in got.iter().enumerate() {
            let msg = if r % 2 == 0 { 100 + m } else { m };
            let what = format!("message {m} from rank {partner} to rank {r}");
            assert_bits_eq(g, &message::<f64>(partner, msg, lens(m)), &what);
        }
    }
}

/// Point-to-point in every element type and at lengths 0, 1, 7 and 1000 (rings of every world
/// of at least 2 ranks); eager sends of 1 MiB (beyond MPI's eager limit) around the ring; 100
/// messages in order between pairs.
pub fn check_p2p(ranks: &impl Ranks) {
    for world in ranks.worlds().into_iter().filter(|&w| w >= 2) {
        for len in [0, 1, 7, 1000] {
            check_p2p_ring::<f32>(ranks, world, len);
            check_p2p_ring::<f64>(ranks, world, len);
            check_p2p_ring::<f16>(ranks, world, len);
            check_p2p_ring::<bf16>(ranks, world, len);
            check_p2p_ring::<i64>(ranks, world, len);
            check_p2p_ring::<u32>(ranks, world, len);
        }
        check_p2p_send_first(ranks, world, (1 << 18) + 3);
        check_p2p_send_first(ranks, world, 0);
        check_p2p_in_order(ranks, world);
    }
}
