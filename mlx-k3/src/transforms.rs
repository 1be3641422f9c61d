//! Automatic differentiation: MLX's `vjp` and `value_and_grad` over Rust closures.
//!
//! A closure `Fn(&[Array]) -> Result<Vec<Array>>` is handed to MLX through the shim as a C callback with a
//! context pointer (`k3_function`). MLX calls it while it traces the function; its inputs and outputs travel
//! as vectors of array handles. Failures cross the C ABI the way every shim error does, as a status and a
//! thread-local message, and never as an unwind:
//!
//! - the closure returns `Err`: the callback records the error, returns non-zero, and the shim throws a C++
//!   exception from inside MLX's transform, which MLX unwinds like its own errors; the shim catches it at its
//!   boundary and returns non-zero, and the caller gets the closure's own error back, unchanged;
//! - the closure panics: the callback catches the panic (it never unwinds into C++) and it becomes an
//!   [`Error::InvalidArgument`] naming the transform and quoting the panic's message;
//! - an MLX op fails inside the transform (including the backward pass, e.g. a primitive without a vjp): the
//!   shim catches the exception and the caller gets [`Error::Mlx`].
//!
//! ```no_run
//! use mlx_k3::{transforms, Array};
//! let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
//! // d/dx sum(x^2) = 2x
//! let g = transforms::grad(|a: &[Array]| Ok(vec![a[0].square()?.sum_all(false)?]), &[x], &[0])?;
//! assert_eq!(g[0].to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//! # Ok::<(), mlx_k3::Error>(())
//! ```

use std::any::Any;
use std::ffi::{c_void, CString};
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use mlx_k3_sys as sys;

use crate::array::s;
use crate::error::check;
use crate::{Array, Error, Result};

/// A vector of arrays owned by the shim (`k3_arrays`).
struct Arrays(sys::k3_arrays);

impl Arrays {
    fn new(op: &'static str) -> Result<Arrays> {
        let mut v = sys::k3_arrays { ctx: ptr::null_mut() };
        // SAFETY: writes a new vector handle.
        check(op, unsafe { sys::k3_arrays_new(&mut v) })?;
        Ok(Arrays(v))
    }

    fn into_vec(self, op: &'static str) -> Result<Vec<Array>> {
        read(op, self.0)
    }
}

impl Drop for Arrays {
    fn drop(&mut self) {
        // SAFETY: we own the handle; freeing never throws.
        unsafe { sys::k3_arrays_free(self.0) };
    }
}

/// New handles to the arrays of a (borrowed) vector.
fn read(op: &'static str, v: sys::k3_arrays) -> Result<Vec<Array>> {
    let mut n = 0usize;
    // SAFETY: `v` is a live vector handle.
    check(op, unsafe { sys::k3_arrays_len(&mut n, v) })?;
    (0..n)
        // SAFETY: i < len; the shim writes a new handle.
        .map(|i| Array::try_from_op(op, |res| unsafe { sys::k3_arrays_get(res, v, i) }))
        .collect()
}

/// What the callback needs: the closure, and where it leaves the error that stopped it.
struct Payload<'a> {
    op: &'static str,
    f: &'a dyn Fn(&[Array]) -> Result<Vec<Array>>,
    failure: Option<Error>,
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        String::from("(a panic payload that is not a string)")
    }
}

/// The `k3_function` MLX calls: runs the closure on the traced inputs and appends its outputs. Nothing unwinds
/// out of it: an error or a panic is recorded in the payload and reported to the shim as status 1.
unsafe extern "C" fn callback(outputs: sys::k3_arrays, inputs: sys::k3_arrays, payload: *mut c_void) -> c_int {
    // SAFETY: `payload` is the `Payload` that `run` passed along with this callback; it outlives the shim
    // call, which is the only place this callback is invoked, on this thread.
    let p = unsafe { &mut *(payload as *mut Payload<'_>) };
    let (op, f) = (p.op, p.f);
    let run = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
        let ins = read(op, inputs)?;
        let outs = f(&ins)?;
        for o in &outs {
            // SAFETY: live vector and array handles; the shim copies the array (a reference count).
            check(op, unsafe { sys::k3_arrays_push(outputs, o.as_raw()) })?;
        }
        Ok(())
    }));
    let err = match run {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e,
        Err(panic) => Error::invalid(op, format!("the function panicked: {}", panic_text(panic.as_ref()))),
    };
    let text = CString::new(err.to_string().replace('\0', " ")).unwrap_or_default();
    // SAFETY: a valid C string; the shim copies it.
    unsafe { sys::k3_set_error(text.as_ptr()) };
    p.failure = Some(err);
    1
}

/// Calls a transform of the shim with `f` as its callback; the closure's own error wins over the shim's
/// message for the same failure.
#[track_caller]
fn run(
    op: &'static str,
    f: &dyn Fn(&[Array]) -> Result<Vec<Array>>,
    call: impl FnOnce(sys::k3_function, *mut c_void) -> c_int,
) -> Result<()> {
    let mut payload = Payload { op, f, failure: None };
    let status = call(Some(callback), &mut payload as *mut Payload<'_> as *mut c_void);
    if status != 0 {
        if let Some(e) = payload.failure.take() {
            return Err(e);
        }
    }
    check(op, status)
}

fn raw(arrays: &[Array]) -> Vec<sys::k3_array> {
    arrays.iter().map(Array::as_raw).collect()
}

/// The transforms run on this thread's current stream ([`crate::with_stream`], [`crate::with_device`]): the
/// closure's ops as always, and MLX's own work (its copies of the primals) there too.
///
/// The outputs of `f(primals)` and the vector-Jacobian product: for each primal, the cotangents (one per
/// output of `f`, shaped like it) pulled back through `f`.
#[track_caller]
pub fn vjp<F>(f: F, primals: &[Array], cotangents: &[Array]) -> Result<(Vec<Array>, Vec<Array>)>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    const OP: &str = "vjp";
    if primals.is_empty() {
        return Err(Error::invalid(OP, "no primals given"));
    }
    let (outputs, vjps) = (Arrays::new(OP)?, Arrays::new(OP)?);
    let (p, c) = (raw(primals), raw(cotangents));
    let st = s();
    run(OP, &f, |cb, payload| {
        // SAFETY: live handles; the callback and payload live through the call.
        unsafe { sys::k3_vjp(outputs.0, vjps.0, cb, payload, p.as_ptr(), p.len(), c.as_ptr(), c.len(), st) }
    })?;
    Ok((outputs.into_vec(OP)?, vjps.into_vec(OP)?))
}

/// The outputs of `f(primals)`, whose first must be a scalar (the loss), and its gradient with respect to
/// `primals[argnums[i]]` for each i. Outputs after the first are returned as they are and take no part in
/// the gradient.
#[track_caller]
pub fn value_and_grad<F>(f: F, primals: &[Array], argnums: &[usize]) -> Result<(Vec<Array>, Vec<Array>)>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    const OP: &str = "value_and_grad";
    if argnums.is_empty() {
        return Err(Error::invalid(OP, "no argnums given: name the primals to differentiate"));
    }
    if let Some(&bad) = argnums.iter().find(|&&i| i >= primals.len()) {
        return Err(Error::invalid(OP, format!("argnum {bad} is out of range for {} primals", primals.len())));
    }
    let args: Vec<i32> = argnums.iter().map(|&i| i as i32).collect();
    let (values, grads) = (Arrays::new(OP)?, Arrays::new(OP)?);
    let p = raw(primals);
    let st = s();
    run(OP, &f, |cb, payload| {
        // SAFETY: live handles; the callback and payload live through the call.
        unsafe {
            sys::k3_value_and_grad(values.0, grads.0, cb, payload, p.as_ptr(), p.len(), args.as_ptr(), args.len(), st)
        }
    })?;
    Ok((values.into_vec(OP)?, grads.into_vec(OP)?))
}

/// The gradient of `f`'s first output (a scalar) with respect to `primals[argnums[i]]`, for each i.
#[track_caller]
pub fn grad<F>(f: F, primals: &[Array], argnums: &[usize]) -> Result<Vec<Array>>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    Ok(value_and_grad(f, primals, argnums)?.1)
}
