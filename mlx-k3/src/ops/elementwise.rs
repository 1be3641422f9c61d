//! Elementwise math and comparisons.

use std::borrow::Cow;

use mlx_k3_sys as sys;

use crate::array::s;
use crate::{Array, Dtype, Result};

/// A right-hand operand of a binary op: an array, or a Rust scalar that takes the array's dtype (as Python
/// scalars do in MLX), so `x.multiply(0.5f32)` keeps a bf16 `x` in bf16.
pub trait Operand<'a> {
    /// The operand as an array shaped to broadcast against `like`.
    fn operand(self, like: &Array) -> Result<Cow<'a, Array>>;
}

impl<'a> Operand<'a> for &'a Array {
    fn operand(self, _like: &Array) -> Result<Cow<'a, Array>> {
        Ok(Cow::Borrowed(self))
    }
}

impl Operand<'static> for Array {
    fn operand(self, _like: &Array) -> Result<Cow<'static, Array>> {
        Ok(Cow::Owned(self))
    }
}

fn float_like(like: &Array) -> Dtype {
    if like.dtype().is_float() {
        like.dtype()
    } else {
        Dtype::F32
    }
}

fn int_like(like: &Array) -> Dtype {
    let d = like.dtype();
    if d.is_float() || d.is_integer() {
        d
    } else {
        Dtype::I32
    }
}

macro_rules! float_operand {
    ($($t:ty),*) => {$(
        impl Operand<'static> for $t {
            fn operand(self, like: &Array) -> Result<Cow<'static, Array>> {
                Ok(Cow::Owned(Array::scalar_as(self as f64, float_like(like))?))
            }
        }
    )*};
}
macro_rules! int_operand {
    ($($t:ty),*) => {$(
        impl Operand<'static> for $t {
            fn operand(self, like: &Array) -> Result<Cow<'static, Array>> {
                Ok(Cow::Owned(Array::scalar_i64(self as i64, int_like(like))?))
            }
        }
    )*};
}
float_operand!(f32, f64);
int_operand!(i32, i64, u32);

impl Operand<'static> for bool {
    fn operand(self, _like: &Array) -> Result<Cow<'static, Array>> {
        Ok(Cow::Owned(Array::scalar(self)?))
    }
}

macro_rules! unary {
    ($($name:ident $(= $doc:literal)?),* $(,)?) => {
        impl Array {$(
            #[doc = concat!("Elementwise `", stringify!($name), "`.", $(" ", $doc)?)]
            #[track_caller]
            pub fn $name(&self) -> Result<Array> {
                let st = s();
                // SAFETY: live handle in, new handle out.
                Array::try_from_op(stringify!($name), |res| unsafe { paste_sys::$name(res, self.as_raw(), st) })
            }
        )*}
    };
}

macro_rules! binary {
    ($($name:ident $(= $doc:literal)?),* $(,)?) => {
        impl Array {$(
            #[doc = concat!("Elementwise `", stringify!($name), "` with broadcasting.", $(" ", $doc)?)]
            #[track_caller]
            pub fn $name<'a>(&self, other: impl Operand<'a>) -> Result<Array> {
                let other = other.operand(self)?;
                let st = s();
                // SAFETY: live handles in, new handle out.
                Array::try_from_op(stringify!($name), |res| unsafe {
                    paste_sys::$name(res, self.as_raw(), other.as_raw(), st)
                })
            }
        )*}
    };
}

/// The shim's elementwise functions under their op names (k3_exp -> exp), so the macros can name them.
mod paste_sys {
    macro_rules! alias {
        ($($name:ident => $ffi:ident),* $(,)?) => { $(pub use mlx_k3_sys::$ffi as $name;)* };
    }
    alias!(abs => k3_abs, negative => k3_negative, sign => k3_sign, floor => k3_floor, ceil => k3_ceil,
        square => k3_square, sqrt => k3_sqrt, rsqrt => k3_rsqrt, reciprocal => k3_reciprocal, exp => k3_exp,
        expm1 => k3_expm1, log => k3_log, log1p => k3_log1p, log2 => k3_log2, sin => k3_sin, cos => k3_cos,
        tanh => k3_tanh, sigmoid => k3_sigmoid, erf => k3_erf, erfinv => k3_erfinv, logical_not => k3_logical_not,
        isnan => k3_isnan, isinf => k3_isinf, isfinite => k3_isfinite, stop_gradient => k3_stop_gradient,
        copy => k3_copy, bitwise_invert => k3_bitwise_invert,
        add => k3_add, subtract => k3_subtract, multiply => k3_multiply, divide => k3_divide, power => k3_power,
        maximum => k3_maximum, minimum => k3_minimum, equal => k3_equal, not_equal => k3_not_equal,
        greater => k3_greater, greater_equal => k3_greater_equal, less => k3_less, less_equal => k3_less_equal,
        logical_and => k3_logical_and, logical_or => k3_logical_or, logaddexp => k3_logaddexp,
        remainder => k3_remainder, floor_divide => k3_floor_divide, bitwise_and => k3_bitwise_and,
        bitwise_or => k3_bitwise_or, bitwise_xor => k3_bitwise_xor, left_shift => k3_left_shift,
        right_shift => k3_right_shift, arctan2 => k3_arctan2);
}

unary!(
    abs,
    negative,
    sign,
    floor,
    ceil,
    square,
    sqrt,
    rsqrt = "`1/sqrt(x)`.",
    reciprocal,
    exp,
    expm1 = "`exp(x) - 1`, accurate near 0.",
    log,
    log1p = "`log(1 + x)`, accurate near 0.",
    log2,
    sin,
    cos,
    tanh,
    sigmoid = "`1 / (1 + exp(-x))`.",
    erf,
    erfinv,
    logical_not,
    isnan,
    isinf,
    isfinite,
    stop_gradient,
    copy = "A new array with the same values.",
    bitwise_invert
);

binary!(
    add,
    subtract,
    multiply,
    divide,
    power,
    maximum,
    minimum,
    equal,
    not_equal,
    greater,
    greater_equal,
    less,
    less_equal,
    logical_and,
    logical_or,
    logaddexp = "`log(exp(a) + exp(b))` computed stably.",
    remainder,
    floor_divide,
    bitwise_and,
    bitwise_or,
    bitwise_xor,
    left_shift,
    right_shift,
    arctan2
);

impl Array {
    /// `softplus(x) = log(1 + exp(x))`, computed stably as `logaddexp(x, 0)`.
    #[track_caller]
    pub fn softplus(&self) -> Result<Array> {
        self.logaddexp(0.0f32)
    }

    /// `silu(x) = x * sigmoid(x)`.
    #[track_caller]
    pub fn silu(&self) -> Result<Array> {
        self.multiply(&self.sigmoid()?)
    }

    /// Clips to `[lo, hi]`; either bound may be `None`.
    #[track_caller]
    pub fn clip(&self, lo: Option<f64>, hi: Option<f64>) -> Result<Array> {
        let d = self.dtype();
        let lo = lo.map(|v| Array::scalar_as(v, d)).transpose()?;
        let hi = hi.map(|v| Array::scalar_as(v, d)).transpose()?;
        let st = s();
        // SAFETY: live handles (or null for none) in, new handle out.
        Array::try_from_op("clip", |res| unsafe {
            sys::k3_clip(res, self.as_raw(), Array::raw_opt(lo.as_ref()), Array::raw_opt(hi.as_ref()), st)
        })
    }

    /// Rounds to `decimals` decimal places (half to even).
    #[track_caller]
    pub fn round(&self, decimals: i32) -> Result<Array> {
        let st = s();
        // SAFETY: live handle in, new handle out.
        Array::try_from_op("round", |res| unsafe { sys::k3_round(res, self.as_raw(), decimals, st) })
    }

    /// A 0-d bool: all elements within `atol + rtol * |other|`.
    #[track_caller]
    pub fn allclose(&self, other: &Array, rtol: f64, atol: f64) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("allclose", |res| unsafe {
            sys::k3_allclose(res, self.as_raw(), other.as_raw(), rtol, atol, false, st)
        })
    }

    /// A 0-d bool: same shape and equal values.
    #[track_caller]
    pub fn array_equal(&self, other: &Array) -> Result<Array> {
        let st = s();
        // SAFETY: live handles in, new handle out.
        Array::try_from_op("array_equal", |res| unsafe {
            sys::k3_array_equal(res, self.as_raw(), other.as_raw(), false, st)
        })
    }
}

/// `cond ? x : y` elementwise, with broadcasting.
#[track_caller]
pub fn where_(cond: &Array, x: &Array, y: &Array) -> Result<Array> {
    let st = s();
    // SAFETY: live handles in, new handle out.
    Array::try_from_op("where", |res| unsafe { sys::k3_where(res, cond.as_raw(), x.as_raw(), y.as_raw(), st) })
}
