//! Element types of arrays and the Rust types that map onto them.

use std::fmt;

use half::{bf16, f16};
use mlx_k3_sys::k3_dtype;

/// The element type of an [`Array`](crate::Array), as MLX names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `bool_` (1 byte).
    Bool,
    /// `uint8`.
    U8,
    /// `uint16`.
    U16,
    /// `uint32`.
    U32,
    /// `uint64`.
    U64,
    /// `int8`.
    I8,
    /// `int16`.
    I16,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `float16`.
    F16,
    /// `float32`.
    F32,
    /// `float64` (CPU only in MLX).
    F64,
    /// `bfloat16`.
    BF16,
    /// `complex64`.
    C64,
}

impl Dtype {
    /// Every dtype, in MLX's order.
    pub const ALL: [Dtype; 14] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::U16,
        Dtype::U32,
        Dtype::U64,
        Dtype::I8,
        Dtype::I16,
        Dtype::I32,
        Dtype::I64,
        Dtype::F16,
        Dtype::F32,
        Dtype::F64,
        Dtype::BF16,
        Dtype::C64,
    ];

    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 | Dtype::C64 => 8,
        }
    }

    /// True for the real floating-point dtypes.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::F32 | Dtype::F64 | Dtype::BF16)
    }

    /// True for the signed and unsigned integer dtypes.
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 | Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64
        )
    }

    /// MLX's name (`float32`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::U16 => "uint16",
            Dtype::U32 => "uint32",
            Dtype::U64 => "uint64",
            Dtype::I8 => "int8",
            Dtype::I16 => "int16",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::F16 => "float16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::BF16 => "bfloat16",
            Dtype::C64 => "complex64",
        }
    }

    /// Parses MLX / safetensors names (`float32`, `F32`, `bfloat16`, `BF16`, ...).
    pub fn from_name(name: &str) -> Option<Dtype> {
        let n = name.to_ascii_lowercase();
        Some(match n.as_str() {
            "bool" | "bool_" => Dtype::Bool,
            "uint8" | "u8" => Dtype::U8,
            "uint16" | "u16" => Dtype::U16,
            "uint32" | "u32" => Dtype::U32,
            "uint64" | "u64" => Dtype::U64,
            "int8" | "i8" => Dtype::I8,
            "int16" | "i16" => Dtype::I16,
            "int32" | "i32" => Dtype::I32,
            "int64" | "i64" => Dtype::I64,
            "float16" | "f16" | "half" => Dtype::F16,
            "float32" | "f32" | "float" => Dtype::F32,
            "float64" | "f64" | "double" => Dtype::F64,
            "bfloat16" | "bf16" => Dtype::BF16,
            "complex64" | "c64" => Dtype::C64,
            _ => return None,
        })
    }

    pub(crate) fn to_raw(self) -> k3_dtype {
        k3_dtype(Dtype::ALL.iter().position(|d| *d == self).unwrap() as u32)
    }

    pub(crate) fn from_raw(raw: k3_dtype) -> Dtype {
        // The shim only hands out codes it defines (0..=13).
        Dtype::ALL.get(raw.0 as usize).copied().unwrap_or(Dtype::F32)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type whose values are stored as one MLX element (same size and bit layout).
///
/// # Safety
/// `DTYPE` must have exactly the size and layout of `Self`.
pub unsafe trait Element: Copy + Send + 'static {
    /// The matching MLX dtype.
    const DTYPE: Dtype;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            // SAFETY: sizes and layouts match MLX's element types.
            unsafe impl Element for $t {
                const DTYPE: Dtype = Dtype::$d;
            }
        )*
    };
}

element!(bool => Bool, u8 => U8, u16 => U16, u32 => U32, u64 => U64, i8 => I8, i16 => I16, i32 => I32,
         i64 => I64, f16 => F16, f32 => F32, f64 => F64, bf16 => BF16);
