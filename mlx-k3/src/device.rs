//! Devices and streams.
//!
//! Every op runs on the *current stream* of the calling thread: MLX's default stream of the default device,
//! unless [`with_stream`] chose another for the duration of a closure. MLX binds streams to the thread that
//! made them, which is one reason [`Array`](crate::Array) is not `Send`.

use std::cell::Cell;

use mlx_k3_sys as sys;

use crate::error::{check, Result};

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU (always present).
    Cpu,
    /// The GPU: Metal on Apple silicon, CUDA with the CUDA wheel.
    Gpu,
}

impl Device {
    fn raw(self) -> sys::k3_device_type {
        match self {
            Device::Cpu => sys::k3_device_type::K3_CPU,
            Device::Gpu => sys::k3_device_type::K3_GPU,
        }
    }

    /// Whether MLX can run on this device in this process (false for the GPU on the CPU-only wheel).
    pub fn is_available(self) -> bool {
        let mut out = false;
        // SAFETY: plain out-parameter call.
        let status = unsafe { sys::k3_device_is_available(&mut out, self.raw()) };
        status == 0 && out
    }

    /// How many devices of this kind MLX sees (0 when unavailable).
    pub fn count(self) -> usize {
        let mut n = 0;
        // SAFETY: plain out-parameter call.
        let status = unsafe { sys::k3_device_count(&mut n, self.raw()) };
        if status == 0 {
            n.max(0) as usize
        } else {
            0
        }
    }

    /// The devices available here, CPU first.
    pub fn available() -> Vec<Device> {
        [Device::Cpu, Device::Gpu].into_iter().filter(|d| d.is_available()).collect()
    }

    /// MLX's default device (GPU when present, else CPU).
    #[track_caller]
    pub fn default_device() -> Result<Device> {
        let mut t = sys::k3_device_type::K3_CPU;
        let mut index = 0;
        // SAFETY: plain out-parameter call.
        check("default_device", unsafe { sys::k3_default_device(&mut t, &mut index) })?;
        Ok(if t == sys::k3_device_type::K3_GPU { Device::Gpu } else { Device::Cpu })
    }

    /// Makes `self` MLX's default device (process-wide).
    #[track_caller]
    pub fn set_default(self) -> Result<()> {
        // SAFETY: plain call.
        check("set_default_device", unsafe { sys::k3_set_default_device(self.raw(), 0) })
    }
}

/// An MLX stream: an ordered queue of work on one device. Valid on the thread that created it.
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    raw: sys::k3_stream,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Stream {
    fn wrap(raw: sys::k3_stream) -> Stream {
        Stream { raw, _not_send: std::marker::PhantomData }
    }

    /// This thread's default stream on `device`.
    #[track_caller]
    pub fn default_for(device: Device) -> Result<Stream> {
        let mut raw = sys::K3_DEFAULT_STREAM;
        // SAFETY: plain out-parameter call.
        check("default_stream", unsafe { sys::k3_default_stream(&mut raw, device.raw()) })?;
        Ok(Stream::wrap(raw))
    }

    /// A new stream on `device`.
    #[track_caller]
    pub fn new(device: Device) -> Result<Stream> {
        let mut raw = sys::K3_DEFAULT_STREAM;
        // SAFETY: plain out-parameter call.
        check("new_stream", unsafe { sys::k3_new_stream(&mut raw, device.raw()) })?;
        Ok(Stream::wrap(raw))
    }

    /// The device this stream runs on.
    pub fn device(&self) -> Device {
        if self.raw.device_type == sys::k3_device_type::K3_GPU.0 as i32 {
            Device::Gpu
        } else {
            Device::Cpu
        }
    }

    /// Waits until all work queued on this stream has finished.
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        crate::sync_trace::record(crate::sync_trace::Kind::Synchronize);
        // SAFETY: plain call.
        check("synchronize", unsafe { sys::k3_synchronize(self.raw) })
    }

    pub(crate) fn raw(&self) -> sys::k3_stream {
        self.raw
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        (self.raw.index, self.raw.device_type, self.raw.device_index)
            == (other.raw.index, other.raw.device_type, other.raw.device_index)
    }
}

impl Eq for Stream {}

thread_local! {
    static CURRENT: Cell<Option<sys::k3_stream>> = const { Cell::new(None) };
}

/// The stream ops use on this thread right now (raw form for the shim).
pub(crate) fn current_raw() -> sys::k3_stream {
    CURRENT.with(|c| c.get()).unwrap_or(sys::K3_DEFAULT_STREAM)
}

/// The stream ops on this thread use right now.
#[track_caller]
pub fn current_stream() -> Result<Stream> {
    match CURRENT.with(|c| c.get()) {
        Some(raw) => Ok(Stream::wrap(raw)),
        None => Stream::default_for(Device::default_device()?),
    }
}

/// Runs `f` with every op on this thread placed on `stream`; the previous choice is restored afterwards
/// (also when `f` panics).
pub fn with_stream<R>(stream: &Stream, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<sys::k3_stream>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0;
            CURRENT.with(|c| c.set(prev));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(stream.raw()))));
    f()
}

/// Runs `f` on this thread's default stream of `device`.
#[track_caller]
pub fn with_device<R>(device: Device, f: impl FnOnce() -> R) -> Result<R> {
    let s = Stream::default_for(device)?;
    Ok(with_stream(&s, f))
}

/// Waits for all queued work on the default stream of the default device.
#[track_caller]
pub fn synchronize() -> Result<()> {
    crate::sync_trace::record(crate::sync_trace::Kind::Synchronize);
    // SAFETY: plain call.
    check("synchronize", unsafe { sys::k3_synchronize(sys::K3_DEFAULT_STREAM) })
}
