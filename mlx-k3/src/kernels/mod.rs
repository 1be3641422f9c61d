//! mlx-k3's custom kernels (the primitives of `mlx-k3-metal`), each next to the plain-ops reference it is
//! tested against.

mod attn_res;
mod combine;
mod dense;
mod gate_up;
mod indexer;
mod kda_step;
mod norm;
mod router;
mod situ;

pub use attn_res::{attn_res_mix, attn_res_mix_reference, attn_res_supported};
pub use combine::{moe_combine, moe_combine_reference};
pub use dense::{set_reference_blas, sgemm_calls, sgemm_path};
pub use gate_up::{gate_up_fusable, gather_codebook_gate_up_situ, gather_gate_up_situ, Situ};
pub(crate) use indexer::count_fused_indexer_step;
pub use indexer::{
    fused_indexer, fused_indexer_steps, indexer_scores_reference, indexer_topk, indexer_topk_reference,
    set_fused_indexer,
};
pub use kda_step::{gated_delta_scan, kda_step, kda_step_reference, kda_step_supported, KdaStepInputs, KdaWeights};
pub use norm::{log_softmax, rms_norm};
pub use router::{moe_router, route_reference, RouterParams, Routing};
pub use situ::{situ, situ_reference};

thread_local! {
    static DIFFERENTIABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread builds differentiable graphs (see [`differentiable_scope`]).
pub fn differentiable() -> bool {
    DIFFERENTIABLE.with(|d| d.get())
}

/// Restores the previous [`differentiable`] setting when dropped.
#[derive(Debug)]
pub struct DifferentiableScope(bool);

impl Drop for DifferentiableScope {
    fn drop(&mut self) {
        let prev = self.0;
        DIFFERENTIABLE.with(|d| d.set(prev));
    }
}

/// Until the returned guard is dropped, the model's layers built and run on this thread use the plain-ops
/// references (or MLX's own ops) instead of the fused inference-only primitives that have no vjp (RMSNorm,
/// SiTU, the fused gate/up, the router, the MoE combine, attention-residual mixing, the KDA scan), so that
/// `transforms::vjp` can differentiate a decoder layer (DWQ). The quantized matmuls keep their kernels: they
/// have a vjp. Results equal the fused kernels' up to the order of f32 additions.
pub fn differentiable_scope() -> DifferentiableScope {
    DifferentiableScope(DIFFERENTIABLE.with(|d| d.replace(true)))
}

/// Threads the CPU kernels split their work over (default: `K3_NUM_THREADS` or all hardware threads).
pub fn num_threads() -> usize {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_num_threads() }.max(1) as usize
}

/// Sets the CPU kernels' thread count; 0 restores the default.
pub fn set_num_threads(n: usize) {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_set_num_threads(n.min(i32::MAX as usize) as i32) };
}

/// Activation precision of the codebook kernels (`codebook_qmm`, the gathered and tiered stacks, the fused
/// gate/up): f32 (the default) or int8 per 256-weight chunk (q8 mode, the activation format llama.cpp's IQ1_S
/// dot product uses): about 2x faster on AVX2, at the cost of the activations' rounding (~1% of the output
/// scale). Only codebook weights are affected; MLX's formats keep f32 activations (their results must match
/// MLX's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QmmActivations {
    /// f32 activations (exact products; the default).
    F32,
    /// int8 activations, one f32 scale per 256-weight chunk.
    Q8,
}

/// Sets the codebook kernels' activation precision for ops built afterwards; `None` returns to the
/// environment's choice (`K3_QMM_ACT=q8|f32`, unset = f32).
pub fn set_qmm_activations(mode: Option<QmmActivations>) {
    let m = match mode {
        None => -1,
        Some(QmmActivations::F32) => 0,
        Some(QmmActivations::Q8) => 1,
    };
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_set_act_q8(m) };
}

/// The codebook kernels' activation precision now; an error names `K3_QMM_ACT` when it holds
/// something other than `q8` or `f32`.
pub fn qmm_activations() -> crate::Result<QmmActivations> {
    let mut on = 0;
    // SAFETY: writes one int.
    crate::error::check("qmm_activations", unsafe { mlx_k3_metal::k3_kernels_act_q8(&mut on) })?;
    Ok(if on == 1 { QmmActivations::Q8 } else { QmmActivations::F32 })
}

/// Turns the kernels' SIMD paths off (`true`) or back on, so tests can check the scalar paths on SIMD CPUs.
pub fn force_scalar(on: bool) {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_force_scalar(on) };
}

/// Whether the AVX-512 kernels run where the CPU has them: `Some(false)` keeps to the AVX2 ones, `Some(true)`
/// allows them, `None` returns to the environment's choice (`K3_AVX512=0|1`, unset = 1). Read when a kernel
/// runs; results differ only in the order of f32 additions. (A no-op off x86-64.)
pub fn set_avx512(mode: Option<bool>) {
    // SAFETY: plain call.
    unsafe { mlx_k3_metal::k3_kernels_set_avx512(mode.map_or(-1, i32::from)) };
}

/// Whether the AVX-512 kernels run now (the CPU has AVX-512 F/BW/DQ/VL, the SIMD paths are on and neither
/// `set_avx512(Some(false))` nor `K3_AVX512=0` turned them off); an error names `K3_AVX512` when it holds
/// something other than `0` or `1`.
pub fn avx512() -> crate::Result<bool> {
    let mut on = 0;
    // SAFETY: writes one int.
    crate::error::check("avx512", unsafe { mlx_k3_metal::k3_kernels_avx512(&mut on) })?;
    Ok(on == 1)
}

/// `x @ Wᵀ` for an MLX-quantized weight through the project's CPU kernels where they apply (affine 2-8-bit,
/// mxfp4, on AVX2+FMA or NEON), else MLX's own op ([`crate::quant::quantized_matmul`]); same layouts either
/// way. Named apart from MLX's op, which always runs MLX's kernels.
pub fn fast_quantized_matmul(
    x: &crate::Array,
    q: &crate::quant::Quantized,
    spec: crate::quant::QuantSpec,
) -> crate::Result<crate::Array> {
    let st = crate::array::s();
    let mode = quant_mode_c(spec.mode);
    // SAFETY: live handles (or null) in, new handle out.
    crate::Array::try_from_op("quantized_matmul", |res| unsafe {
        mlx_k3_metal::k3_fast_quantized_matmul(
            res,
            x.as_raw(),
            q.weight.as_raw(),
            q.scales.as_raw(),
            crate::Array::raw_opt(q.biases.as_ref()),
            spec.group_size,
            spec.bits,
            mode.as_ptr(),
            st,
        )
    })
}

/// Several [`fast_quantized_matmul`]s of the same `x`, one result per weight. When every weight takes the
/// project's CPU kernels they run as one graph node with one output each (each identical to
/// [`fast_quantized_matmul`]'s: the same row kernels), sharing the activations' preparation and one parallel job;
/// otherwise each runs as [`fast_quantized_matmul`] would.
pub fn fast_quantized_matmul_many(
    x: &crate::Array,
    ws: &[(&crate::quant::Quantized, crate::quant::QuantSpec)],
) -> crate::Result<Vec<crate::Array>> {
    let st = crate::array::s();
    let w: Vec<_> = ws.iter().map(|(q, _)| q.weight.as_raw()).collect();
    let scales: Vec<_> = ws.iter().map(|(q, _)| q.scales.as_raw()).collect();
    let biases: Vec<_> = ws.iter().map(|(q, _)| crate::Array::raw_opt(q.biases.as_ref())).collect();
    let groups: Vec<i32> = ws.iter().map(|(_, s)| s.group_size).collect();
    let bits: Vec<i32> = ws.iter().map(|(_, s)| s.bits).collect();
    let modes: Vec<*const std::os::raw::c_char> = ws.iter().map(|(_, s)| quant_mode_c(s.mode).as_ptr()).collect();
    // SAFETY: live handles (or null biases), n entries in every slice, n output slots.
    crate::ops::shape::multi_output("quantized_matmul_many", ws.len(), |res, cap, n| unsafe {
        mlx_k3_metal::k3_fast_quantized_matmul_multi(
            res,
            cap,
            n,
            x.as_raw(),
            w.as_ptr(),
            scales.as_ptr(),
            biases.as_ptr(),
            groups.as_ptr(),
            bits.as_ptr(),
            modes.as_ptr(),
            ws.len(),
            st,
        )
    })
}

/// `gather_qmm` (transpose = true) through the project's CPU kernels where they apply, else MLX's op.
pub fn gather_qmm(
    x: &crate::Array,
    q: &crate::quant::Quantized,
    spec: crate::quant::QuantSpec,
    lhs: Option<&crate::Array>,
    rhs: Option<&crate::Array>,
    sorted: bool,
) -> crate::Result<crate::Array> {
    let st = crate::array::s();
    let mode = quant_mode_c(spec.mode);
    // SAFETY: live handles (or null) in, new handle out.
    crate::Array::try_from_op("gather_qmm", |res| unsafe {
        mlx_k3_metal::k3_fast_gather_qmm(
            res,
            x.as_raw(),
            q.weight.as_raw(),
            q.scales.as_raw(),
            crate::Array::raw_opt(q.biases.as_ref()),
            crate::Array::raw_opt(lhs),
            crate::Array::raw_opt(rhs),
            spec.group_size,
            spec.bits,
            mode.as_ptr(),
            sorted,
            st,
        )
    })
}

fn quant_mode_c(mode: crate::quant::QuantMode) -> &'static std::ffi::CStr {
    match mode {
        crate::quant::QuantMode::Affine => c"affine",
        crate::quant::QuantMode::Mxfp4 => c"mxfp4",
        crate::quant::QuantMode::Mxfp8 => c"mxfp8",
        crate::quant::QuantMode::Nvfp4 => c"nvfp4",
    }
}
