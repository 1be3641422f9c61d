//! Raw bindings to the mlx-k3 C ABI shim over MLX's C++ API (the pinned MLX wheel, [`MLX_PIN`]).
//!
//! This is the only crate that links `libmlx`. Its build script finds the wheel (`MLX_DIR`, an active
//! virtualenv, or the project-local `.venv`, which it creates and fills with pip when nothing else has
//! MLX), compiles `shim/*.cpp` against the wheel's headers and keeps these bindgen-generated bindings of `shim/k3.h` in `src/bindings.rs`
//! (regenerate with `cargo build --features bindgen`).
//!
//! Conventions: opaque handles `{ctx: *mut c_void}`, output parameter first, `0` on success; on failure the
//! C++ exception's message is kept in a thread-local readable through [`k3_last_error`]. No C++ exception
//! ever unwinds into Rust. Use the safe API in the `mlx-k3` crate instead of calling these directly.
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, missing_docs)]
#![allow(clippy::all)]

#[rustfmt::skip]
mod bindings;
pub use bindings::*;

/// A stream value that asks MLX for the default stream of the default device.
pub const K3_DEFAULT_STREAM: k3_stream = k3_stream { index: 0, device_type: -1, device_index: 0 };

/// The MLX version this project is built against, exactly (the wheel the build installs or requires).
pub const MLX_PIN: &str = env!("MLX_K3_MLX_PIN");

/// Where the build found MLX (`MLX_DIR`, `VIRTUAL_ENV=...` or the `.venv` path).
pub const MLX_ORIGIN: &str = env!("MLX_K3_MLX_ORIGIN");
