//! Safetensors files through MLX's own loader (lazy: a tensor's bytes are read when it is evaluated).

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr;

use mlx_k3_sys as sys;

use crate::array::s;
use crate::error::last_error;
use crate::{Array, Dtype, Error, Result};

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.to_string_lossy().as_bytes())
        .map_err(|_| Error::Format { path: path.to_path_buf(), message: "path contains a NUL byte".into() })
}

/// An opened safetensors file: its tensor names, lazy arrays and metadata.
pub struct Safetensors {
    raw: sys::k3_safetensors,
    path: PathBuf,
}

impl Safetensors {
    /// Opens `path` and parses its header; no tensor data is read yet. The header is checked against the
    /// file first ([`crate::model::loader::validate_safetensors`]: sizes, offsets, overlaps), so MLX never
    /// maps a tensor past the end of the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Safetensors> {
        let path = path.as_ref().to_path_buf();
        std::fs::metadata(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        crate::model::loader::validate_safetensors(&path)?;
        let cpath = c_path(&path)?;
        let mut raw = sys::k3_safetensors { ctx: ptr::null_mut() };
        // SAFETY: valid C string in, handle out (owned by the returned value).
        let status = unsafe { sys::k3_safetensors_load(&mut raw, cpath.as_ptr(), s()) };
        if status != 0 || raw.ctx.is_null() {
            return Err(Error::Format { path, message: last_error() });
        }
        Ok(Safetensors { raw, path })
    }

    /// The file this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut n = 0;
        // SAFETY: live handle.
        unsafe { sys::k3_safetensors_len(&mut n, self.raw) };
        (0..n)
            .filter_map(|i| {
                let mut p = ptr::null();
                // SAFETY: i < len; the pointer is valid while self lives and is copied at once.
                unsafe {
                    (sys::k3_safetensors_key(&mut p, self.raw, i) == 0 && !p.is_null())
                        .then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
                }
            })
            .collect()
    }

    /// The (lazy) tensor `name`; the error names the file and the tensor when it is absent.
    pub fn get(&self, name: &str) -> Result<Array> {
        let cname = CString::new(name)
            .map_err(|_| Error::invalid("safetensors", format!("tensor name {name:?} contains a NUL byte")))?;
        let mut res = sys::k3_array { ctx: ptr::null_mut() };
        // SAFETY: live handle and C string in, new handle out.
        let status = unsafe { sys::k3_safetensors_get(&mut res, self.raw, cname.as_ptr()) };
        if status != 0 || res.ctx.is_null() {
            return Err(Error::Format { path: self.path.clone(), message: format!("no tensor named '{name}'") });
        }
        Ok(Array::from_raw(res))
    }

    /// The header's `__metadata__` entries.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        let mut n = 0;
        // SAFETY: live handle.
        unsafe { sys::k3_safetensors_metadata_len(&mut n, self.raw) };
        let mut out = BTreeMap::new();
        for i in 0..n {
            let (mut k, mut v) = (ptr::null(), ptr::null());
            // SAFETY: i < len; pointers valid while self lives, copied at once.
            unsafe {
                if sys::k3_safetensors_metadata_entry(&mut k, &mut v, self.raw, i) == 0 {
                    out.insert(
                        CStr::from_ptr(k).to_string_lossy().into_owned(),
                        CStr::from_ptr(v).to_string_lossy().into_owned(),
                    );
                }
            }
        }
        out
    }

    /// All tensors by name.
    pub fn arrays(&self) -> Result<BTreeMap<String, Array>> {
        self.keys().into_iter().map(|k| Ok((k.clone(), self.get(&k)?))).collect()
    }
}

impl Drop for Safetensors {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        unsafe { sys::k3_safetensors_free(self.raw) };
    }
}

/// Writes `tensors` (evaluating them) and `metadata` to a safetensors file.
#[track_caller]
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Array)], metadata: &[(&str, &str)]) -> Result<()> {
    crate::sync_trace::record(crate::sync_trace::Kind::Eval);
    let path = path.as_ref();
    let cpath = c_path(path)?;
    let to_c = |s: &str| CString::new(s).map_err(|_| Error::invalid("save_safetensors", format!("{s:?} has a NUL")));
    let names: Vec<CString> = tensors.iter().map(|(n, _)| to_c(n)).collect::<Result<_>>()?;
    let name_ptrs: Vec<*const std::os::raw::c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let arrays: Vec<sys::k3_array> = tensors.iter().map(|(_, a)| a.as_raw()).collect();
    let mk: Vec<CString> = metadata.iter().map(|(k, _)| to_c(k)).collect::<Result<_>>()?;
    let mv: Vec<CString> = metadata.iter().map(|(_, v)| to_c(v)).collect::<Result<_>>()?;
    let mkp: Vec<_> = mk.iter().map(|c| c.as_ptr()).collect();
    let mvp: Vec<_> = mv.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: all pointer arrays have the stated lengths and outlive the call.
    let status = unsafe {
        sys::k3_safetensors_save(
            cpath.as_ptr(),
            name_ptrs.as_ptr(),
            arrays.as_ptr(),
            arrays.len(),
            mkp.as_ptr(),
            mvp.as_ptr(),
            mkp.len(),
        )
    };
    if status != 0 {
        return Err(Error::Format { path: path.to_path_buf(), message: last_error() });
    }
    Ok(())
}

/// Copies raw little-endian `bytes` into a new array of `shape` and `dtype`; the length must match.
pub fn array_from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
    if shape.iter().any(|&d| d < 0) {
        return Err(Error::invalid("array_from_bytes", format!("negative dimension in shape {shape:?}")));
    }
    let want = shape.iter().try_fold(dtype.size_of(), |acc, &d| acc.checked_mul(d as usize));
    let Some(want) = want else {
        return Err(Error::invalid(
            "array_from_bytes",
            format!("shape {shape:?} of {dtype} overflows the address space"),
        ));
    };
    if bytes.len() != want {
        return Err(Error::invalid(
            "array_from_bytes",
            format!("{} bytes cannot fill shape {shape:?} of {dtype} ({want} bytes)", bytes.len()),
        ));
    }
    // SAFETY: bytes holds product(shape) elements of dtype (checked above); MLX copies them.
    Array::try_from_op("array_from_bytes", |res| unsafe {
        sys::k3_array_from_data(res, bytes.as_ptr().cast(), shape.as_ptr(), shape.len(), dtype.to_raw())
    })
}
