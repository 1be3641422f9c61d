//! MLX's allocator statistics and limits.

use mlx_k3_sys as sys;

use crate::error::check;
use crate::Result;

macro_rules! getter {
    ($($name:ident => $ffi:ident, $doc:literal;)*) => {$(
        #[doc = $doc]
        pub fn $name() -> usize {
            let mut n = 0usize;
            // SAFETY: plain out-parameter call.
            unsafe { sys::$ffi(&mut n) };
            n
        }
    )*};
}

getter! {
    active => k3_get_active_memory, "Bytes held by live arrays.";
    peak => k3_get_peak_memory, "The largest `active()` seen since start or the last [`reset_peak`].";
    cache => k3_get_cache_memory, "Bytes MLX keeps cached for reuse (not held by arrays).";
}

/// Restarts peak tracking.
pub fn reset_peak() {
    // SAFETY: plain call.
    unsafe { sys::k3_reset_peak_memory() };
}

/// Frees the allocator cache.
pub fn clear_cache() {
    // SAFETY: plain call.
    unsafe { sys::k3_clear_cache() };
}

macro_rules! limit {
    ($($name:ident => $ffi:ident, $doc:literal;)*) => {$(
        #[doc = $doc]
        #[track_caller]
        pub fn $name(bytes: usize) -> Result<usize> {
            let mut prev = 0usize;
            // SAFETY: plain out-parameter call.
            check(stringify!($name), unsafe { sys::$ffi(&mut prev, bytes) })?;
            Ok(prev)
        }
    )*};
}

limit! {
    set_cache_limit => k3_set_cache_limit, "Caps the allocator cache; returns the previous limit.";
    set_memory_limit => k3_set_memory_limit, "Caps memory MLX may allocate (it waits or fails beyond); returns the previous limit.";
    set_wired_limit => k3_set_wired_limit, "Bytes of memory kept wired (macOS Metal); returns the previous limit. An error elsewhere or above the system limit.";
}
