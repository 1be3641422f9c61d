//! MLX distributed: process groups and collectives (ring over TCP, jaccl over Thunderbolt RDMA, nccl with
//! the CUDA wheel, mpi). Ranks are started by MLX's launcher, e.g. `mlx.launch -n 2 --backend ring BIN`,
//! which sets `MLX_RANK` and `MLX_HOSTFILE`.

use std::ffi::CStr;
use std::ptr;

use mlx_k3_sys as sys;

use crate::array::s;
use crate::error::check;
use crate::{Array, Dtype, Result};

/// A communication back-end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The first available one.
    Any,
    /// TCP ring (always in the CPU wheel).
    Ring,
    /// RDMA over Thunderbolt (macOS).
    Jaccl,
    /// NVIDIA NCCL (CUDA wheel).
    Nccl,
    /// MPI.
    Mpi,
}

impl Backend {
    /// MLX's name of the back-end.
    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("any")
    }

    fn c_name(self) -> &'static CStr {
        match self {
            Backend::Any => c"any",
            Backend::Ring => c"ring",
            Backend::Jaccl => c"jaccl",
            Backend::Nccl => c"nccl",
            Backend::Mpi => c"mpi",
        }
    }

    /// Parses a back-end name.
    pub fn from_name(name: &str) -> Option<Backend> {
        Some(match name {
            "any" => Backend::Any,
            "ring" => Backend::Ring,
            "jaccl" => Backend::Jaccl,
            "nccl" => Backend::Nccl,
            "mpi" => Backend::Mpi,
            _ => return None,
        })
    }

    /// Whether this build of MLX has the back-end.
    pub fn is_available(self) -> bool {
        let mut b = false;
        // SAFETY: static C string in, bool out.
        let status = unsafe { sys::k3_distributed_is_available(&mut b, self.c_name().as_ptr()) };
        status == 0 && b
    }
}

/// A group of processes that communicate.
pub struct Group {
    raw: sys::k3_group,
}

impl Group {
    /// Joins the group MLX's launcher set up. With `strict`, a missing or failed set-up is an error (naming
    /// what is missing); without it, a lone process gets a group of size 1 whose collectives are no-ops.
    #[track_caller]
    pub fn init(backend: Backend, strict: bool) -> Result<Group> {
        let mut raw = sys::k3_group { ctx: ptr::null_mut() };
        // SAFETY: static C string in, handle out (owned by the returned Group).
        check("distributed_init", unsafe { sys::k3_distributed_init(&mut raw, strict, backend.c_name().as_ptr()) })?;
        Ok(Group { raw })
    }

    /// This process's rank.
    pub fn rank(&self) -> i32 {
        let mut r = 0;
        // SAFETY: live handle.
        unsafe { sys::k3_group_rank(&mut r, self.raw) };
        r
    }

    /// Number of processes.
    pub fn size(&self) -> i32 {
        let mut n = 1;
        // SAFETY: live handle.
        unsafe { sys::k3_group_size(&mut n, self.raw) };
        n
    }

    /// Sub-groups of equal `color`, ranked by `key` (negative: by current rank).
    #[track_caller]
    pub fn split(&self, color: i32, key: i32) -> Result<Group> {
        let mut raw = sys::k3_group { ctx: ptr::null_mut() };
        // SAFETY: live handle in, handle out.
        check("group_split", unsafe { sys::k3_group_split(&mut raw, self.raw, color, key) })?;
        Ok(Group { raw })
    }

    /// Elementwise sum over all ranks.
    #[track_caller]
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("all_sum", |res| unsafe { sys::k3_all_sum(res, x.as_raw(), self.raw, st) })
    }

    /// Concatenation of every rank's `x` along axis 0, in rank order.
    #[track_caller]
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("all_gather", |res| unsafe { sys::k3_all_gather(res, x.as_raw(), self.raw, st) })
    }

    /// Elementwise maximum over all ranks.
    #[track_caller]
    pub fn all_max(&self, x: &Array) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("all_max", |res| unsafe { sys::k3_all_max(res, x.as_raw(), self.raw, st) })
    }

    /// Elementwise minimum over all ranks.
    #[track_caller]
    pub fn all_min(&self, x: &Array) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("all_min", |res| unsafe { sys::k3_all_min(res, x.as_raw(), self.raw, st) })
    }

    /// Sends `x` to rank `dst` (evaluate the returned array to perform the send).
    #[track_caller]
    pub fn send(&self, x: &Array, dst: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("send", |res| unsafe { sys::k3_send(res, x.as_raw(), dst, self.raw, st) })
    }

    /// Receives an array of `shape` and `dtype` from rank `src`.
    #[track_caller]
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: i32) -> Result<Array> {
        let st = s();
        // SAFETY: shape slice and live handle in, new handle out.
        Array::try_from_op("recv", |res| unsafe {
            sys::k3_recv(res, shape.as_ptr(), shape.len(), dtype.to_raw(), src, self.raw, st)
        })
    }

    /// Receives an array shaped like `x` from rank `src`.
    #[track_caller]
    pub fn recv_like(&self, x: &Array, src: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("recv_like", |res| unsafe { sys::k3_recv_like(res, x.as_raw(), src, self.raw, st) })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        unsafe { sys::k3_group_free(self.raw) };
    }
}
