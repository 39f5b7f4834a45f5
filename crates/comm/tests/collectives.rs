//! Every collective of the thread backend against a sequential reference, for worlds 1, 2, 3,
//! 4, 8 and lengths 0, 1, 7 and 1M, in every element type (the suite in `common/suite.rs`,
//! which the MPI backend runs too), and point-to-point messages (ring shifts in every element
//! type, eager sends, order).
#![allow(clippy::panic)]

mod common;

use common::suite::{self, RankFn, Ranks};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_testkit::run_ranks;

struct Threads(Vec<usize>);

impl Ranks for Threads {
    fn worlds(&self) -> Vec<usize> {
        self.0.clone()
    }
    fn run<R: Send>(&self, world: usize, f: RankFn<'_, R>) -> Vec<(usize, R)> {
        run_ranks(world, |comm| f(&comm))
            .into_iter()
            .enumerate()
            .collect()
    }
}

fn all_worlds() -> Threads {
    Threads(vec![1, 2, 3, 4, 8])
}

#[test]
fn f32_collectives_match_the_sequential_reference() {
    suite::check_dtype::<f32>(&all_worlds(), &suite::LENS);
}

#[test]
fn f64_collectives_match_the_sequential_reference() {
    suite::check_dtype::<f64>(&all_worlds(), &[0, 1, 7, 100_003]);
}

#[test]
fn f16_collectives_reduce_in_f32() {
    suite::check_dtype::<half::f16>(&all_worlds(), &[0, 1, 7, 100_003]);
}

#[test]
fn bf16_collectives_reduce_in_f32() {
    suite::check_dtype::<half::bf16>(&all_worlds(), &[0, 1, 7, 100_003]);
}

#[test]
fn integer_collectives_match_the_sequential_reference() {
    suite::check_dtype::<i64>(&all_worlds(), &[0, 1, 7, 10_007]);
    suite::check_dtype::<u32>(&all_worlds(), &[0, 1, 7, 10_007]);
}

#[test]
fn reductions_are_bitwise_deterministic_across_runs() {
    // Values whose sum depends on the order: any change of order would show in the bits.
    let run = || {
        run_ranks(8, |comm| {
            let mut v: Vec<f32> = (0..10_001)
                .map(|i| {
                    (suite::value(comm.rank(), i) * 1e3) as f32
                        * if i % 3 == 0 { 1e-4 } else { 1.0 }
                })
                .collect();
            comm.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        })
    };
    let a = run();
    for _ in 0..3 {
        let b = run();
        for r in 0..8 {
            kiln_testkit::assert_bitwise_eq(&a[r], &b[r]);
            kiln_testkit::assert_bitwise_eq(&a[r], &a[0]);
        }
    }
}

#[test]
fn max_reduction_propagates_nan_and_inf() {
    suite::check_nan_max(&Threads(vec![3]));
}

#[test]
fn split_builds_dp_and_tp_groups() {
    suite::check_split(&Threads(vec![4]));
}

#[test]
fn many_small_collectives_in_a_row() {
    suite::check_many_small(&Threads(vec![4]));
}

#[test]
fn point_to_point_rings_eager_sends_and_order() {
    suite::check_p2p(&Threads(vec![2, 3, 4, 8]));
}
