//! A per-thread record of the points where the host waits for MLX, so tests can prove that a decode step
//! builds its graph without waiting and that the decode loop waits once per token.
//!
//! Every call through the safe API that waits or starts work is counted on the calling thread:
//! [`eval`](crate::eval) and [`Array::eval`](crate::Array::eval) ([`Kind::Eval`]), reads of the data
//! ([`Array::to_vec`](crate::Array::to_vec), [`Array::item`](crate::Array::item), `to_vec_f32`,
//! `to_string_eval`: [`Kind::Read`], one per call, their own evaluation included), [`synchronize`](crate::synchronize)
//! and [`Stream::synchronize`](crate::Stream::synchronize) ([`Kind::Synchronize`]),
//! [`io::save_safetensors`](crate::io::save_safetensors) (it evaluates what it writes: [`Kind::Eval`]) and
//! [`async_eval`](crate::async_eval) ([`Kind::AsyncEval`], which starts work but does not wait). Counting is
//! always on and costs one thread-local increment per call; the event log, with each call's source location,
//! is kept only between [`start`] and [`stop`].
//!
//! ```no_run
//! use mlx_k3::{sync_trace, Array};
//! let before = sync_trace::counts();
//! let a = Array::from_slice(&[1.0f32, 2.0], &[2])?.add(1.0f32)?; // lazy: no wait
//! assert_eq!(sync_trace::counts().since(&before).host_syncs(), 0);
//! sync_trace::start();
//! let v = a.to_vec::<f32>()?;
//! let events = sync_trace::stop();
//! assert_eq!((v, events.len(), events[0].kind), (vec![2.0, 3.0], 1, sync_trace::Kind::Read));
//! # Ok::<(), mlx_k3::Error>(())
//! ```

use std::cell::{Cell, RefCell};
use std::panic::Location;

/// What a recorded call did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Evaluated arrays and waited for them.
    Eval,
    /// Started evaluating arrays without waiting.
    AsyncEval,
    /// Evaluated an array, waited, and copied its data to the host.
    Read,
    /// Waited for a stream (or all streams) to finish.
    Synchronize,
}

/// One recorded call.
#[derive(Clone, Copy, Debug)]
pub struct Event {
    /// What it did.
    pub kind: Kind,
    /// Where it was called from (the caller of the safe API function).
    pub location: &'static Location<'static>,
}

/// How many calls of each kind this thread has made since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// [`Kind::Eval`] calls.
    pub evals: u64,
    /// [`Kind::AsyncEval`] calls.
    pub async_evals: u64,
    /// [`Kind::Read`] calls.
    pub reads: u64,
    /// [`Kind::Synchronize`] calls.
    pub synchronizes: u64,
}

impl Counts {
    /// Calls that made the host wait (everything but `async_eval`).
    pub fn host_syncs(&self) -> u64 {
        self.evals + self.reads + self.synchronizes
    }

    /// The calls made between `earlier` (a previous [`counts`]) and `self`.
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts {
            evals: self.evals - earlier.evals,
            async_evals: self.async_evals - earlier.async_evals,
            reads: self.reads - earlier.reads,
            synchronizes: self.synchronizes - earlier.synchronizes,
        }
    }
}

thread_local! {
    static COUNTS: Cell<Counts> = const { Cell::new(Counts { evals: 0, async_evals: 0, reads: 0, synchronizes: 0 }) };
    static LOGGING: Cell<bool> = const { Cell::new(false) };
    static LOG: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

/// This thread's counts so far.
pub fn counts() -> Counts {
    COUNTS.with(Cell::get)
}

/// Starts (or restarts, dropping what was logged) this thread's event log.
pub fn start() {
    LOG.with(|l| l.borrow_mut().clear());
    LOGGING.with(|g| g.set(true));
}

/// Stops this thread's event log and returns the events since [`start`], in order.
pub fn stop() -> Vec<Event> {
    LOGGING.with(|g| g.set(false));
    LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

/// Counts one call (and logs it while the log runs); `#[track_caller]` through the API function records
/// the user's call site.
#[track_caller]
pub(crate) fn record(kind: Kind) {
    COUNTS.with(|c| {
        let mut n = c.get();
        match kind {
            Kind::Eval => n.evals += 1,
            Kind::AsyncEval => n.async_evals += 1,
            Kind::Read => n.reads += 1,
            Kind::Synchronize => n.synchronizes += 1,
        }
        c.set(n);
    });
    if LOGGING.with(Cell::get) {
        let location = Location::caller();
        LOG.with(|l| l.borrow_mut().push(Event { kind, location }));
    }
}
