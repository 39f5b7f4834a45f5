//! Async saves whose copy runs on the writer thread: [`Guarded`] (a component the training
//! loop and the checkpoint writer share) and [`Snapshot`] (what one rank hands to
//! [`crate::Checkpointer::save_async_snapshot`]: parts copied now and parts copied later).
//!
//! A deferred part is leased when it is added to the snapshot, on the caller's thread: from
//! then until the writer thread has copied it, [`Guarded::write`] waits, while
//! [`Guarded::read`] never does. The checkpoint therefore holds the value the component had
//! when [`Snapshot::defer`] returned, and an update made after it can never reach the file;
//! the loop only waits if it wants to write before the copy is done.

use crate::error::{CkptError, Result};
use crate::state::RankState;
use kiln_comm::Communicator;
use kiln_state::{StateDict, Stateful};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::sync::{RwLockWriteGuard, TryLockError};
use std::thread::ThreadId;

/// Who may touch a [`Guarded`] value: the leases not yet copied and the writer, if any.
#[derive(Debug, Default)]
struct Gate {
    leases: usize,
    writer: Option<ThreadId>,
}

struct Inner<T> {
    value: RwLock<T>,
    gate: Mutex<Gate>,
    turn: Condvar,
}

impl<T> Inner<T> {
    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Gate>) -> MutexGuard<'a, Gate> {
        self.turn.wait(g).unwrap_or_else(PoisonError::into_inner)
    }
}

/// A component shared between the training loop and the checkpoint writer thread.
///
/// Reads ([`Guarded::read`]) never wait for a checkpoint; a write ([`Guarded::write`]) waits
/// until every [`Snapshot`] that deferred this component has copied it. Cloning is cheap and
/// shares the value. A panic while a guard is held does not poison the value.
pub struct Guarded<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for Guarded<T> {
    fn clone(&self) -> Self {
        Guarded {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> std::fmt::Debug for Guarded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.inner.gate();
        f.debug_struct("Guarded")
            .field("leases", &g.leases)
            .field("writing", &g.writer.is_some())
            .finish()
    }
}

impl<T> Guarded<T> {
    /// Wraps `value`.
    pub fn new(value: T) -> Self {
        Guarded {
            inner: Arc::new(Inner {
                value: RwLock::new(value),
                gate: Mutex::new(Gate::default()),
                turn: Condvar::new(),
            }),
        }
    }

    /// Shared access; waits only for a writer.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.inner
            .value
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Exclusive access; waits until no deferred copy of this value is pending and no other
    /// writer holds it.
    pub fn write(&self) -> GuardedWrite<'_, T> {
        let mut g = self.inner.gate();
        while g.leases > 0 || g.writer.is_some() {
            g = self.inner.wait(g);
        }
        g.writer = Some(std::thread::current().id());
        drop(g);
        let guard = self
            .inner
            .value
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        GuardedWrite {
            guard,
            inner: &self.inner,
        }
    }

    /// Exclusive access if it is available now: `None` while a deferred copy is pending or
    /// another guard is held.
    pub fn try_write(&self) -> Option<GuardedWrite<'_, T>> {
        let mut g = self.inner.gate();
        if g.leases > 0 || g.writer.is_some() {
            return None;
        }
        let guard = match self.inner.value.try_write() {
            Ok(w) => w,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        g.writer = Some(std::thread::current().id());
        Some(GuardedWrite {
            guard,
            inner: &self.inner,
        })
    }

    /// How many deferred copies of this value are still pending.
    pub fn pending_copies(&self) -> usize {
        self.inner.gate().leases
    }

    /// Consumes the wrapper and returns the value if no clone and no pending copy shares it.
    pub fn into_inner(self) -> std::result::Result<T, Self> {
        match Arc::try_unwrap(self.inner) {
            Ok(inner) => Ok(inner
                .value
                .into_inner()
                .unwrap_or_else(PoisonError::into_inner)),
            Err(inner) => Err(Guarded { inner }),
        }
    }
}

impl<T: Stateful + Send + Sync + 'static> Guarded<T> {
    /// Leases the current value for a copy made later, on any thread: until the returned
    /// lease is copied or dropped, writes wait. Waits for a writer on another thread to
    /// finish; a write guard held by this thread is [`CkptError::Config`] (it would never be
    /// released).
    fn lease(&self) -> Result<Lease> {
        let me = std::thread::current().id();
        let mut g = self.inner.gate();
        loop {
            match g.writer {
                Some(w) if w == me => return Err(CkptError::Config(
                    "cannot defer a component this thread is writing: drop its write guard first"
                        .to_string(),
                )),
                Some(_) => g = self.inner.wait(g),
                None => break,
            }
        }
        g.leases += 1;
        drop(g);
        let source: Arc<dyn Leased> = Arc::clone(&self.inner) as Arc<dyn Leased>;
        Ok(Lease {
            source: Some(source),
        })
    }
}

/// Exclusive access to a [`Guarded`] value; dropping it lets deferred copies lease the value
/// again.
pub struct GuardedWrite<'a, T> {
    guard: RwLockWriteGuard<'a, T>,
    inner: &'a Inner<T>,
}

impl<T> Deref for GuardedWrite<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for GuardedWrite<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for GuardedWrite<'_, T> {
    /// Opens the gate; the value's own lock is released right after (by the field's drop),
    /// and a copy leased in between waits for it, so it reads the finished write.
    fn drop(&mut self) {
        self.inner.gate().writer = None;
        self.inner.turn.notify_all();
    }
}

/// What a lease needs of the leased value, whatever its type.
trait Leased: Send + Sync {
    fn copy_state(&self) -> kiln_state::Result<StateDict>;
    fn release(&self);
}

impl<T: Stateful + Send + Sync> Leased for Inner<T> {
    fn copy_state(&self) -> kiln_state::Result<StateDict> {
        self.value
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .state()
    }

    fn release(&self) {
        let mut g = self.gate();
        g.leases = g.leases.saturating_sub(1);
        drop(g);
        self.turn.notify_all();
    }
}

/// A claim on a [`Guarded`] value that blocks its writers until copied or dropped.
struct Lease {
    source: Option<Arc<dyn Leased>>,
}

impl Lease {
    /// Copies the leased value's state and releases the lease.
    fn copy(mut self) -> Result<StateDict> {
        let Some(src) = self.source.take() else {
            return Err(CkptError::Config("lease already released".to_string()));
        };
        let out = src.copy_state();
        src.release();
        Ok(out?)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(src) = self.source.take() {
            src.release();
        }
    }
}

/// A part's state built on the checkpoint writer's thread, given the writer's communicator.
type Build = Box<dyn FnOnce(&dyn Communicator) -> Result<StateDict> + Send>;

/// What one rank hands to [`crate::Checkpointer::save_async_snapshot`]: parts copied when
/// added ([`Snapshot::capture`], [`Snapshot::insert`]), parts deferred to the writer
/// thread ([`Snapshot::defer`]), which copies each as its first job and then releases it, and
/// parts the writer thread builds ([`Snapshot::build_later`]).
///
/// Dropping a snapshot releases its leases.
#[derive(Default)]
pub struct Snapshot {
    state: RankState,
    deferred: Vec<(String, Lease)>,
    built: Vec<(String, Build)>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("copied", &self.state.part_names().collect::<Vec<_>>())
            .field(
                "deferred",
                &self.deferred.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "built",
                &self.built.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl From<RankState> for Snapshot {
    fn from(state: RankState) -> Self {
        Snapshot {
            state,
            deferred: Vec::new(),
            built: Vec::new(),
        }
    }
}

impl Snapshot {
    /// An empty snapshot.
    pub fn new() -> Self {
        Self::default()
    }

    fn check_new(&self, part: &str) -> Result<()> {
        crate::state::check_part_name(part)?;
        if self.state.part(part).is_some()
            || self.deferred.iter().any(|(n, _)| n == part)
            || self.built.iter().any(|(n, _)| n == part)
        {
            return Err(CkptError::Config(format!(
                "part {part} is already in the snapshot"
            )));
        }
        Ok(())
    }

    /// Adds a part copied now (see [`RankState::insert`]).
    pub fn insert(&mut self, part: &str, state: StateDict) -> Result<()> {
        self.check_new(part)?;
        self.state.insert(part, state)
    }

    /// Adds a part copied now from a component's [`Stateful::state`].
    pub fn capture(&mut self, part: &str, component: &dyn Stateful) -> Result<()> {
        self.check_new(part)?;
        self.state.capture(part, component)
    }

    /// Adds a part whose copy the writer thread makes: the component is leased now, so the
    /// checkpoint holds its current value, and [`Guarded::write`] waits until the copy is
    /// done. Waits for a write guard held by another thread; one held by this thread is
    /// [`CkptError::Config`].
    pub fn defer<T: Stateful + Send + Sync + 'static>(
        &mut self,
        part: &str,
        component: &Guarded<T>,
    ) -> Result<()> {
        self.check_new(part)?;
        let lease = component.lease()?;
        self.deferred.push((part.to_string(), lease));
        Ok(())
    }

    /// Adds a part whose state the writer thread builds, after the deferred copies, by calling
    /// `build` with its own communicator: the ranks and order of the one the save is called
    /// with, free for collectives that must not interleave with the training loop's. For state
    /// the caller has already copied (into buffers it reuses from save to save) but whose
    /// checkpoint form costs more to make, such as a sharded engine's gathers over its
    /// data-parallel group.
    ///
    /// Where `build` is collective, every rank must add the same built parts in the same
    /// order; the writer runs every built part even when an earlier part failed, so that no
    /// rank is left waiting in a collective.
    pub fn build_later(
        &mut self,
        part: &str,
        build: impl FnOnce(&dyn Communicator) -> Result<StateDict> + Send + 'static,
    ) -> Result<()> {
        self.check_new(part)?;
        self.built.push((part.to_string(), Box::new(build)));
        Ok(())
    }

    /// Names of the parts, copied, deferred and built later, sorted.
    pub fn part_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .state
            .part_names()
            .map(str::to_string)
            .chain(self.deferred.iter().map(|(n, _)| n.clone()))
            .chain(self.built.iter().map(|(n, _)| n.clone()))
            .collect();
        names.sort();
        names
    }

    /// Copies the deferred parts (each released as soon as it is copied, the rest released
    /// even if one fails) and returns the whole state. A snapshot with parts built later
    /// needs [`Snapshot::into_state_with`].
    pub fn into_state(self) -> Result<RankState> {
        if let Some((part, _)) = self.built.first() {
            return Err(CkptError::Config(format!(
                "part {part} is built with a communicator: use into_state_with"
            )));
        }
        self.finish(None)
    }

    /// [`Snapshot::into_state`], then builds the parts added with [`Snapshot::build_later`]
    /// with `comm`, every one of them even if an earlier part failed; the first error is
    /// returned.
    pub fn into_state_with(self, comm: &dyn Communicator) -> Result<RankState> {
        self.finish(Some(comm))
    }

    fn finish(self, comm: Option<&dyn Communicator>) -> Result<RankState> {
        let Snapshot {
            mut state,
            deferred,
            built,
        } = self;
        let mut first_err = None;
        for (part, lease) in deferred {
            if first_err.is_some() {
                drop(lease);
                continue;
            }
            match lease.copy().and_then(|sd| state.insert(&part, sd)) {
                Ok(()) => {}
                Err(e) => first_err = Some(e),
            }
        }
        if let Some(comm) = comm {
            for (part, build) in built {
                let made = build(comm).and_then(|sd| state.insert(&part, sd));
                if let (Err(e), None) = (made, &first_err) {
                    first_err = Some(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(state),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_state::Step;
    use std::time::Duration;

    #[test]
    fn a_deferred_copy_holds_the_value_at_defer_and_blocks_writes_until_copied() {
        let w = Guarded::new(Step(3));
        let mut snap = Snapshot::new();
        snap.defer("step", &w).unwrap();
        assert_eq!(w.pending_copies(), 1);
        assert!(w.try_write().is_none());
        // reads are not blocked
        assert_eq!(*w.read(), Step(3));
        let w2 = w.clone();
        let writer = std::thread::spawn(move || {
            let mut g = w2.write();
            *g = Step(4);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(*w.read(), Step(3), "the write waited for the copy");
        let st = snap.into_state().unwrap();
        writer.join().unwrap();
        assert_eq!(*w.read(), Step(4));
        assert_eq!(w.pending_copies(), 0);
        let mut got = Step(0);
        st.restore_all(&mut [("step", &mut got)], Default::default())
            .unwrap();
        assert_eq!(got, Step(3));
    }

    #[test]
    fn dropping_a_snapshot_releases_and_own_write_guard_is_an_error() {
        let w = Guarded::new(Step(1));
        let mut snap = Snapshot::new();
        snap.defer("a", &w).unwrap();
        assert!(matches!(snap.defer("a", &w), Err(CkptError::Config(_))));
        drop(snap);
        assert_eq!(w.pending_copies(), 0);
        let g = w.write();
        let mut snap = Snapshot::new();
        assert!(matches!(snap.defer("a", &w), Err(CkptError::Config(_))));
        drop(g);
        snap.defer("a", &w).unwrap();
        snap.capture("b", &Step(2)).unwrap();
        assert_eq!(snap.part_names(), ["a", "b"]);
        assert!(matches!(
            snap.capture("b", &Step(2)),
            Err(CkptError::Config(_))
        ));
        let st = snap.into_state().unwrap();
        assert_eq!(st.part_names().collect::<Vec<_>>(), ["a", "b"]);
        assert!(w.try_write().is_some());
        assert_eq!(w.into_inner().unwrap(), Step(1));
    }
}
