//! Shape manipulation, indexing and dtype changes.

use mlx_k3_sys as sys;

use crate::array::s;
use crate::{Array, Dtype, Error, Result};

fn raws(arrays: &[&Array]) -> Vec<sys::k3_array> {
    arrays.iter().map(|a| a.as_raw()).collect()
}

/// Collects `n` handles written by a multi-output shim call into arrays.
fn collect(op: &'static str, slots: Vec<sys::k3_array>, n: usize) -> Result<Vec<Array>> {
    if n > slots.len() {
        return Err(Error::invalid(op, "more outputs than slots"));
    }
    Ok(slots.into_iter().take(n).map(Array::from_raw).collect())
}

/// Runs a multi-output shim call with `cap` slots.
#[track_caller]
pub(crate) fn multi_output(
    op: &'static str,
    cap: usize,
    f: impl FnOnce(*mut sys::k3_array, usize, *mut usize) -> std::os::raw::c_int,
) -> Result<Vec<Array>> {
    let mut slots = vec![sys::k3_array { ctx: std::ptr::null_mut() }; cap];
    let mut n = 0usize;
    let status = f(slots.as_mut_ptr(), cap, &mut n);
    crate::error::check(op, status)?;
    collect(op, slots, n)
}

impl Array {
    /// Same elements, new shape (one dimension may be -1).
    #[track_caller]
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handle and shape slice in, new handle out.
        Array::try_from_op("reshape", |res| unsafe {
            sys::k3_reshape(res, self.as_raw(), shape.as_ptr(), shape.len(), st)
        })
    }

    /// Permutes the axes.
    #[track_caller]
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handle and axes in, new handle out.
        Array::try_from_op("transpose", |res| unsafe {
            sys::k3_transpose(res, self.as_raw(), axes.as_ptr(), axes.len(), st)
        })
    }

    /// Reverses the axes.
    #[track_caller]
    pub fn t(&self) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in (null axes = reverse), new handle out.
        Array::try_from_op("transpose", |res| unsafe { sys::k3_transpose(res, self.as_raw(), std::ptr::null(), 0, st) })
    }

    /// Swaps two axes.
    #[track_caller]
    pub fn swapaxes(&self, axis1: i32, axis2: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("swapaxes", |res| unsafe { sys::k3_swapaxes(res, self.as_raw(), axis1, axis2, st) })
    }

    /// Moves axis `source` to position `destination`.
    #[track_caller]
    pub fn moveaxis(&self, source: i32, destination: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("moveaxis", |res| unsafe { sys::k3_moveaxis(res, self.as_raw(), source, destination, st) })
    }

    /// Inserts size-1 axes at `axes`.
    #[track_caller]
    pub fn expand_dims(&self, axes: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handle and axes in, new handle out.
        Array::try_from_op("expand_dims", |res| unsafe {
            sys::k3_expand_dims(res, self.as_raw(), axes.as_ptr(), axes.len(), st)
        })
    }

    /// Removes the size-1 axes `axes`.
    #[track_caller]
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handle and axes in, new handle out.
        Array::try_from_op("squeeze", |res| unsafe {
            sys::k3_squeeze(res, self.as_raw(), axes.as_ptr(), axes.len(), st)
        })
    }

    /// Removes every size-1 axis.
    #[track_caller]
    pub fn squeeze_all(&self) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in (null axes = all singleton axes), new handle out.
        Array::try_from_op("squeeze", |res| unsafe { sys::k3_squeeze(res, self.as_raw(), std::ptr::null(), 0, st) })
    }

    /// Merges axes `start..=end` into one.
    #[track_caller]
    pub fn flatten(&self, start: i32, end: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("flatten", |res| unsafe { sys::k3_flatten(res, self.as_raw(), start, end, st) })
    }

    /// Splits at the given indices along `axis` (`indices.len() + 1` parts).
    #[track_caller]
    pub fn split_at(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        let st = s();
        // SAFETY: live handle in; the shim writes at most `cap` handles and reports how many.
        multi_output("split", indices.len() + 1, |res, cap, n| unsafe {
            sys::k3_split_at(res, cap, n, self.as_raw(), indices.as_ptr(), indices.len(), axis, st)
        })
    }

    /// Splits into `parts` equal parts along `axis`.
    #[track_caller]
    pub fn split(&self, parts: i32, axis: i32) -> Result<Vec<Array>> {
        if parts <= 0 {
            return Err(Error::invalid("split", format!("parts must be positive, got {parts}")));
        }
        let st = s();
        // SAFETY: as for split_at.
        multi_output("split", parts as usize, |res, cap, n| unsafe {
            sys::k3_split_equal(res, cap, n, self.as_raw(), parts, axis, st)
        })
    }

    /// Strided slice `start..stop` step `strides` on every axis (one entry per axis).
    #[track_caller]
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        let n = self.ndim();
        if start.len() != n || stop.len() != n || strides.len() != n {
            return Err(Error::invalid(
                "slice",
                format!("start/stop/strides need {n} entries, got {}/{}/{}", start.len(), stop.len(), strides.len()),
            ));
        }
        let st = s();
        // SAFETY: three slices of ndim entries, live handle in, new handle out.
        Array::try_from_op("slice", |res| unsafe {
            sys::k3_slice(res, self.as_raw(), start.as_ptr(), stop.as_ptr(), strides.as_ptr(), n, st)
        })
    }

    /// `self[..., start:stop, ...]` on one axis (negative bounds count from the end).
    #[track_caller]
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let a = if axis < 0 { axis + n } else { axis };
        if a < 0 || a >= n {
            return Err(Error::invalid("slice", format!("axis {axis} is out of range for {n} dimensions")));
        }
        let len = shape[a as usize];
        let norm = |v: i32| if v < 0 { (v + len).max(0) } else { v.min(len) };
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.clone();
        lo[a as usize] = norm(start);
        hi[a as usize] = norm(stop).max(norm(start));
        self.slice(&lo, &hi, &vec![1; shape.len()])
    }

    /// A slice of `sizes` along `axes` starting at the positions held in the array `start` (no host sync).
    #[track_caller]
    pub fn slice_dynamic(&self, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handles and slices in, new handle out.
        Array::try_from_op("slice", |res| unsafe {
            sys::k3_slice_dynamic(
                res,
                self.as_raw(),
                start.as_raw(),
                axes.as_ptr(),
                axes.len(),
                sizes.as_ptr(),
                sizes.len(),
                st,
            )
        })
    }

    /// A copy of `self` with `self[start:stop:strides] = update`.
    #[track_caller]
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        let n = self.ndim();
        if start.len() != n || stop.len() != n || strides.len() != n {
            return Err(Error::invalid("slice_update", format!("start/stop/strides need {n} entries")));
        }
        let st = s();
        // SAFETY: slices of ndim entries, live handles in, new handle out.
        Array::try_from_op("slice_update", |res| unsafe {
            sys::k3_slice_update(
                res,
                self.as_raw(),
                update.as_raw(),
                start.as_ptr(),
                stop.as_ptr(),
                strides.as_ptr(),
                n,
                st,
            )
        })
    }

    /// Gathers entries at `indices` along `axis`.
    #[track_caller]
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("take", |res| unsafe { sys::k3_take(res, self.as_raw(), indices.as_raw(), axis, st) })
    }

    /// `out[..., i, ...] = self[..., indices[..., i, ...], ...]` along `axis`.
    #[track_caller]
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("take_along_axis", |res| unsafe {
            sys::k3_take_along_axis(res, self.as_raw(), indices.as_raw(), axis, st)
        })
    }

    /// A copy of `self` with `values` written at `indices` along `axis`.
    #[track_caller]
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("put_along_axis", |res| unsafe {
            sys::k3_put_along_axis(res, self.as_raw(), indices.as_raw(), values.as_raw(), axis, st)
        })
    }

    /// Broadcasts to `shape`.
    #[track_caller]
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handle and shape in, new handle out.
        Array::try_from_op("broadcast_to", |res| unsafe {
            sys::k3_broadcast_to(res, self.as_raw(), shape.as_ptr(), shape.len(), st)
        })
    }

    /// Pads `axes` with `low`/`high` elements of `value` (zero when `None`).
    #[track_caller]
    pub fn pad(&self, axes: &[i32], low: &[i32], high: &[i32], value: Option<f64>) -> Result<Array> {
        if low.len() != axes.len() || high.len() != axes.len() {
            return Err(Error::invalid("pad", "axes, low and high need the same length"));
        }
        let v = value.map(|v| Array::scalar_as(v, self.dtype())).transpose()?;
        let st = s();
        // SAFETY: slices of equal length, live handles in, new handle out.
        Array::try_from_op("pad", |res| unsafe {
            sys::k3_pad(
                res,
                self.as_raw(),
                axes.as_ptr(),
                axes.len(),
                low.as_ptr(),
                high.as_ptr(),
                Array::raw_opt(v.as_ref()),
                st,
            )
        })
    }

    /// A row-contiguous copy (or `self` when it already is one).
    #[track_caller]
    pub fn contiguous(&self) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("contiguous", |res| unsafe { sys::k3_contiguous(res, self.as_raw(), st) })
    }

    /// Converts the elements to `dtype`.
    #[track_caller]
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("astype", |res| unsafe { sys::k3_astype(res, self.as_raw(), dtype.to_raw(), st) })
    }

    /// Reinterprets the bytes as `dtype` (the last axis scales by the size ratio).
    #[track_caller]
    pub fn view(&self, dtype: Dtype) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("view", |res| unsafe { sys::k3_view(res, self.as_raw(), dtype.to_raw(), st) })
    }

    /// Repeats each element `repeats` times along `axis`.
    #[track_caller]
    pub fn repeat(&self, repeats: i32, axis: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("repeat", |res| unsafe { sys::k3_repeat(res, self.as_raw(), repeats, axis, st) })
    }

    /// Tiles the array `reps` times per axis.
    #[track_caller]
    pub fn tile(&self, reps: &[i32]) -> Result<Array> {
        let st = s();
        // SAFETY: live handle and reps in, new handle out.
        Array::try_from_op("tile", |res| unsafe { sys::k3_tile(res, self.as_raw(), reps.as_ptr(), reps.len(), st) })
    }

    /// Lower triangle (diagonal offset `k`), zeros above.
    #[track_caller]
    pub fn tril(&self, k: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("tril", |res| unsafe { sys::k3_tril(res, self.as_raw(), k, st) })
    }

    /// Upper triangle (diagonal offset `k`), zeros below.
    #[track_caller]
    pub fn triu(&self, k: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("triu", |res| unsafe { sys::k3_triu(res, self.as_raw(), k, st) })
    }
}

/// Joins arrays along an existing axis.
#[track_caller]
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let r = raws(arrays);
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("concatenate", |res| unsafe { sys::k3_concatenate(res, r.as_ptr(), r.len(), axis, st) })
}

/// Joins arrays along a new axis.
#[track_caller]
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let r = raws(arrays);
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("stack", |res| unsafe { sys::k3_stack(res, r.as_ptr(), r.len(), axis, st) })
}
