//! Memory accounting: creating and dropping many arrays returns active memory to where it started, and
//! external buffers are released. One test per concern, in its own binary so other tests' allocations do
//! not interleave with the measurement.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use mlx_k3::{memory, Array, Dtype};

static RELEASED: AtomicUsize = AtomicUsize::new(0);
/// The tests of this file measure process-wide allocator state: run them one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

unsafe extern "C" fn count_release(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<Vec<f32>> leaked by the test.
    drop(unsafe { Box::from_raw(ctx.cast::<Vec<f32>>()) });
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn hundred_thousand_arrays_leave_no_active_memory_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let start = memory::active();
    let mut peak_seen = start;
    let mut live = Vec::with_capacity(64);
    for i in 0..100_000u32 {
        let a = Array::from_slice(&[i as f32; 16], &[4, 4]).unwrap();
        // Every 100th array also goes through an evaluated op, so op outputs are released too.
        if i % 100 == 0 {
            let b = a.add(1.0f32).unwrap().sum_all(false).unwrap();
            assert_eq!(b.item::<f32>().unwrap(), (i as f32 + 1.0) * 16.0);
        }
        live.push(a);
        if live.len() == 64 {
            peak_seen = peak_seen.max(memory::active());
            live.clear();
        }
    }
    drop(live);
    mlx_k3::synchronize().unwrap();
    assert!(peak_seen >= start + 64 * 64, "arrays were not counted as active memory ({start} -> {peak_seen})");
    assert_eq!(memory::active(), start, "active memory did not return to its start");
    assert!(memory::peak() >= peak_seen);
    memory::reset_peak();
    memory::clear_cache();
    assert_eq!(memory::cache(), 0);
    let prev = memory::set_cache_limit(1 << 20).unwrap();
    memory::set_cache_limit(prev).unwrap();
}

#[test]
fn external_buffers_are_released_once() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..10 {
        let v: Box<Vec<f32>> = Box::new((0..256).map(|i| i as f32).collect());
        let ptr = v.as_ptr() as *mut c_void;
        let ctx = Box::into_raw(v).cast::<c_void>();
        // SAFETY: ptr holds 256 f32 owned by ctx, freed only by count_release.
        let a = unsafe { Array::from_external(ptr, &[16, 16], Dtype::F32, Some(count_release), ctx) }.unwrap();
        let s = a.sum_all(false).unwrap();
        assert_eq!(s.item::<f32>().unwrap(), 32_640.0); // 255 * 256 / 2
        drop((a, s));
    }
    mlx_k3::synchronize().unwrap();
    assert_eq!(RELEASED.load(Ordering::SeqCst), 10);
}
