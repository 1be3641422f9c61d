//! mlx-k3: run Kimi K3-class giant Mixture-of-Experts models on MLX.
//!
//! This crate is the safe layer over `mlx-k3-sys` (the C ABI shim that links the pinned MLX wheel, [`MLX_PIN`])
//! and `mlx-k3-metal` (custom primitives): [`Array`] with lazy ops that return [`Result`], devices and
//! streams, quantization in every MLX mode, fused ops, random numbers, safetensors I/O, distributed
//! collectives and mlx-k3's own kernels. The model graph, loader, generation and tools are built on it.
//!
//! Arrays are not `Send`: MLX binds an unevaluated graph to the thread that built it, so one thread owns the
//! model and its arrays, and other threads talk to it through channels.
//!
//! ```no_run
//! use mlx_k3::{kernels, Array, Dtype};
//! let up = Array::from_slice(&[0.5f32, -1.0, 2.0], &[3])?;
//! let gate = Array::from_slice(&[1.0f32, 0.25, -3.0], &[3])?;
//! let y = kernels::situ(&up, &gate, 1.0, None)?;
//! let r = kernels::situ_reference(&up, &gate, 1.0, None)?;
//! let diff = y.subtract(&r)?.abs()?.max_all(false)?.item::<f32>()?;
//! assert!(diff < 1e-6);
//! # let _ = Dtype::F32;
//! # Ok::<(), mlx_k3::Error>(())
//! ```
#![deny(missing_docs)]

mod array;
mod device;
mod dtype;
mod error;

pub mod chat;
pub mod codebook;
pub mod compress;
pub mod distributed;
pub mod fast;
pub mod generate;
pub mod gguf;
pub mod io;
pub mod kernels;
pub mod media;
pub mod memory;
pub mod model;
pub mod ops;
pub mod optim;
pub mod quality;
pub mod quant;
pub mod random;
pub mod sync_trace;
pub mod tiered;
pub mod tokenizer;
pub mod transforms;

pub use array::{async_eval, eval, graph_census, graph_nodes, Array, GraphCensusRow};
pub use device::{current_stream, synchronize, with_device, with_stream, Device, Stream};
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use transforms::{grad, value_and_grad, vjp};

/// The MLX version this process runs (the wheel's `libmlx`).
pub fn mlx_version() -> String {
    // SAFETY: returns a pointer to a static string.
    unsafe { std::ffi::CStr::from_ptr(mlx_k3_sys::k3_mlx_version()).to_string_lossy().into_owned() }
}

/// The MLX version this project is built against, exactly.
pub const MLX_PIN: &str = mlx_k3_sys::MLX_PIN;

/// Where the build found MLX (`MLX_DIR`, an active virtualenv, or the project-local `.venv`).
pub const MLX_ORIGIN: &str = mlx_k3_sys::MLX_ORIGIN;
