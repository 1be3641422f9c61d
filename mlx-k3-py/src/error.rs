//! mlx-k3 errors as Python exceptions: what the caller passed wrong is a `ValueError` (as MLX's own ops
//! raise), a missing back-end a `RuntimeError`, a file problem an `OSError`.

use mlx_k3::Error;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::PyErr;

pub fn to_py_err(e: Error) -> PyErr {
    match e {
        Error::NotCompiled(_) => PyRuntimeError::new_err(e.to_string()),
        Error::Io { .. } => PyOSError::new_err(e.to_string()),
        // MLX's messages already name the op ("[codebook_qmm] ..."); drop the Rust call site.
        Error::Mlx { message, .. } => PyValueError::new_err(message),
        other => PyValueError::new_err(other.to_string()),
    }
}
