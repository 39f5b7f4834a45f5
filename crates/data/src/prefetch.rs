//! Background loading: worker threads plan and load batches ahead of the trainer into a bounded
//! crossbeam channel; the consumer puts them back in order.
//!
//! Workers take jobs in order from one planner (under a lock: planning is cheap, loading is not)
//! and never run more than `depth` batches ahead of the consumer. Results may arrive out of
//! order; the consumer holds early ones in a reorder buffer, so the sequence of batches is the
//! same for any number of workers. A worker error or panic comes back as an error naming the
//! worker, the batch and the sample; a batch that does not arrive within the stall timeout is
//! reported with the worker holding it and the sample it is on: never a silent hang.

use crate::batch::Batch;
use crate::error::{DataError, Result};
use crate::plan::{load_batch, LoadCtx, PlanPos, Planner};
use crate::sample::SampleId;
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Delivered = Result<(Batch, PlanPos)>;

struct Control {
    planner: Planner,
    /// Workers may plan steps below this.
    limit: u64,
    stop: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct WorkerStatus {
    batch: Option<u64>,
    sample: Option<SampleId>,
}

struct Shared {
    ctl: Mutex<Control>,
    cv: Condvar,
    status: Vec<Mutex<WorkerStatus>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The running worker pool of a [`crate::DataLoader`].
pub(crate) struct Prefetcher {
    shared: Arc<Shared>,
    rx: Option<Receiver<(u64, Delivered)>>,
    handles: Vec<JoinHandle<()>>,
    reorder: BTreeMap<u64, Delivered>,
    next: u64,
    depth: u64,
    stall_timeout: Duration,
}

impl Prefetcher {
    /// Starts `workers` threads planning from `planner` (whose step is the next batch to hand
    /// out) at most `depth` batches ahead.
    pub fn start(
        lc: Arc<LoadCtx>,
        planner: Planner,
        workers: usize,
        depth: usize,
        stall_timeout: Duration,
    ) -> Result<Self> {
        let next = planner.step;
        let depth = depth.max(1) as u64;
        let shared = Arc::new(Shared {
            ctl: Mutex::new(Control {
                planner,
                limit: next + depth,
                stop: false,
            }),
            cv: Condvar::new(),
            status: (0..workers)
                .map(|_| Mutex::new(WorkerStatus::default()))
                .collect(),
        });
        let (tx, rx) = channel::bounded(depth as usize);
        let mut p = Prefetcher {
            shared: shared.clone(),
            rx: Some(rx),
            handles: Vec::with_capacity(workers),
            reorder: BTreeMap::new(),
            next,
            depth,
            stall_timeout,
        };
        for w in 0..workers {
            let (shared, lc, tx) = (shared.clone(), lc.clone(), tx.clone());
            let h = std::thread::Builder::new()
                .name(format!("kiln-data-{w}"))
                .spawn(move || worker(w, &shared, &lc, &tx))
                .map_err(|e| DataError::file("spawn worker", format!("kiln-data-{w}"), e))?;
            p.handles.push(h);
        }
        Ok(p)
    }

    /// The next batch in order, with the planning position after it, and whether it was
    /// already staged (no wait).
    pub fn next(&mut self) -> Result<(Batch, PlanPos, bool)> {
        let want = self.next;
        let Some(rx) = self.rx.as_ref() else {
            return Err(DataError::PipelineClosed { batch: want });
        };
        // staged already?
        loop {
            if let Some(d) = self.reorder.remove(&want) {
                return self.deliver(d, true);
            }
            match rx.try_recv() {
                Ok((s, d)) => {
                    self.reorder.insert(s, d);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    return Err(DataError::PipelineClosed { batch: want })
                }
            }
        }
        let start = Instant::now();
        loop {
            let left = self.stall_timeout.saturating_sub(start.elapsed());
            match rx.recv_timeout(left) {
                Ok((s, d)) if s == want => return self.deliver(d, false),
                Ok((s, d)) => {
                    self.reorder.insert(s, d);
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(self.stalled(want, start.elapsed()));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(DataError::PipelineClosed { batch: want })
                }
            }
        }
    }

    fn deliver(&mut self, d: Delivered, staged: bool) -> Result<(Batch, PlanPos, bool)> {
        let (batch, pos) = d?;
        self.next += 1;
        let mut ctl = lock(&self.shared.ctl);
        ctl.limit = self.next + self.depth;
        drop(ctl);
        self.shared.cv.notify_all();
        Ok((batch, pos, staged))
    }

    fn stalled(&self, batch: u64, waited: Duration) -> DataError {
        let holder = self.shared.status.iter().enumerate().find_map(|(w, s)| {
            let s = lock(s);
            (s.batch == Some(batch)).then_some((w, s.sample))
        });
        DataError::Stalled {
            batch,
            worker: holder.map(|h| h.0),
            sample: holder.and_then(|h| h.1),
            waited,
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        lock(&self.shared.ctl).stop = true;
        self.shared.cv.notify_all();
        // a worker blocked sending finds the channel closed
        self.rx = None;
        // Join the workers that finish their current batch in time; one stuck in a transform
        // is left to exit on its own rather than hang the caller.
        let deadline = Instant::now() + self.stall_timeout.min(Duration::from_secs(5));
        for h in std::mem::take(&mut self.handles) {
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

fn worker(w: usize, shared: &Shared, lc: &LoadCtx, tx: &Sender<(u64, Delivered)>) {
    loop {
        let job = {
            let mut ctl = lock(&shared.ctl);
            loop {
                if ctl.stop {
                    return;
                }
                if ctl.planner.step < ctl.limit {
                    break;
                }
                ctl = shared.cv.wait(ctl).unwrap_or_else(|p| p.into_inner());
            }
            let step = ctl.planner.step;
            match ctl.planner.next() {
                Ok(job) => job,
                Err(e) => {
                    // planning cannot go on past this step: report it and stop everyone
                    ctl.stop = true;
                    drop(ctl);
                    shared.cv.notify_all();
                    let _ = tx.send((step, Err(e)));
                    return;
                }
            }
        };
        let status = &shared.status[w];
        *lock(status) = WorkerStatus {
            batch: Some(job.step),
            sample: None,
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            load_batch(lc, &job, |id| lock(status).sample = Some(id))
        }));
        let sample = lock(status).sample;
        *lock(status) = WorkerStatus::default();
        let delivered = match result {
            Ok(Ok(batch)) => Ok((batch, job.after)),
            Ok(Err((sample, e))) => Err(DataError::Worker {
                worker: w,
                batch: job.step,
                sample,
                source: Box::new(e),
            }),
            Err(p) => Err(DataError::WorkerPanicked {
                worker: w,
                batch: job.step,
                sample,
                message: kiln_state::panic_message(p.as_ref()),
            }),
        };
        if tx.send((job.step, delivered)).is_err() {
            return;
        }
    }
}
