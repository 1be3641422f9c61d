//! The safetensors header (`parse_safetensors_header`): the input is a whole file. Any bytes are a map of
//! tensor locations or an error naming the file; every tensor found lies inside the file's data, has the
//! bytes its shape and dtype need, and no two overlap.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use mlx_k3::model::loader::parse_safetensors_header;
use mlx_k3::Error;
use mlx_k3_fuzz::{allocation_budget, LargestAlloc};

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc::new();

fuzz_target!(|data: &[u8]| {
    ALLOC.reset();
    check(data);
    let (largest, budget) = (ALLOC.largest(), allocation_budget(data.len()));
    assert!(largest <= budget, "{largest} bytes allocated at once for a {}-byte input", data.len());
});

fn check(data: &[u8]) {
    let path = Path::new("/fuzz/model.safetensors");
    let size = data.len() as u64;
    match parse_safetensors_header(data, size, path) {
        Err(Error::Format { path: p, .. }) => assert_eq!(p, path, "the error names the file"),
        Err(e) => panic!("a header error that does not name the file: {e}"),
        Ok(locs) => {
            let header_end = 8 + u64::from_le_bytes(data[..8].try_into().unwrap());
            let mut spans = Vec::new();
            for (name, loc) in &locs {
                assert!(loc.shape.iter().all(|&d| d <= i32::MAX as usize), "{name}: {:?}", loc.shape);
                let n = loc.shape.iter().try_fold(loc.dtype.size_of() as u64, |a, &d| a.checked_mul(d as u64));
                let n = n.unwrap_or_else(|| panic!("{name}: {:?} overflows", loc.shape));
                let end = loc.offset.checked_add(n).expect("no overflow");
                assert!(loc.offset >= header_end && end <= size, "{name}: {}..{end} outside the data", loc.offset);
                if n > 0 {
                    spans.push((loc.offset, end));
                }
            }
            spans.sort_unstable();
            assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlapping tensors were accepted");
            // The same bytes with a file that ends earlier than a tensor needs are refused.
            if let Some(&(_, end)) = spans.iter().max_by_key(|s| s.1) {
                assert!(parse_safetensors_header(data, end - 1, path).is_err());
            }
        }
    }
}
