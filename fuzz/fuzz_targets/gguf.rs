//! The GGUF reader (`GgufFile::from_bytes`): the input is a whole file. Any bytes are a file or an error
//! naming it; every tensor it lists reads as its dims say or is an error naming the file, and nothing reads
//! outside the bytes. scripts/fuzz.sh runs this with a malloc limit, so a header that makes the reader
//! allocate far more than the file holds is a finding too.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use mlx_k3::gguf::{GgufFile, GGML_TYPE_F32, GGML_TYPE_IQ1_S};
use mlx_k3::Error;
use mlx_k3_fuzz::{allocation_budget, LargestAlloc};

fn names_the_file(e: &Error) {
    match e {
        Error::Format { path, .. } => assert_eq!(path, Path::new("/fuzz/model.gguf")),
        // Tensor bytes that parse as a header but not as IQ1_S blocks: the codebook's own error.
        Error::InvalidArgument { op: "codebook", .. } => {}
        e => panic!("a GGUF error that does not name the file: {e}"),
    }
}

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc::new();

fuzz_target!(|data: &[u8]| {
    ALLOC.reset();
    check(data);
    let (largest, budget) = (ALLOC.largest(), allocation_budget(data.len()));
    assert!(largest <= budget, "{largest} bytes allocated at once for a {}-byte input", data.len());
});

fn check(data: &[u8]) {
    let g = match GgufFile::from_bytes(data.to_vec(), "/fuzz/model.gguf") {
        Ok(g) => g,
        Err(e) => return names_the_file(&e),
    };
    assert!((2..=3).contains(&g.version));
    for (name, t) in &g.tensors {
        assert_eq!(name, &t.name);
        match g.f32_tensor(name) {
            Ok(v) => {
                assert_eq!(t.ggml_type, GGML_TYPE_F32);
                assert_eq!(v.len() as u64, t.dims.iter().product::<u64>(), "{name}: {:?}", t.dims);
                assert!(v.len() * 4 <= data.len());
            }
            Err(e) => names_the_file(&e),
        }
        match g.iq1s_tensor(name) {
            Ok(c) => {
                assert_eq!(t.ggml_type, GGML_TYPE_IQ1_S);
                assert_eq!((c.k as u64, c.n as u64), (t.dims[0], t.dims[1..].iter().product::<u64>()));
                assert_eq!(c.codes.len(), c.n * c.k / 8);
            }
            Err(e) => names_the_file(&e),
        }
    }
}
