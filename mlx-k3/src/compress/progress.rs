//! Progress of the long-running tools (`convert`, `retier`, `calibrate`, `prune`, `eval`): the library
//! reports what it is doing through [`Progress`]; the program decides how to show it (the `mlx-k3` command
//! draws a bar on stderr; tests and library users pass [`Silent`]).

/// Receives the progress of one tool run. A run may go through several phases (e.g. scoring, then
/// writing), one after the other, each opened by [`Progress::start`] and closed by [`Progress::finish`].
pub trait Progress {
    /// A phase of `total` steps starts, `done` of which were finished by an earlier, interrupted run.
    fn start(&self, phase: &str, total: u64, done: u64);
    /// `steps` more steps of the current phase are finished.
    fn advance(&self, steps: u64);
    /// What the current step works on (e.g. a decoder layer's name).
    fn describe(&self, what: &str);
    /// The current phase is over.
    fn finish(&self);
}

/// Reports nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Silent;

impl Progress for Silent {
    fn start(&self, _phase: &str, _total: u64, _done: u64) {}
    fn advance(&self, _steps: u64) {}
    fn describe(&self, _what: &str) {}
    fn finish(&self) {}
}
