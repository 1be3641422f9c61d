//! [`Array`]: an owned handle to an MLX array (lazy until evaluated).

use std::ffi::c_void;
use std::fmt;
use std::os::raw::c_int;
use std::ptr;

use mlx_k3_sys as sys;

use crate::device::current_raw;
use crate::error::{check, Error, Result};
use crate::sync_trace::{self, Kind};
use crate::{Dtype, Element};

/// An MLX array. Cloning shares the same array (MLX arrays are reference-counted); dropping frees the handle.
///
/// Arrays are lazy: ops build a graph and nothing runs until [`Array::eval`] (or a read such as
/// [`Array::to_vec`]). An `Array` is neither `Send` nor `Sync`: MLX binds an unevaluated graph to the
/// streams of the thread that built it (see PLATFORM_NOTES), so one thread owns the model and its arrays.
///
/// ```no_run
/// use mlx_k3::Array;
/// let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// let b = a.matmul(&a)?.add(1.0f32)?;
/// assert_eq!(b.to_vec::<f32>()?, vec![8.0, 11.0, 16.0, 23.0]);
/// # Ok::<(), mlx_k3::Error>(())
/// ```
#[repr(transparent)]
pub struct Array {
    raw: sys::k3_array,
}

impl Array {
    /// Runs a shim call that writes a new array into its first argument; a failure becomes
    /// [`Error::Mlx`] with `op`, MLX's message and the caller's location.
    #[track_caller]
    pub(crate) fn try_from_op(op: &'static str, f: impl FnOnce(*mut sys::k3_array) -> c_int) -> Result<Array> {
        let mut res = sys::k3_array { ctx: ptr::null_mut() };
        let status = f(&mut res);
        check(op, status)?;
        if res.ctx.is_null() {
            return Err(Error::invalid(op, "the shim returned no array"));
        }
        Ok(Array { raw: res })
    }

    /// Wraps a handle the shim returned (ownership moves into the `Array`).
    pub(crate) fn from_raw(raw: sys::k3_array) -> Array {
        Array { raw }
    }

    /// The raw handle (borrowed; for the shim and kernel bindings).
    pub fn as_raw(&self) -> sys::k3_array {
        self.raw
    }

    /// Takes ownership of a handle made outside this crate, e.g. by the Python module's bridge, which wraps
    /// the `mlx::core::array` of an `mx.array` without copying it. Dropping the `Array` frees the handle.
    ///
    /// # Safety
    /// `raw.ctx` must point to a live `mlx::core::array` allocated with `new` (as the shim allocates its
    /// handles) that nothing else frees.
    pub unsafe fn from_raw_handle(raw: sys::k3_array) -> Array {
        Array { raw }
    }

    /// The null handle the shim reads as "no array" for optional arguments.
    pub(crate) fn raw_opt(a: Option<&Array>) -> sys::k3_array {
        a.map(|a| a.raw).unwrap_or(sys::k3_array { ctx: ptr::null_mut() })
    }

    /// Copies `data` into a new array of the given shape (row-major).
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        check_len("from_slice", data.len(), shape)?;
        // SAFETY: data holds product(shape) elements of T, whose layout matches T::DTYPE (Element).
        Array::try_from_op("from_slice", |res| unsafe {
            sys::k3_array_from_data(res, data.as_ptr().cast(), shape.as_ptr(), shape.len(), T::DTYPE.to_raw())
        })
    }

    /// Takes ownership of `data` and lets MLX use it in place (no copy on the CPU). The vector is dropped
    /// once MLX no longer needs it.
    #[track_caller]
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[i32]) -> Result<Array> {
        check_len("from_vec", data.len(), shape)?;
        let mut boxed = Box::new(data);
        let ptr = boxed.as_mut_ptr().cast::<c_void>();
        let ctx = Box::into_raw(boxed).cast::<c_void>();
        extern "C" fn release<T>(ctx: *mut c_void) {
            // SAFETY: ctx is the Box<Vec<T>> leaked below; MLX calls this exactly once.
            drop(unsafe { Box::from_raw(ctx.cast::<Vec<T>>()) });
        }
        // SAFETY: ptr stays valid until release(ctx) runs, which MLX calls once it is done with the memory.
        unsafe { Array::from_external(ptr, shape, T::DTYPE, Some(release::<T>), ctx) }
    }

    /// Wraps external memory without copying it.
    ///
    /// # Safety
    /// `data` must point to `product(shape)` elements of `dtype`, stay valid and unmodified until
    /// `release(ctx)` is called (or forever if `release` is `None`).
    #[track_caller]
    pub unsafe fn from_external(
        data: *mut c_void,
        shape: &[i32],
        dtype: Dtype,
        release: Option<unsafe extern "C" fn(*mut c_void)>,
        ctx: *mut c_void,
    ) -> Result<Array> {
        Array::try_from_op("from_external", |res| unsafe {
            sys::k3_array_from_external(res, data, shape.as_ptr(), shape.len(), dtype.to_raw(), release, ctx)
        })
    }

    /// A 0-d array holding `value` converted to `dtype`.
    #[track_caller]
    pub fn scalar_as(value: f64, dtype: Dtype) -> Result<Array> {
        // SAFETY: plain out-parameter call.
        Array::try_from_op("scalar", |res| unsafe { sys::k3_array_scalar(res, value, dtype.to_raw()) })
    }

    /// A 0-d integer array (exact for all of i64).
    #[track_caller]
    pub fn scalar_i64(value: i64, dtype: Dtype) -> Result<Array> {
        // SAFETY: plain out-parameter call.
        Array::try_from_op("scalar", |res| unsafe { sys::k3_array_scalar_i64(res, value, dtype.to_raw()) })
    }

    /// A 0-d array of `value`'s own dtype.
    #[track_caller]
    pub fn scalar<T: Element>(value: T) -> Result<Array> {
        Array::from_slice(&[value], &[])
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        let mut n = 0;
        // SAFETY: self.raw is a live handle.
        unsafe { sys::k3_array_ndim(&mut n, self.raw) };
        n
    }

    /// The shape.
    pub fn shape(&self) -> Vec<i32> {
        let n = self.ndim();
        let mut p: *const i32 = ptr::null();
        // SAFETY: the pointer refers to the array's own shape storage, valid while self lives; copied at once.
        unsafe {
            if sys::k3_array_shape(&mut p, self.raw) != 0 || p.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(p, n).to_vec()
        }
    }

    /// The size of axis `axis` (negative counts from the end).
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let a = if axis < 0 { axis + n } else { axis };
        if a < 0 || a >= n {
            return Err(Error::invalid("dim", format!("axis {axis} is out of range for {n} dimensions")));
        }
        Ok(shape[a as usize])
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        let mut n = 0;
        // SAFETY: live handle.
        unsafe { sys::k3_array_size(&mut n, self.raw) };
        n
    }

    /// Bytes the elements occupy.
    pub fn nbytes(&self) -> usize {
        let mut n = 0;
        // SAFETY: live handle.
        unsafe { sys::k3_array_nbytes(&mut n, self.raw) };
        n
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        let mut d = sys::k3_dtype::K3_FLOAT32;
        // SAFETY: live handle.
        unsafe { sys::k3_array_dtype(&mut d, self.raw) };
        Dtype::from_raw(d)
    }

    /// A unique id of the underlying array (shared by clones).
    pub fn id(&self) -> usize {
        let mut id = 0;
        // SAFETY: live handle.
        unsafe { sys::k3_array_id(&mut id, self.raw) };
        id
    }

    /// Whether the array has been evaluated (its data exists).
    pub fn is_evaluated(&self) -> bool {
        let mut b = false;
        // SAFETY: live handle.
        unsafe { sys::k3_array_is_available(&mut b, self.raw) };
        b
    }

    /// Evaluates the array (runs its graph) and waits for the result.
    #[track_caller]
    pub fn eval(&self) -> Result<()> {
        eval(&[self])
    }

    /// Starts evaluating without waiting; a later [`Array::eval`] or read waits for it.
    #[track_caller]
    pub fn async_eval(&self) -> Result<()> {
        async_eval(&[self])
    }

    /// Copies the elements out (row-major), evaluating first. `T` must match the dtype exactly.
    #[track_caller]
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        sync_trace::record(Kind::Read);
        self.read_vec()
    }

    /// [`Array::to_vec`] without recording (its callers record one read).
    #[track_caller]
    fn read_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return Err(Error::Dtype { op: "to_vec", expected: T::DTYPE, found: self.dtype() });
        }
        let c = self.contiguous()?;
        eval_untraced(&[&c])?;
        let n = c.size();
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut p: *const c_void = ptr::null();
        // SAFETY: c is evaluated and row-contiguous (the shim checks both), holding n elements of T.
        unsafe {
            check("to_vec", sys::k3_array_data(&mut p, c.raw))?;
            Ok(std::slice::from_raw_parts(p.cast::<T>(), n).to_vec())
        }
    }

    /// The elements as f32 (any real dtype is converted first).
    #[track_caller]
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        sync_trace::record(Kind::Read);
        if self.dtype() == Dtype::F32 {
            self.read_vec()
        } else {
            self.astype(Dtype::F32)?.read_vec()
        }
    }

    /// The single element of a one-element array.
    #[track_caller]
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::invalid("item", format!("the array has {} elements, not 1", self.size())));
        }
        sync_trace::record(Kind::Read);
        Ok(self.read_vec::<T>()?[0])
    }

    /// Human-readable contents (evaluates the array), as MLX prints it.
    #[track_caller]
    pub fn to_string_eval(&self) -> Result<String> {
        sync_trace::record(Kind::Read);
        let mut s: *mut std::os::raw::c_char = ptr::null_mut();
        // SAFETY: on success s is a malloc'd NUL-terminated string that we free with k3_string_free.
        unsafe {
            check("to_string", sys::k3_array_to_string(&mut s, self.raw))?;
            let out = std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned();
            sys::k3_string_free(s);
            Ok(out)
        }
    }
}

fn check_len(op: &'static str, len: usize, shape: &[i32]) -> Result<()> {
    if shape.iter().any(|&d| d < 0) {
        return Err(Error::invalid(op, format!("negative dimension in shape {shape:?}")));
    }
    let n: usize = shape.iter().map(|&d| d as usize).product();
    if n != len {
        return Err(Error::invalid(op, format!("{len} elements cannot fill shape {shape:?} ({n} elements)")));
    }
    Ok(())
}

impl Clone for Array {
    fn clone(&self) -> Self {
        let mut res = sys::k3_array { ctx: ptr::null_mut() };
        // SAFETY: copying an mlx::core::array only bumps a reference count; the shim's copy cannot fail short
        // of running out of memory, where aborting matches Rust's own allocation-failure behaviour.
        let status = unsafe { sys::k3_array_clone(&mut res, self.raw) };
        if status != 0 || res.ctx.is_null() {
            std::process::abort();
        }
        Array { raw: res }
    }
}

impl Drop for Array {
    fn drop(&mut self) {
        // SAFETY: we own the handle; the shim never throws from free.
        unsafe { sys::k3_array_free(self.raw) };
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array(shape={:?}, dtype={})", self.shape(), self.dtype())
    }
}

/// Evaluates several arrays together (one graph walk) and waits.
#[track_caller]
pub fn eval(arrays: &[&Array]) -> Result<()> {
    sync_trace::record(Kind::Eval);
    eval_untraced(arrays)
}

#[track_caller]
fn eval_untraced(arrays: &[&Array]) -> Result<()> {
    let raws: Vec<sys::k3_array> = arrays.iter().map(|a| a.raw).collect();
    // SAFETY: live handles for the duration of the call.
    check("eval", unsafe { sys::k3_eval(raws.as_ptr(), raws.len()) })
}

/// Starts evaluating several arrays without waiting.
#[track_caller]
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    sync_trace::record(Kind::AsyncEval);
    let raws: Vec<sys::k3_array> = arrays.iter().map(|a| a.raw).collect();
    // SAFETY: live handles for the duration of the call.
    check("async_eval", unsafe { sys::k3_async_eval(raws.as_ptr(), raws.len()) })
}

/// Nodes of the pending graph behind `arrays`: the unscheduled arrays MLX would schedule to evaluate them
/// (evaluated arrays and constants are not counted), only those whose primitive is named `primitive` when
/// given (MLX's names, e.g. `"Contiguous"`, or ours, e.g. `"K3RmsNorm"`). A diagnostic: each node costs MLX
/// scheduling work in every decode step, so the decode tests bound it.
pub fn graph_nodes(arrays: &[&Array], primitive: Option<&str>) -> Result<usize> {
    let raws: Vec<sys::k3_array> = arrays.iter().map(|a| a.raw).collect();
    let name = primitive
        .map(std::ffi::CString::new)
        .transpose()
        .map_err(|_| crate::Error::invalid("graph_nodes", "the primitive name contains a NUL byte"))?;
    let mut n = 0usize;
    // SAFETY: live handles and a NUL-terminated name (or null) for the duration of the call; writes one usize.
    check("graph_nodes", unsafe {
        sys::k3_graph_nodes(&mut n, raws.as_ptr(), raws.len(), name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
    })?;
    Ok(n)
}

/// One primitive of a pending graph, as [`graph_census`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphCensusRow {
    /// MLX's name of the primitive (e.g. `"Reshape"`, `"K3RmsNorm"`).
    pub primitive: String,
    /// Pending nodes with this primitive (a multi-output primitive counts once).
    pub nodes: usize,
    /// The pending nodes that consume their outputs: (primitive name, edges), by name.
    pub consumers: Vec<(String, usize)>,
}

/// The pending graph behind `arrays` grouped by primitive, most nodes first, with what each kind feeds: a
/// diagnostic for finding where a decode step's nodes come from (`mlx-k3 bench --graph`).
pub fn graph_census(arrays: &[&Array]) -> Result<Vec<GraphCensusRow>> {
    let raws: Vec<sys::k3_array> = arrays.iter().map(|a| a.raw).collect();
    let mut s: *mut std::os::raw::c_char = ptr::null_mut();
    // SAFETY: live handles for the duration of the call; on success s is a malloc'd NUL-terminated string
    // that we free with k3_string_free.
    let text = unsafe {
        check("graph_census", sys::k3_graph_census(&mut s, raws.as_ptr(), raws.len()))?;
        let t = std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned();
        sys::k3_string_free(s);
        t
    };
    let bad = || crate::Error::invalid("graph_census", "malformed census line from the shim");
    let mut rows = Vec::new();
    for line in text.lines() {
        let mut f = line.splitn(3, '\t');
        let nodes = f.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
        let primitive = f.next().ok_or_else(bad)?.to_string();
        let mut consumers = Vec::new();
        for c in f.next().unwrap_or("").split(", ").filter(|c| !c.is_empty()) {
            let (name, k) = c.rsplit_once(" x").ok_or_else(bad)?;
            consumers.push((name.to_string(), k.parse().map_err(|_| bad())?));
        }
        rows.push(GraphCensusRow { primitive, nodes, consumers });
    }
    Ok(rows)
}

/// The stream argument for shim calls made now on this thread.
pub(crate) fn s() -> sys::k3_stream {
    current_raw()
}
