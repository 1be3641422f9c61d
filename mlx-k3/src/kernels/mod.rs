//! mlx-k3's custom kernels (the primitives of `mlx-k3-metal`), each next to the plain-ops reference it is
//! tested against.

mod situ;

pub use situ::{situ, situ_reference};

/// Threads the CPU kernels split their work over (default: `K3_NUM_THREADS` or all hardware threads).
pub fn num_threads() -> usize {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_num_threads() }.max(1) as usize
}

/// Sets the CPU kernels' thread count; 0 restores the default.
pub fn set_num_threads(n: usize) {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_set_num_threads(n.min(i32::MAX as usize) as i32) };
}
