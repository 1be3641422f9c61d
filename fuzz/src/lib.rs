//! Shared by the fuzz targets: an allocator that remembers the largest single allocation, so a target can
//! assert that a parser never allocates far more than its input holds (libFuzzer's own malloc limit needs
//! a sanitizer's allocator hooks, which a `--sanitizer none` build does not have).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, recording the largest allocation since the last [`LargestAlloc::reset`].
pub struct LargestAlloc {
    largest: AtomicUsize,
}

impl LargestAlloc {
    /// A new one (for a `#[global_allocator]` static).
    pub const fn new() -> Self {
        LargestAlloc { largest: AtomicUsize::new(0) }
    }

    /// Forgets the allocations so far.
    pub fn reset(&self) {
        self.largest.store(0, Ordering::Relaxed);
    }

    /// The largest allocation (or reallocation) in bytes since the last reset.
    pub fn largest(&self) -> usize {
        self.largest.load(Ordering::Relaxed)
    }

    fn note(&self, size: usize) {
        self.largest.fetch_max(size, Ordering::Relaxed);
    }
}

impl Default for LargestAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every call is forwarded to `System` unchanged; only the sizes are recorded.
unsafe impl GlobalAlloc for LargestAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.note(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

/// The most a parser may allocate at once for an input of `len` bytes: a generous multiple of the input
/// plus a fixed allowance (parsed JSON, maps and error messages are a small multiple of their text).
pub fn allocation_budget(len: usize) -> usize {
    64 * len + (1 << 20)
}

/// A tokenizer and its chat encoding, loaded once per fuzz process.
pub struct Chat {
    /// The tokenizer.
    pub tok: mlx_k3::tokenizer::Tokenizer,
    /// Its `tokenizer_config.json` settings.
    pub cfg: mlx_k3::tokenizer::TokenizerConfig,
    /// Its chat encoding.
    pub enc: mlx_k3::chat::ChatEncoder,
}

fn load(dir: &str) -> Chat {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let (tok, cfg) = mlx_k3::tokenizer::Tokenizer::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let enc = mlx_k3::chat::ChatEncoder::new(
        &tok,
        cfg.chat_template.as_deref(),
        cfg.bos_token.clone(),
        cfg.eos_token.clone(),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    Chat { tok, cfg, enc }
}

/// k3-nano's tokenizer (its built-in Kimi K2-style encoding, `kimi_im`) and the Kimi K3 test tokenizer
/// (k3-nano's ranks with Kimi K3's control tokens: Kimi K3's encoding, `kimi_k3`).
pub fn chats() -> &'static [Chat; 2] {
    static CHATS: std::sync::OnceLock<[Chat; 2]> = std::sync::OnceLock::new();
    CHATS.get_or_init(|| [load("../models/k3-nano"), load("../mlx-k3/tests/fixtures/chat/k3_tokenizer")])
}
