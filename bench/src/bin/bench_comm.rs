//! Bandwidth of kiln-comm's backends, in NCCL's terms.
//!
//! Prints one JSON line per (backend, op, bytes, world) with the algorithm bandwidth (`algbw_gbps`:
//! bytes / time) and bus bandwidth (`busbw_gbps`: algbw x 2(n-1)/n for all-reduce, (n-1)/n for
//! reduce-scatter and all-gather, 1 for broadcast), next to this machine's memcpy bandwidth
//! measured in the same run (`memcpy_gbps`: bytes copied / time, the same convention as algbw).
//! Times are medians over repetitions.
//!
//! Run: `cargo run --release -p kiln-bench --bin bench_comm` (add `-- --quick` for fewer sizes) for the
//! thread backend on 2, 4 and 8 ranks. The MPI backend, one rank per process:
//! `cargo build --release --features mpi -p kiln-bench --bin bench_comm`, then
//! `mpirun -np 2 target/release/bench_comm --backend mpi`; it also times each
//! collective with the agreement check off (`"checked":false`), which is its cost, and then
//! the thread backend on as many ranks inside rank 0's process, for comparison;
//! `--stage-kib N` sets the bytes a rank moves per round of a large collective.
//!
//! The NCCL backend, one rank per process and GPU: `cargo build --release --features nccl -p kiln-bench
//! --bin bench_comm`, then start it once per rank with torchrun-style variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) or under mpirun, with
//! `--backend nccl`. It first checks each collective's result on device buffers (rank r
//! contributes r + 1), then times them on device buffers; `memcpy_gbps` is then the host's.

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

use kiln_comm::{spawn, CommError, CommExt, Communicator, ReduceOp};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn reps_for(bytes: usize) -> usize {
    (((256usize << 20) / bytes.max(1)).clamp(5, 200)) | 1
}

fn memcpy_gbps(bytes: usize) -> f64 {
    let n = bytes / 4;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0.0f32; n];
    let times = (0..reps_for(bytes))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    bytes as f64 / median(times) / 1e9
}

/// Median seconds of `reps` calls of one collective on this rank, each started after a
/// barrier.
fn time_on(comm: &dyn Communicator, op: &str, bytes: usize) -> Result<f64, CommError> {
    let n = bytes / 4;
    let reps = reps_for(bytes);
    let mut buf = vec![1.0f32; n];
    let input = vec![1.0f32; n];
    let mut shard = vec![0.0f32; comm.my_chunk(n).len()];
    let mine = input[comm.my_chunk(n)].to_vec();
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 1 {
        comm.barrier()?;
        let t = Instant::now();
        match op {
            "all_reduce" => comm.all_reduce(&mut buf, ReduceOp::Sum)?,
            "reduce_scatter" => comm.reduce_scatter(&input, &mut shard, ReduceOp::Sum)?,
            "all_gather" => comm.all_gather(&mine, &mut buf)?,
            _ => comm.broadcast(&mut buf, 0)?,
        }
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// The slowest rank's median on `world` thread ranks.
fn time_op(op: &'static str, world: usize, bytes: usize) -> Result<f64, CommError> {
    let times =
        spawn(world, |comm| time_on(&comm, op, bytes)).map_err(|e| e.failure_into_comm())?;
    Ok(times.into_iter().fold(0.0, f64::max))
}

const OPS: [&str; 4] = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"];

fn print_line(
    backend: &str,
    checked: bool,
    op: &str,
    bytes: usize,
    world: usize,
    t: f64,
    memcpy: f64,
) {
    let algbw = bytes as f64 / t / 1e9;
    let n = world as f64;
    let factor = match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "broadcast" => 1.0,
        _ => (n - 1.0) / n,
    };
    println!(
        "{{\"backend\":\"{backend}\",\"checked\":{checked},\"op\":\"{op}\",\"dtype\":\"f32\",\"bytes\":{bytes},\"world\":{world},\"time_us\":{:.1},\"algbw_gbps\":{algbw:.3},\"busbw_gbps\":{:.3},\"memcpy_gbps\":{memcpy:.3},\"algbw_over_memcpy\":{:.3}}}",
        t * 1e6,
        algbw * factor,
        algbw / memcpy
    );
}

/// One rank per process under mpirun: every rank times, rank 0 prints the slowest median.
#[cfg(feature = "mpi")]
fn bench_mpi(sizes: &[usize], stage_bytes: Option<usize>) -> anyhow::Result<()> {
    use kiln_comm::{Mpi, MpiCommConfig};
    let mpi = Mpi::init()?;
    let config = MpiCommConfig {
        stage_bytes: stage_bytes.unwrap_or(MpiCommConfig::default().stage_bytes),
        ..MpiCommConfig::default()
    };
    let checked = mpi.world(config)?;
    let unchecked = mpi.world(MpiCommConfig {
        check: false,
        ..config
    })?;
    let world = checked.world_size();
    for &bytes in sizes {
        let memcpy = memcpy_gbps(bytes);
        for op in OPS {
            for (comm, is_checked) in [(&checked, true), (&unchecked, false)] {
                let t = time_on(comm, op, bytes)?;
                let slowest = checked.all_reduce_scalar(t, ReduceOp::Max)?;
                if checked.rank() == 0 {
                    print_line("mpi", is_checked, op, bytes, world, slowest, memcpy);
                }
            }
        }
    }
    // the thread backend at the same world size, on rank 0's process, for comparison in the
    // same run (the other processes wait in a barrier, which sleeps between polls)
    if checked.rank() == 0 {
        for &bytes in sizes {
            let memcpy = memcpy_gbps(bytes);
            for op in OPS {
                let t = time_op(op, world, bytes)?;
                print_line("thread", true, op, bytes, world, t, memcpy);
            }
        }
    }
    checked.barrier()?;
    drop((checked, unchecked));
    drop(mpi);
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn bench_mpi(_sizes: &[usize], _stage_bytes: Option<usize>) -> anyhow::Result<()> {
    anyhow::bail!("--backend mpi needs the mpi feature: cargo build --release --features mpi -p kiln-bench --bin bench_comm")
}

/// One rank per process and GPU over NCCL: device buffers, results checked, then timed; rank 0
/// prints the slowest rank's median.
#[cfg(feature = "nccl")]
fn bench_nccl(sizes: &[usize]) -> anyhow::Result<()> {
    let env = kiln_launch::LaunchEnv::from_env()?;
    let comm = kiln_launch::nccl_from_env(&env, 0, std::time::Duration::from_secs(120))?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    // correctness on device buffers first: rank r holds r + 1
    let n = 1000 * world + 7;
    let mine = vec![(rank + 1) as f32; n];
    let mut d = stream.clone_htod(&mine)?;
    comm.all_reduce_device(&mut d, ReduceOp::Sum)?;
    let want = (world * (world + 1) / 2) as f32;
    anyhow::ensure!(
        stream.clone_dtoh(&d)?.iter().all(|&v| v == want),
        "all_reduce_device: expected {want} everywhere"
    );
    let c = n / world;
    let input = stream.clone_htod(&mine[..c * world])?;
    let mut out = stream.alloc_zeros::<f32>(c)?;
    comm.reduce_scatter_device(&input, &mut out, ReduceOp::Sum)?;
    anyhow::ensure!(
        stream.clone_dtoh(&out)?.iter().all(|&v| v == want),
        "reduce_scatter_device: expected {want}"
    );
    let part = stream.clone_htod(&vec![rank as f32; c])?;
    let mut all = stream.alloc_zeros::<f32>(c * world)?;
    comm.all_gather_device(&part, &mut all)?;
    let got = stream.clone_dtoh(&all)?;
    anyhow::ensure!(
        (0..world).all(|r| got[r * c..(r + 1) * c].iter().all(|&v| v == r as f32)),
        "all_gather_device: rank r's chunk must hold r"
    );
    // the host-slice path with uneven chunks, as the engine's control collectives use it
    let mut host = vec![(rank + 1) as f64; 5];
    comm.all_reduce(&mut host, ReduceOp::Avg)?;
    anyhow::ensure!(
        host.iter().all(|&v| v == (world + 1) as f64 / 2.0),
        "host all_reduce Avg"
    );
    if rank == 0 {
        println!("{{\"backend\":\"nccl\",\"world\":{world},\"checks\":\"passed\"}}");
    }
    for &bytes in sizes {
        let memcpy = memcpy_gbps(bytes);
        let n = (bytes / 4).div_ceil(world) * world;
        for op in OPS {
            let mut buf = stream.alloc_zeros::<f32>(n)?;
            let mut shard = stream.alloc_zeros::<f32>(n / world)?;
            let reps = reps_for(bytes);
            let mut times = Vec::with_capacity(reps);
            for rep in 0..reps + 1 {
                comm.barrier()?;
                let t = Instant::now();
                match op {
                    "all_reduce" => comm.all_reduce_device(&mut buf, ReduceOp::Sum)?,
                    "reduce_scatter" => {
                        comm.reduce_scatter_device(&buf, &mut shard, ReduceOp::Sum)?
                    }
                    "all_gather" => comm.all_gather_device(&shard, &mut buf)?,
                    _ => comm.broadcast_device(&mut buf, 0)?,
                }
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let slowest = comm.all_reduce_scalar(median(times), ReduceOp::Max)?;
            if rank == 0 {
                print_line("nccl", false, op, n * 4, world, slowest, memcpy);
            }
        }
    }
    Ok(())
}

#[cfg(not(feature = "nccl"))]
fn bench_nccl(_sizes: &[usize]) -> anyhow::Result<()> {
    anyhow::bail!("--backend nccl needs the nccl feature: cargo build --release --features nccl -p kiln-bench --bin bench_comm")
}

trait IntoComm {
    fn failure_into_comm(self) -> CommError;
}

impl IntoComm for kiln_comm::RankError<CommError> {
    fn failure_into_comm(self) -> CommError {
        match self.failure {
            kiln_comm::RankFailure::Error(e) => e,
            kiln_comm::RankFailure::Panicked(m) => CommError::Config(m),
        }
    }
}

/// Bandwidth of kiln-comm's backends in NCCL's terms (algbw, busbw) beside memcpy; one JSON
/// line per (backend, op, bytes, world).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "bench_comm")]
struct Args {
    /// Fewer sizes (1 MiB and 64 MiB)
    #[arg(long)]
    quick: bool,
    /// The backend: thread (2, 4 and 8 ranks in this process), mpi (under mpirun) or nccl
    /// (one process per GPU)
    #[arg(long, value_name = "BACKEND", default_value = "thread")]
    backend: String,
    /// The MPI backend's round size in KiB (MpiCommConfig::stage_bytes)
    #[arg(long, value_name = "KIB")]
    stage_kib: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (quick, backend, stage_kib) = (args.quick, args.backend.as_str(), args.stage_kib);
    let sizes: Vec<usize> = if quick {
        vec![1 << 20, 64 << 20]
    } else {
        vec![4 << 10, 256 << 10, 4 << 20, 64 << 20]
    };
    match backend {
        "thread" => {}
        "mpi" => return bench_mpi(&sizes, stage_kib.map(|k| k << 10)),
        "nccl" => return bench_nccl(&sizes),
        other => anyhow::bail!("unknown --backend {other}: expected thread, mpi or nccl"),
    }
    let worlds = [2usize, 4, 8];
    for &bytes in &sizes {
        let memcpy = memcpy_gbps(bytes);
        for &world in &worlds {
            for op in OPS {
                let t = time_op(op, world, bytes)?;
                print_line("thread", true, op, bytes, world, t, memcpy);
            }
        }
    }
    Ok(())
}
