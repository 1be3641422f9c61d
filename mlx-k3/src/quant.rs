//! MLX quantization: `quantize`, `dequantize`, `quantized_matmul` and `gather_qmm` in every MLX mode
//! (docs/formats.md#mlx-quantization): affine (1-8 bits; groups of 32, 64 or 128), mxfp4, mxfp8 (groups of 32) and nvfp4
//! (groups of 16, optional global scale). Quantization runs along the last axis.

use std::ffi::CStr;

use mlx_k3_sys as sys;

use crate::array::s;
use crate::ops::shape::multi_output;
use crate::{Array, Dtype, Error, Result};

/// A quantization mode of MLX.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantMode {
    /// Integer codes with a per-group scale and bias (`w = s * q + b`).
    Affine,
    /// E2M1 codes with a power-of-two (E8M0) scale per 32.
    Mxfp4,
    /// E4M3 codes with a power-of-two (E8M0) scale per 32.
    Mxfp8,
    /// E2M1 codes with an E4M3 scale per 16 (and an optional f32 global scale).
    Nvfp4,
}

impl QuantMode {
    /// MLX's name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }

    fn c_name(self) -> &'static CStr {
        match self {
            QuantMode::Affine => c"affine",
            QuantMode::Mxfp4 => c"mxfp4",
            QuantMode::Mxfp8 => c"mxfp8",
            QuantMode::Nvfp4 => c"nvfp4",
        }
    }

    /// Parses MLX's mode names.
    pub fn from_name(name: &str) -> Option<QuantMode> {
        Some(match name {
            "affine" => QuantMode::Affine,
            "mxfp4" => QuantMode::Mxfp4,
            "mxfp8" => QuantMode::Mxfp8,
            "nvfp4" => QuantMode::Nvfp4,
            _ => return None,
        })
    }

    /// Whether the mode stores a per-group bias (only affine does).
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

/// Group size, bits and mode of a quantized tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Elements per group along the last axis.
    pub group_size: i32,
    /// Bits per element.
    pub bits: i32,
    /// The mode.
    pub mode: QuantMode,
}

impl QuantSpec {
    /// Affine with the given group size and bits.
    pub fn affine(group_size: i32, bits: i32) -> Self {
        QuantSpec { group_size, bits, mode: QuantMode::Affine }
    }

    /// The mode with MLX's default group size and bits (affine: 64 and 4; mxfp4: 32 and 4; mxfp8: 32 and 8;
    /// nvfp4: 16 and 4).
    pub fn default_for(mode: QuantMode) -> Self {
        let (group_size, bits) = match mode {
            QuantMode::Affine => (64, 4),
            QuantMode::Mxfp4 => (32, 4),
            QuantMode::Mxfp8 => (32, 8),
            QuantMode::Nvfp4 => (16, 4),
        };
        QuantSpec { group_size, bits, mode }
    }
}

impl QuantSpec {
    /// Rejects group sizes and bit widths MLX would divide by before validating (0 crashes the process
    /// with SIGFPE inside MLX) and negative values (the shim reads those as "MLX's default").
    fn validate(&self, op: &'static str) -> Result<()> {
        if self.group_size <= 0 || self.bits <= 0 {
            return Err(Error::invalid(
                op,
                format!("group_size and bits must be positive, got group_size={} bits={}", self.group_size, self.bits),
            ));
        }
        Ok(())
    }
}

/// A quantized tensor: packed codes (uint32), per-group scales, and biases for affine.
#[derive(Clone, Debug)]
pub struct Quantized {
    /// Packed codes, `(..., K * bits / 32)` uint32.
    pub weight: Array,
    /// Per-group scales, `(..., K / group_size)`: the weight's dtype for affine, uint8 otherwise.
    pub scales: Array,
    /// Per-group biases (affine only).
    pub biases: Option<Array>,
}

/// Quantizes `w` along its last axis. `global_scale` is for nvfp4 only.
#[track_caller]
pub fn quantize(w: &Array, spec: QuantSpec, global_scale: Option<&Array>) -> Result<Quantized> {
    spec.validate("quantize")?;
    let st = s();
    // SAFETY: live handles in; the shim writes at most 3 outputs.
    let mut out = multi_output("quantize", 3, |res, cap, n| unsafe {
        sys::k3_quantize(
            res,
            cap,
            n,
            w.as_raw(),
            spec.group_size,
            spec.bits,
            spec.mode.c_name().as_ptr(),
            Array::raw_opt(global_scale),
            st,
        )
    })?;
    let biases = if out.len() == 3 { out.pop() } else { None };
    let scales = out.pop().ok_or_else(|| Error::invalid("quantize", "MLX returned no scales"))?;
    let weight = out.pop().ok_or_else(|| Error::invalid("quantize", "MLX returned no weights"))?;
    Ok(Quantized { weight, scales, biases })
}

/// Reconstructs the floating-point tensor; `dtype` defaults to the scales' dtype (bf16 for the fp modes).
#[track_caller]
pub fn dequantize(q: &Quantized, spec: QuantSpec, global_scale: Option<&Array>, dtype: Option<Dtype>) -> Result<Array> {
    spec.validate("dequantize")?;
    let st = s();
    let out_dtype = dtype.map(|d| d.to_raw().0 as i32).unwrap_or(-1);
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("dequantize", |res| unsafe {
        sys::k3_dequantize(
            res,
            q.weight.as_raw(),
            q.scales.as_raw(),
            Array::raw_opt(q.biases.as_ref()),
            spec.group_size,
            spec.bits,
            spec.mode.c_name().as_ptr(),
            Array::raw_opt(global_scale),
            out_dtype,
            st,
        )
    })
}

/// `x @ W^T` (`transpose = true`, W stored `(N, K)` and quantized along K) or `x @ W` (`transpose = false`,
/// W stored `(K, N)` and quantized along N).
#[track_caller]
pub fn quantized_matmul(x: &Array, q: &Quantized, spec: QuantSpec, transpose: bool) -> Result<Array> {
    spec.validate("quantized_matmul")?;
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("quantized_matmul", |res| unsafe {
        sys::k3_quantized_matmul(
            res,
            x.as_raw(),
            q.weight.as_raw(),
            q.scales.as_raw(),
            Array::raw_opt(q.biases.as_ref()),
            transpose,
            spec.group_size,
            spec.bits,
            spec.mode.c_name().as_ptr(),
            st,
        )
    })
}

/// Index arguments of [`gather_qmm`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Gather<'a> {
    /// Indices into the flattened batch dimensions of `x` (all, in order, when `None`).
    pub lhs_indices: Option<&'a Array>,
    /// Indices into the flattened batch dimensions of the weights (the expert ids).
    pub rhs_indices: Option<&'a Array>,
    /// A promise that `rhs_indices` is non-decreasing (lets GPU kernels reuse weight tiles).
    pub sorted_indices: bool,
    /// nvfp4 global scale.
    pub global_scale: Option<&'a Array>,
}

/// Quantized matmul with matrix-level gather over an expert stack (docs/formats.md#gathered-quantized-matmul).
#[track_caller]
pub fn gather_qmm(x: &Array, q: &Quantized, spec: QuantSpec, transpose: bool, g: Gather<'_>) -> Result<Array> {
    spec.validate("gather_qmm")?;
    let st = s();
    // SAFETY: live handles (or null) in, new handle out.
    Array::try_from_op("gather_qmm", |res| unsafe {
        sys::k3_gather_qmm(
            res,
            x.as_raw(),
            q.weight.as_raw(),
            q.scales.as_raw(),
            Array::raw_opt(q.biases.as_ref()),
            Array::raw_opt(g.lhs_indices),
            Array::raw_opt(g.rhs_indices),
            transpose,
            spec.group_size,
            spec.bits,
            spec.mode.c_name().as_ptr(),
            Array::raw_opt(g.global_scale),
            g.sorted_indices,
            st,
        )
    })
}
