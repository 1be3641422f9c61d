//! Dense f32 matmul on the CPU. MLX's CPU back-end sends every float32 matmul to `cblas_sgemm`, which the
//! Linux CPU wheel resolves to its bundled reference BLAS (~3 GFLOP/s). This crate's programs export the
//! project's own `cblas_sgemm` (AVX2/FMA or AVX-512 on x86-64, NEON on AArch64;
//! `mlx-k3-metal/cpp/dense_sgemm.cpp`; see `build.rs`), so the dynamic linker binds MLX's calls to it:
//! matmuls, attention and convolutions get a blocked, multi-threaded kernel with no change to the graph. The reference BLAS stays reachable for comparisons.

/// Sends MLX's float32 matmuls back to the wheel's reference BLAS (`true`) or to the project's SGEMM
/// (`false`, the default unless `K3_BLAS=reference` is set).
pub fn set_reference_blas(on: bool) {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_dense_set_reference(on) };
}

/// The kernel MLX's dense f32 matmuls run now, as `mlx-k3 info` names it: the project's SGEMM with its
/// micro-kernel's instruction set, or the BLAS the wheel links (chosen with `K3_BLAS=reference` or
/// [`set_reference_blas`], or because the project has no kernel for this CPU or system: on macOS MLX calls
/// Accelerate, and only Linux programs export the project's `cblas_sgemm`).
pub fn sgemm_path() -> &'static str {
    // SAFETY: plain call.
    match unsafe { mlx_k3_metal::k3_dense_sgemm_path() } {
        1 => "project SGEMM (AVX2/FMA)",
        2 => "project SGEMM (AVX-512)",
        3 => "project SGEMM (NEON)",
        _ if cfg!(target_os = "linux") => "the MLX wheel's BLAS",
        _ => "MLX's platform BLAS",
    }
}

/// How many `cblas_sgemm` calls the project's kernel computed (MLX's f32 matmuls reach its entry point when
/// the program exports it; those it passes on to the reference BLAS are not counted).
pub fn sgemm_calls() -> u64 {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_dense_sgemm_calls() }
}
