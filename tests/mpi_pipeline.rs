//! Pipeline parallelism on MPI processes under real `mpirun`: every rank trains its stage of a
//! pipelined GPT (`small_cpu`, f32, tied embeddings, 4 micro-batches of 2 sequences per step and
//! data-parallel rank) and checks its losses, gradient norms and stage parameters bitwise
//! against the one-stage pipeline with the same dp and tp, computed on thread ranks.
//!
//! The cases (the `PipeRun`s of `pipeline_gpt.rs`, the thread suite):
//! - `mpirun -np 4`: pp 4 with GPipe, 1F1B, ZB-H1 and interleaved with v = 2 (the last on
//!   `small_cpu` with 8 blocks, for its 8 model stages; each against one rank), and dp 2 x pp 2
//!   ZeRO-1 with every schedule (interleaved with v = 2; each against dp 2 ZeRO-1 at pp 1),
//!   5 steps each, one after the other in the same processes;
//! - `mpirun -np 8`: dp 2 x tp 2 x pp 2 ZeRO-1 with 1F1B against dp 2 x tp 2 ZeRO-1 at pp 1,
//!   5 steps too (8 processes share a 2-core machine four to one, and still finish in about
//!   half a minute).
//!
//! The driver (this binary without `KILN_PIPE_ROLE`) computes each reference on thread ranks
//! (`kiln_testkit::run_ranks`), writes it to a file in a temporary folder, launches itself under
//! `mpirun` and checks that every rank printed `rank R: pipeline ok`. Each rank compares what
//! it holds with the reference rank at its (dp, tp) coordinate: the losses (the last stage's,
//! reported on every rank), the global gradient norms, and every parameter of its stage (the
//! tied embedding on both ends).
//!
//! Measured on the 2-core test machine (release build, the build not counted), with nothing
//! else running: 37 s in all (the references 3.8 s and 2.1 s, `-np 4` with its seven cases
//! 21 s, `-np 8` 9 s). With four cases at `-np 4`, while other builds loaded the machine
//! (load average 6), it took 84 s.
//!
//! `cargo test --release --features mpi --test mpi_pipeline`. Without mpirun it says so and
//! passes, except under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::pipeline::{train_pipeline_rank, PipeRankRun, PipeRun};
use kiln_comm::{Communicator, Mpi, MpiCommConfig, ThreadComm};
use kiln_model::GptConfig;
use kiln_parallel::pipeline::ScheduleKind;
use kiln_parallel::{DataParallelConfig, ZeroStage};
use kiln_testkit::{mpirun_path, mpirun_self, run_ranks};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One pipelined run and the one-stage reference it must equal.
struct Case {
    name: &'static str,
    run: PipeRun,
    stage: ZeroStage,
    /// Blocks of the `small_cpu` model (8 where pp x v is 8).
    layers: usize,
}

impl Case {
    /// The one-stage pipeline with the same dp, tp, micro-batches and steps.
    fn reference(&self) -> PipeRun {
        PipeRun {
            pp: 1,
            kind: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            ..self.run
        }
    }

    /// The reference's file name: one per (dp, tp, ZeRO stage, steps, blocks).
    fn reference_file(&self) -> String {
        let r = self.reference();
        format!(
            "ref_dp{}_tp{}_{:?}_s{}_l{}.bin",
            r.dp, r.tp, self.stage, r.steps, self.layers
        )
    }

    /// `small_cpu` with this case's blocks.
    fn config(&self) -> GptConfig {
        let mut cfg = GptConfig::small_cpu();
        cfg.n_layers = self.layers;
        cfg
    }
}

fn run(dp: usize, tp: usize, pp: usize, kind: ScheduleKind, steps: usize) -> PipeRun {
    PipeRun {
        dp,
        tp,
        pp,
        kind,
        virtual_stages: if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        },
        micro_batches: 4,
        fp16: false,
        steps,
    }
}

/// The cases of `mpirun -np np`.
fn cases(np: usize) -> Vec<Case> {
    use ScheduleKind::{GPipe, Interleaved, OneFOneB, ZbH1};
    match np {
        4 => vec![
            Case {
                name: "gpipe pp4",
                run: run(1, 1, 4, GPipe, 5),
                stage: ZeroStage::Replicated,
                layers: 4,
            },
            Case {
                name: "1f1b pp4",
                run: run(1, 1, 4, OneFOneB, 5),
                stage: ZeroStage::Replicated,
                layers: 4,
            },
            Case {
                name: "zb_h1 pp4",
                run: run(1, 1, 4, ZbH1, 5),
                stage: ZeroStage::Replicated,
                layers: 4,
            },
            Case {
                name: "interleaved v2 pp4 (8 blocks)",
                run: run(1, 1, 4, Interleaved, 5),
                stage: ZeroStage::Replicated,
                layers: 8,
            },
            Case {
                name: "1f1b dp2 x pp2 ZeRO-1",
                run: run(2, 1, 2, OneFOneB, 5),
                stage: ZeroStage::Zero1,
                layers: 4,
            },
            Case {
                name: "gpipe dp2 x pp2 ZeRO-1",
                run: run(2, 1, 2, GPipe, 5),
                stage: ZeroStage::Zero1,
                layers: 4,
            },
            Case {
                name: "zb_h1 dp2 x pp2 ZeRO-1",
                run: run(2, 1, 2, ZbH1, 5),
                stage: ZeroStage::Zero1,
                layers: 4,
            },
            Case {
                name: "interleaved v2 dp2 x pp2 ZeRO-1",
                run: run(2, 1, 2, Interleaved, 5),
                stage: ZeroStage::Zero1,
                layers: 4,
            },
        ],
        8 => vec![Case {
            name: "1f1b dp2 x tp2 x pp2 ZeRO-1",
            run: run(2, 2, 2, OneFOneB, 5),
            stage: ZeroStage::Zero1,
            layers: 4,
        }],
        _ => Vec::new(),
    }
}

fn dpc(stage: ZeroStage) -> DataParallelConfig {
    DataParallelConfig {
        stage,
        max_grad_norm: Some(1.0),
        ..Default::default()
    }
}

fn main() {
    match std::env::var("KILN_MPI_TEST") {
        Ok(role) => rank(&role),
        Err(_) => driver(),
    }
}

fn driver() {
    println!("pipeline parallelism on MPI processes");
    let Some(bin) = mpirun_path() else { return };
    let dir = std::env::temp_dir().join(format!("kiln_mpi_pipeline_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let start = Instant::now();
    for np in [4usize, 8] {
        let t = Instant::now();
        for c in cases(np) {
            let path = dir.join(c.reference_file());
            if !path.exists() {
                let want = reference(&c);
                write_runs(&path, &want);
            }
        }
        println!("  references for -np {np}: {:.1?}", t.elapsed());
        let dir_s = dir.to_string_lossy().into_owned();
        let run = mpirun_self(
            &bin,
            np,
            &np.to_string(),
            &[("KILN_PIPE_REFS", &dir_s)],
            Duration::from_secs(600),
        );
        print!("{}", run.stdout);
        assert!(run.success(), "mpirun -np {np}: {}", run.output());
        assert_eq!(
            run.ranks_saying("pipeline ok"),
            (0..np).collect::<Vec<_>>(),
            "mpirun -np {np}: not every rank passed: {}",
            run.output()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "pipeline parallelism on MPI processes: every rank of -np 4 and -np 8 bitwise equal to \
         its one-stage reference ({:.1?} in all)",
        start.elapsed()
    );
}

/// The one-stage reference of `c`, on thread ranks.
fn reference(c: &Case) -> Vec<PipeRankRun> {
    let r = c.reference();
    let cfg = c.config();
    let stage = c.stage;
    run_ranks(r.dp * r.tp, |comm: ThreadComm| {
        let w: Arc<dyn Communicator> = Arc::new(comm);
        train_pipeline_rank(w, &cfg, r, dpc(stage), None)
    })
}

fn rank(role: &str) {
    let np: usize = role
        .parse()
        .expect("KILN_MPI_TEST is the number of processes");
    let refs = PathBuf::from(std::env::var("KILN_PIPE_REFS").expect("KILN_PIPE_REFS"));
    let mpi = Mpi::init().unwrap();
    let world: Arc<dyn Communicator> = Arc::new(mpi.world(MpiCommConfig::default()).unwrap());
    let r = world.rank();
    for c in cases(np) {
        let t = Instant::now();
        let outcome = train_pipeline_rank(world.clone(), &c.config(), c.run, dpc(c.stage), None)
            .map_err(|e| format!("{e:#}"))
            .and_then(|got| {
                let want = read_runs(&refs.join(c.reference_file()))?;
                compare(&got, &want)
            });
        match outcome {
            Ok(n) => println!(
                "rank {r}: {}: bitwise the one-stage run ({n} parameters, {} steps) in {:.1?}",
                c.name,
                c.run.steps,
                t.elapsed()
            ),
            Err(e) => {
                println!("rank {r}: FAILED: {}: {e}", c.name);
                std::process::exit(1);
            }
        }
    }
    println!("rank {r}: pipeline ok");
}

/// `got` (one pipeline rank) against the reference rank at its (dp, tp) coordinate: losses,
/// norms and every parameter it holds, bitwise. The number of parameters compared.
fn compare(got: &PipeRankRun, want: &[PipeRankRun]) -> Result<usize, String> {
    let w = want
        .iter()
        .find(|w| (w.dp_rank, w.tp_rank) == (got.dp_rank, got.tp_rank))
        .ok_or_else(|| format!("no reference rank at dp {} tp {}", got.dp_rank, got.tp_rank))?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&got.losses) != bits(&w.losses) {
        return Err(format!("losses {:?} vs {:?}", got.losses, w.losses));
    }
    let nbits = |v: &[Option<f64>]| v.iter().map(|x| x.map(f64::to_bits)).collect::<Vec<_>>();
    if nbits(&got.norms) != nbits(&w.norms) {
        return Err(format!(
            "gradient norms on stage {}: {:?} vs {:?}",
            got.pp_rank, got.norms, w.norms
        ));
    }
    let want_params: HashMap<&str, &Vec<f32>> =
        w.params.iter().map(|(n, v)| (n.as_str(), v)).collect();
    if got.params.is_empty() {
        return Err(format!("stage {} holds no parameters", got.pp_rank));
    }
    for (n, gv) in &got.params {
        let wv = want_params
            .get(n.as_str())
            .ok_or_else(|| format!("{n}: not in the reference"))?;
        if gv.len() != wv.len() {
            return Err(format!("{n}: length {} vs {}", gv.len(), wv.len()));
        }
        if let Some(i) = gv
            .iter()
            .zip(wv.iter())
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            return Err(format!(
                "{n}[{i}] on stage {}: {} vs {}",
                got.pp_rank, gv[i], wv[i]
            ));
        }
    }
    Ok(got.params.len())
}

// The reference file: per rank its coordinates, losses, norms and parameters, little-endian
// (u64 counts, f32 and f64 as their bits), so that every value travels exactly.

fn put(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn write_runs(path: &Path, runs: &[PipeRankRun]) {
    let mut out = Vec::new();
    put(&mut out, runs.len() as u64);
    for r in runs {
        for x in [
            r.pp_rank,
            r.dp_rank,
            r.tp_rank,
            r.losses.len(),
            r.norms.len(),
        ] {
            put(&mut out, x as u64);
        }
        for l in &r.losses {
            out.extend_from_slice(&l.to_le_bytes());
        }
        for n in &r.norms {
            out.push(u8::from(n.is_some()));
            out.extend_from_slice(&n.unwrap_or(0.0).to_le_bytes());
        }
        put(&mut out, r.params.len() as u64);
        for (name, v) in &r.params {
            put(&mut out, name.len() as u64);
            out.extend_from_slice(name.as_bytes());
            put(&mut out, v.len() as u64);
            for x in v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    std::fs::write(path, out).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let s = self
            .buf
            .get(self.at..self.at + n)
            .ok_or_else(|| format!("reference file truncated at byte {}", self.at))?;
        self.at += n;
        Ok(s)
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    fn usize(&mut self) -> Result<usize, String> {
        Ok(self.u64()? as usize)
    }

    fn f32(&mut self) -> Result<f32, String> {
        Ok(f32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
}

fn read_runs(path: &Path) -> Result<Vec<PipeRankRun>, String> {
    let buf = std::fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    let mut r = Reader { buf: &buf, at: 0 };
    let n = r.usize()?;
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let (pp_rank, dp_rank, tp_rank) = (r.usize()?, r.usize()?, r.usize()?);
        let (nl, nn) = (r.usize()?, r.usize()?);
        let losses = (0..nl).map(|_| r.f32()).collect::<Result<Vec<_>, _>>()?;
        let mut norms = Vec::with_capacity(nn);
        for _ in 0..nn {
            let some = r.take(1)?[0] == 1;
            let v = f64::from_bits(r.u64()?);
            norms.push(some.then_some(v));
        }
        let np = r.usize()?;
        let mut params = Vec::with_capacity(np);
        for _ in 0..np {
            let len = r.usize()?;
            let name = String::from_utf8(r.take(len)?.to_vec()).map_err(|e| e.to_string())?;
            let len = r.usize()?;
            let v = (0..len).map(|_| r.f32()).collect::<Result<Vec<_>, _>>()?;
            params.push((name, v));
        }
        runs.push(PipeRankRun {
            pp_rank,
            dp_rank,
            tp_rank,
            params,
            losses,
            norms,
            skipped: Vec::new(),
            weight_segments: 0,
        });
    }
    if r.at != buf.len() {
        return Err(format!(
            "{}: {} bytes after the last rank",
            path.display(),
            buf.len() - r.at
        ));
    }
    Ok(runs)
}
