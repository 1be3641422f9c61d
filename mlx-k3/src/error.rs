//! The crate's one error type. MLX failures carry the op name, MLX's own message and the caller's location.

use std::fmt;
use std::panic::Location;
use std::path::PathBuf;

use crate::Dtype;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in mlx-k3.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX raised an exception (caught in the C shim; it never unwinds into Rust).
    #[error("{message} (in `{op}` at {location})")]
    Mlx {
        /// The operation that failed, e.g. `matmul`.
        op: &'static str,
        /// MLX's message, e.g. `[matmul] Last dimension of first input with shape (2,3) ...`.
        message: String,
        /// Where the failing call was made.
        location: Location<'static>,
    },
    /// An argument was rejected before reaching MLX.
    #[error("[{op}] {message}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong and what was expected.
        message: String,
    },
    /// A dtype did not match what the operation needs.
    #[error("[{op}] expected dtype {expected}, found {found}")]
    Dtype {
        /// The operation.
        op: &'static str,
        /// The dtype required.
        expected: Dtype,
        /// The dtype given.
        found: Dtype,
    },
    /// A shape did not match what the operation needs.
    #[error("[{op}] expected shape {expected:?}, found {found:?}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// The shape required.
        expected: Vec<i32>,
        /// The shape given.
        found: Vec<i32>,
    },
    /// A back-end that this build (or this MLX wheel) does not include.
    #[error("the {0} back-end is not available in this build")]
    NotCompiled(&'static str),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file's contents are not what they should be (names the file and what is wrong).
    #[error("{}: {message}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

impl Error {
    /// An [`Error::InvalidArgument`] for `op`.
    pub fn invalid(op: &'static str, message: impl fmt::Display) -> Self {
        Error::InvalidArgument { op, message: message.to_string() }
    }

    /// MLX's message when this is an [`Error::Mlx`].
    pub fn mlx_message(&self) -> Option<&str> {
        match self {
            Error::Mlx { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// The last error text the shim recorded on this thread.
pub(crate) fn last_error() -> String {
    // SAFETY: k3_last_error returns a pointer to a thread-local std::string, valid until the next shim call
    // on this thread; it is copied out at once.
    unsafe {
        let p = mlx_k3_sys::k3_last_error();
        if p.is_null() {
            return String::from("unknown MLX error");
        }
        std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Turns a shim status into a `Result`, attaching the op name and the caller's location.
#[track_caller]
pub(crate) fn check(op: &'static str, status: std::os::raw::c_int) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Mlx { op, message: last_error(), location: *Location::caller() })
    }
}
