//! mlx-k3's extension layer: custom MLX primitives for the Kimi K3 kernels.
//!
//! Each kernel is an op function plus a `mlx::core::Primitive` subclass in `cpp/` (`eval_cpu` vectorized,
//! multi-threaded and enqueued on MLX's CPU command encoder), a GPU path through MLX's custom-kernel API
//! whose sources sit in `kernels/` (`.cu` for the CUDA wheel, `.metal` on Apple), and a C ABI in
//! `cpp/k3_kernels.h` with the shim's conventions. The safe wrappers and the plain-ops references live in
//! the `mlx-k3` crate (`mlx_k3::kernels`), next to the parity tests.
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, missing_docs)]
#![allow(clippy::all)]

#[rustfmt::skip]
mod bindings;
pub use bindings::*;

/// The CUDA source of the SiTU kernel (body of the function MLX's `cuda_kernel` generates).
pub const SITU_CUDA_SOURCE: &str = include_str!("../kernels/situ.cu");
/// The Metal source of the SiTU kernel (body of the function MLX's `metal_kernel` generates).
pub const SITU_METAL_SOURCE: &str = include_str!("../kernels/situ.metal");
