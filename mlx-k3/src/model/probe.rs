//! Calibration taps: while a tap is installed on this thread, every [`Linear`](super::linear::Linear) (and
//! the tied head) hands its input to it, by module path, before computing. `mlx-k3 calibrate` uses this to
//! collect per-column activation statistics (the importance matrix) without a second copy of the model
//! graph. With no tap installed a forward pass pays one thread-local check per layer call.

use std::cell::RefCell;

use crate::{Array, Result};

type TapFn = Box<dyn FnMut(&str, &Array) -> Result<()>>;

thread_local! {
    static TAP: RefCell<Option<TapFn>> = const { RefCell::new(None) };
}

/// Hands `x` (the input of module `path`) to the installed tap, if any.
pub fn tap(path: &str, x: &Array) -> Result<()> {
    TAP.with(|t| match t.try_borrow_mut() {
        Ok(mut slot) => match slot.as_mut() {
            Some(f) => f(path, x),
            None => Ok(()),
        },
        // The tap itself ran a layer: nothing to record for that nested call.
        Err(_) => Ok(()),
    })
}

/// Runs `body` with `f` installed as this thread's tap (removed afterwards, also on error).
pub fn with_tap<R>(f: impl FnMut(&str, &Array) -> Result<()> + 'static, body: impl FnOnce() -> Result<R>) -> Result<R> {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            TAP.with(|t| *t.borrow_mut() = None);
        }
    }
    TAP.with(|t| *t.borrow_mut() = Some(Box::new(f)));
    let _reset = Reset;
    body()
}
