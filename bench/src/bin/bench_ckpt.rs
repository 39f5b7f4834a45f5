//! Checkpoint throughput on this machine: save and load GB/s of a 100M-parameter f32 state
//! (one rank, and split over four thread ranks) against a plain sequential write and read of
//! the same bytes in the same run, and how long the training loop stalls for an async save
//! versus a sync one. Prints one JSON line per measurement (median of `--reps` runs).
//!
//! `loop_stall` compares three ways to save: `sync_stall_ms` (capture and `save`),
//! `async_eager_stall_ms` (capture on the loop's thread, then `save_async`) and
//! `async_stall_ms`, where the model is `Guarded` and deferred into a `Snapshot`: the writer
//! thread makes the copy while the loop runs its next step, and the stall is the hand-off
//! plus any wait of that step's parameter update for the copy. The next step is simulated:
//! `--compute-passes` reads of every parameter (forward and backward), then an update that
//! writes every one; `step_ms` is such a step without a save, `async_next_step_ms` the one
//! right after the deferred save.
//!
//! ```text
//! cargo run --release -p kiln-bench --bin bench_ckpt
//! cargo run --release -p kiln-bench --bin bench_ckpt -- --params 10000000 --reps 3 --compute-passes 2
//! ```
//!
//! Files go to a fresh directory under the system temp dir, removed at the end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use kiln_ckpt::{
    CheckpointConfig, Checkpointer, DType, Guarded, Layout, LocalFs, RankState, Retention,
    Snapshot, StateDict, Stateful, Storage, TensorSpec, ZeroStage,
};
use kiln_comm::{spawn, Communicator};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// A model as the training loop holds it: one flat f32 parameter buffer.
struct Flat {
    w: Vec<f32>,
}

impl Stateful for Flat {
    fn state(&self) -> kiln_ckpt::Result<StateDict, kiln_ckpt::StateError> {
        let mut sd = StateDict::new();
        sd.put("flat", &[self.w.len()], &self.w)?;
        Ok(sd)
    }
    fn load_state(&mut self, state: StateDict) -> kiln_ckpt::Result<(), kiln_ckpt::StateError> {
        state.read_into("flat", &mut self.w)
    }
    /// Describes the state without copying it.
    fn state_spec(&self) -> kiln_ckpt::Result<BTreeMap<String, TensorSpec>, kiln_ckpt::StateError> {
        let spec = TensorSpec {
            dtype: DType::F32,
            shape: vec![self.w.len()],
        };
        Ok([("flat".to_string(), spec)].into())
    }
}

/// The forward and backward passes of a step: `passes` reads of every parameter.
fn compute(w: &[f32], passes: usize) -> f32 {
    let mut acc = 0.0f32;
    for _ in 0..passes {
        acc += w
            .chunks(1 << 16)
            .map(|c| c.iter().sum::<f32>())
            .sum::<f32>();
    }
    std::hint::black_box(acc)
}

/// The optimizer's update: writes every parameter.
fn update(w: &mut [f32]) {
    for x in w.iter_mut() {
        *x += 1e-7;
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn line(what: &str, ranks: usize, bytes: u64, secs: f64, extra: &str) {
    println!(
        "{{\"bench\":\"ckpt\",\"what\":\"{what}\",\"ranks\":{ranks},\"bytes\":{bytes},\"secs\":{secs:.4},\"gb_per_s\":{:.3}{extra}}}",
        bytes as f64 / secs / 1e9
    );
}

/// Writes `bytes` to `path` sequentially in 4 MiB pieces and fsyncs, as a plain baseline.
fn plain_write(path: &Path, bytes: &[u8]) -> f64 {
    let t = Instant::now();
    let mut f = std::fs::File::create(path).unwrap();
    for piece in bytes.chunks(4 << 20) {
        f.write_all(piece).unwrap();
    }
    f.sync_all().unwrap();
    t.elapsed().as_secs_f64()
}

fn params_of(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank) % 1000) as f32 * 1e-3)
        .collect()
}

/// Checkpoint save and load throughput against plain file I/O, and the training loop's stall
/// for a sync, an eager async and a deferred async save; one JSON line per measurement.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_ckpt")]
struct Args {
    /// f32 parameters in the state
    #[arg(long, value_name = "N", default_value_t = 100_000_000)]
    params: usize,
    /// Runs of each measurement (the median is printed)
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    reps: u64,
    /// Reads of every parameter in the simulated step after a save
    #[arg(long, value_name = "N", default_value_t = 2)]
    compute_passes: usize,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let (params, reps, passes) = (args.params, args.reps as usize, args.compute_passes);
    let root: PathBuf =
        std::env::temp_dir().join(format!("kiln-bench-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();

    for ranks in [1usize, 4] {
        let dir = root.join(format!("ckpt-{ranks}"));
        let storage: Arc<dyn Storage> = Arc::new(LocalFs::new(&dir).unwrap());
        let per_rank = params / ranks;
        let layout = Layout::new(ranks, 1, ZeroStage::Replicated).unwrap();
        let cfg = CheckpointConfig::new(layout, "bench").with_retention(Retention::keep_last(1));
        let results = spawn(ranks, |comm| {
            let mut ck = Checkpointer::new(Arc::clone(&storage), cfg.clone())?;
            let model = Guarded::new(Flat {
                w: params_of(comm.rank(), per_rank),
            });
            let mut t: [Vec<f64>; 10] = Default::default();
            let [save, load, sync_stall, async_stall, async_wait, plain_w, plain_r, eager_stall, step_t, next_step_t] =
                &mut t;
            let plain_path = root.join(format!("plain-{ranks}-{}.bin", comm.rank()));
            let mut step = 0u64;
            for _ in 0..reps {
                // baseline under the same conditions: this rank's bytes as one plain file
                comm.barrier()?;
                let buf: Vec<u8> = model.read().w.iter().flat_map(|x| x.to_le_bytes()).collect();
                plain_w.push(plain_write(&plain_path, &buf));
                comm.barrier()?;
                let t_read = Instant::now();
                let back = std::fs::read(&plain_path).unwrap();
                plain_r.push(t_read.elapsed().as_secs_f64());
                assert_eq!(back.len(), buf.len());
                drop((back, buf));
                std::fs::remove_file(&plain_path).unwrap();
                comm.barrier()?;

                // a training step without a save in flight
                comm.barrier()?;
                let t = Instant::now();
                compute(&model.read().w, passes);
                update(&mut model.write().w);
                step_t.push(t.elapsed().as_secs_f64());

                // sync save: the loop is blocked for the copy and the whole write
                step += 1;
                comm.barrier()?;
                let t = Instant::now();
                let mut st = RankState::new();
                st.capture("model", &*model.read())?;
                let copy = t.elapsed().as_secs_f64();
                let t_save = Instant::now();
                ck.save(&comm, step, &st)?;
                let saved = t_save.elapsed().as_secs_f64();
                drop(st);
                comm.barrier()?;
                save.push(saved);
                sync_stall.push(copy + saved);

                // async save, copy on the loop's thread: blocked for the copy and the hand-off
                step += 1;
                comm.barrier()?;
                let t = Instant::now();
                let mut st = RankState::new();
                st.capture("model", &*model.read())?;
                ck.save_async(&comm, step, st)?;
                eager_stall.push(t.elapsed().as_secs_f64());
                ck.wait()?;
                comm.barrier()?;

                // async save, copy on the writer thread: blocked for the hand-off and for any
                // wait of the next update for the copy
                step += 1;
                comm.barrier()?;
                let before = model.read().w.clone();
                comm.barrier()?;
                let t = Instant::now();
                let mut snap = Snapshot::new();
                snap.defer("model", &model)?;
                ck.save_async_snapshot(&comm, step, snap)?;
                let mut blocked = t.elapsed().as_secs_f64();
                compute(&model.read().w, passes);
                let t_upd = Instant::now();
                let mut w = model.write();
                blocked += t_upd.elapsed().as_secs_f64();
                update(&mut w.w);
                drop(w);
                next_step_t.push(t.elapsed().as_secs_f64());
                async_stall.push(blocked);
                let t_wait = Instant::now();
                ck.wait()?;
                async_wait.push(t_wait.elapsed().as_secs_f64());
                comm.barrier()?;

                // load the last checkpoint back into the model: the values before the update
                comm.barrier()?;
                let t = Instant::now();
                let loaded = ck.load_step(&comm, step)?;
                loaded
                    .state
                    .restore_all(&mut [("model", &mut *model.write())], Default::default())?;
                load.push(t.elapsed().as_secs_f64());
                assert!(model.read().w == before, "the checkpoint holds the deferred values");
                drop(before);
                comm.barrier()?;
            }
            Ok::<_, kiln_ckpt::CkptError>(t)
        })
        .unwrap();
        // the slowest rank bounds each collective operation
        let worst = |k: usize| {
            median(
                (0..reps)
                    .map(|i| results.iter().map(|r| r[k][i]).fold(0.0, f64::max))
                    .collect(),
            )
        };
        let total = (per_rank * ranks * 4) as u64;
        line("plain_write_fsync", ranks, total, worst(5), "");
        line("ckpt_save_sync", ranks, total, worst(0), "");
        line("plain_read", ranks, total, worst(6), "");
        line("ckpt_load_verified", ranks, total, worst(1), "");
        let (ss, asy, aw, eager) = (worst(2), worst(3), worst(4), worst(7));
        let (st, nst) = (worst(8), worst(9));
        println!(
            "{{\"bench\":\"ckpt\",\"what\":\"loop_stall\",\"ranks\":{ranks},\"bytes\":{total},\"sync_stall_ms\":{:.1},\"async_eager_stall_ms\":{:.1},\"async_stall_ms\":{:.1},\"async_stall_ratio\":{:.4},\"async_write_after_return_ms\":{:.1},\"step_ms\":{:.1},\"async_next_step_ms\":{:.1}}}",
            ss * 1e3,
            eager * 1e3,
            asy * 1e3,
            asy / ss,
            aw * 1e3,
            st * 1e3,
            nst * 1e3
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::remove_dir_all(&root).unwrap();
}
