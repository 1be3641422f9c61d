//! The GGUF reader on crafted and damaged files (issue 41, item 6): dims, offsets and alignments that
//! overflow or lie are errors naming the file and the tensor, never a panic ("capacity overflow") or a
//! silent wrap; truncations and byte flips of real files never panic.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use mlx_k3::gguf::{GgufFile, GGML_TYPE_F32, GGML_TYPE_IQ1_S};

/// The system allocator, remembering the largest single allocation (to show that a header's sizes are
/// checked against the file before anything is allocated for them).
struct LargestAlloc(AtomicUsize);

// SAFETY: every call is forwarded to `System` unchanged; only the sizes are recorded.
unsafe impl GlobalAlloc for LargestAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.0.fetch_max(layout.size(), Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.0.fetch_max(layout.size(), Ordering::Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.0.fetch_max(new_size, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc(AtomicUsize::new(0));

/// A GGUF v3 file: `u32` metadata entries, tensors (name, dims, type, offset), data after 32-byte alignment.
fn gguf(kv: &[(&str, u32)], tensors: &[(&str, &[u64], u32, u64)], data: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    for (k, v) in kv {
        string(&mut b, k);
        b.extend(4u32.to_le_bytes());
        b.extend(v.to_le_bytes());
    }
    for (name, dims, ty, offset) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
    }
    let align = kv.iter().find(|(k, _)| *k == "general.alignment").map_or(32, |(_, v)| (*v).max(1) as usize);
    b.resize(b.len().div_ceil(align) * align, 0);
    b.extend(data);
    b
}

fn err(bytes: Vec<u8>, tensor: Option<(&str, bool)>) -> String {
    match GgufFile::from_bytes(bytes, "/x/crafted.gguf") {
        Err(e) => e.to_string(),
        Ok(g) => match tensor {
            Some((name, iq1s)) => {
                let r = if iq1s { g.iq1s_tensor(name).map(|_| ()) } else { g.f32_tensor(name).map(|_| ()) };
                r.unwrap_err().to_string()
            }
            None => panic!("the file should not parse"),
        },
    }
}

#[test]
fn a_crafted_file_reads_from_memory_and_from_disk() {
    let data: Vec<u8> = [1.0f32, -2.0, 3.5, 0.25].iter().flat_map(|v| v.to_le_bytes()).collect();
    let bytes = gguf(&[("general.alignment", 64)], &[("w", &[4], GGML_TYPE_F32, 0)], &data);
    let g = GgufFile::from_bytes(bytes.clone(), "mem.gguf").unwrap();
    assert_eq!(g.f32_tensor("w").unwrap(), [1.0, -2.0, 3.5, 0.25]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.gguf"), &bytes).unwrap();
    assert_eq!(GgufFile::open(dir.path().join("a.gguf")).unwrap().f32_tensor("w").unwrap(), [1.0, -2.0, 3.5, 0.25]);
}

#[test]
fn overflowing_dims_offsets_and_alignments_are_errors() {
    let data = [0u8; 64];
    // The case: IQ1_S [256, 2^63 + 1] made `rows * k` wrap and the import allocate for 2^63 rows.
    let e = err(gguf(&[], &[("t", &[256, (1 << 63) + 1], GGML_TYPE_IQ1_S, 0)], &data), Some(("t", true)));
    assert!(e.contains("crafted.gguf") && e.contains("'t'"), "{e}");
    // Dims whose product overflows 64 bits, at open.
    let e = err(gguf(&[], &[("t", &[1 << 62, 8], GGML_TYPE_F32, 0)], &data), None);
    assert!(e.contains("'t'") && e.contains("overflow"), "{e}");
    // 2^62 f32 values: 2^64 bytes wrap to 0 (an empty tensor, silently, before).
    let e = err(gguf(&[], &[("t", &[1 << 62], GGML_TYPE_F32, 0)], &data), Some(("t", false)));
    assert!(e.contains("'t'") && e.contains("too large"), "{e}");
    // A tensor that would need more bytes than the file has.
    let e = err(gguf(&[], &[("t", &[1 << 40], GGML_TYPE_F32, 0)], &data), Some(("t", false)));
    assert!(e.contains("'t'") && e.contains("truncated"), "{e}");
    let e = err(gguf(&[], &[("t", &[256, 1 << 31], GGML_TYPE_IQ1_S, 0)], &data), Some(("t", true)));
    assert!(e.contains("'t'") && e.contains("too large"), "{e}");
    // An offset that overflows past the data start.
    let e = err(gguf(&[], &[("t", &[4], GGML_TYPE_F32, u64::MAX - 10)], &data), None);
    assert!(e.contains("'t'") && e.contains("offset"), "{e}");
    let e = err(gguf(&[], &[("t", &[4], GGML_TYPE_F32, 1 << 62)], &data), Some(("t", false)));
    assert!(e.contains("'t'") && e.contains("truncated"), "{e}");
    // Alignments that are not powers of two (0 divided by zero before).
    for a in [0, 3, 48] {
        let e = err(gguf(&[("general.alignment", a)], &[("t", &[4], GGML_TYPE_F32, 0)], &data), None);
        assert!(e.contains("general.alignment"), "{a}: {e}");
    }
    // The same name twice.
    let e = err(gguf(&[], &[("t", &[4], GGML_TYPE_F32, 0), ("t", &[4], GGML_TYPE_F32, 16)], &data), None);
    assert!(e.contains("'t' appears twice"), "{e}");
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/codebook").join(name)
}

/// Parses `bytes` and reads every tensor it names; any result is fine, a panic is not.
fn read_all(bytes: Vec<u8>) {
    if let Ok(g) = GgufFile::from_bytes(bytes, "mutant.gguf") {
        for name in g.tensors.keys() {
            let _ = g.iq1s_tensor(name);
            let _ = g.f32_tensor(name);
        }
    }
}

#[test]
fn truncated_and_mutated_files_never_panic() {
    let real = std::fs::read(fixture("tiny_iq1s.gguf")).unwrap();
    let g = GgufFile::from_bytes(real.clone(), "tiny.gguf").unwrap();
    assert_eq!(g.iq1s_tensor("blk.0.ffn_up.weight").unwrap().n, 4);
    let header_end = real.len() - 4 * 512 / 256 * 50 - 512 * 4;
    for len in (0..header_end + 64).chain((header_end..real.len()).step_by(97)) {
        read_all(real[..len].to_vec());
    }
    // Seeded byte and word flips over the header (where sizes, counts and offsets live).
    let mut state = 41u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..3000 {
        let mut b = real.clone();
        let at = (next() % header_end as u64) as usize;
        match next() % 3 {
            0 => b[at] ^= 1 << (next() % 8),
            1 => b[at] = 0xff,
            _ => {
                let end = (at + 8).min(b.len());
                let v = next().to_le_bytes();
                b[at..end].copy_from_slice(&v[..end - at]);
            }
        }
        read_all(b);
    }
}

#[test]
fn a_string_longer_than_the_file_is_refused_before_it_is_allocated() {
    // Found by the `gguf` fuzz target: a metadata key or string value claiming up to 1 GiB was allocated
    // (zeroed) before the read found the file too short; a 600-byte file cost 16 MiB, a 40-byte one 1 GiB.
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(((1u64 << 30) - 1).to_le_bytes());
    b.extend(b"general.name");
    // Other tests run in parallel threads; their allocations are far below this test's threshold.
    let e = GgufFile::from_bytes(b.clone(), "/x/short.gguf").unwrap_err().to_string();
    assert!(e.contains("short.gguf") && e.contains("truncated"), "{e}");
    let largest = ALLOC.0.load(Ordering::Relaxed);
    assert!(largest < 64 << 20, "{largest} bytes allocated for a {}-byte file", b.len());
    // A string value too, not only a key.
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(b"name");
    b.extend(8u32.to_le_bytes());
    b.extend(((1u64 << 30) - 1).to_le_bytes());
    let e = GgufFile::from_bytes(b, "/x/short.gguf").unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    assert!(ALLOC.0.load(Ordering::Relaxed) < 64 << 20);
}
