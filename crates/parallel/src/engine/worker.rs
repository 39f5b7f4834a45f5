//! The communication thread of the data-parallel engine.

use crate::error::{ParallelError, Result};
use crossbeam::channel::{unbounded, Receiver, Sender};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use std::thread::JoinHandle;

pub(super) enum Job {
    AllReduce {
        unit: usize,
        buf: Vec<f32>,
    },
    ReduceScatter {
        unit: usize,
        buf: Vec<f32>,
        shard: Vec<f32>,
        accumulate: bool,
    },
}

pub(super) enum Done {
    AllReduce {
        unit: usize,
        buf: Vec<f32>,
    },
    ReduceScatter {
        unit: usize,
        buf: Vec<f32>,
        shard: Vec<f32>,
    },
}

/// The communication thread: owns its own data-parallel communicator, so its collectives never
/// interleave with the main thread's (parameter gathers, norms).
pub(super) struct Worker {
    jobs: Option<Sender<Job>>,
    done: Receiver<std::result::Result<Done, kiln_comm::CommError>>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    pub(super) fn start(comm: Box<dyn Communicator>) -> Result<Self> {
        let (jobs_tx, jobs_rx) = unbounded::<Job>();
        let (done_tx, done_rx) = unbounded();
        let rank = comm.rank();
        let handle = std::thread::Builder::new()
            .name(format!("kiln-dp-comm-{rank}"))
            .spawn(move || {
                let mut tmp: Vec<f32> = Vec::new();
                for job in jobs_rx {
                    let out = match job {
                        Job::AllReduce { unit, mut buf } => comm
                            .all_reduce(&mut buf, ReduceOp::Avg)
                            .map(|_| Done::AllReduce { unit, buf }),
                        Job::ReduceScatter {
                            unit,
                            buf,
                            mut shard,
                            accumulate,
                        } => {
                            let res = if accumulate {
                                tmp.resize(shard.len(), 0.0);
                                comm.reduce_scatter(&buf, &mut tmp, ReduceOp::Avg).map(|_| {
                                    for (s, t) in shard.iter_mut().zip(&tmp) {
                                        *s += *t;
                                    }
                                })
                            } else {
                                comm.reduce_scatter(&buf, &mut shard, ReduceOp::Avg)
                            };
                            res.map(|_| Done::ReduceScatter { unit, buf, shard })
                        }
                    };
                    let failed = out.is_err();
                    if done_tx.send(out).is_err() || failed {
                        break;
                    }
                }
            })
            .map_err(|e| ParallelError::CommThread {
                rank,
                message: format!("could not start: {e}"),
            })?;
        Ok(Self {
            jobs: Some(jobs_tx),
            done: done_rx,
            handle: Some(handle),
        })
    }

    pub(super) fn send(&self, job: Job, rank: usize) -> Result<()> {
        self.jobs
            .as_ref()
            .ok_or_else(|| ParallelError::CommThread {
                rank,
                message: "already shut down".into(),
            })?
            .send(job)
            .map_err(|_| ParallelError::CommThread {
                rank,
                message: "the thread has exited after an earlier error".into(),
            })
    }

    pub(super) fn recv(&self, rank: usize) -> Result<Done> {
        match self.done.recv() {
            Ok(Ok(d)) => Ok(d),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(ParallelError::CommThread {
                rank,
                message: "the thread has exited".into(),
            }),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
