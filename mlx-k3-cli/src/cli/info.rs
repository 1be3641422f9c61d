//! `mlx-k3 info`.

use mlx_k3::distributed::Backend;
use mlx_k3::{kernels, Device, Result};

pub(super) fn run() -> Result<()> {
    println!("mlx-k3 {}", env!("CARGO_PKG_VERSION"));
    println!("MLX {} (found at {})", mlx_k3::mlx_version(), mlx_k3::MLX_ORIGIN);
    println!("default device: {:?}", Device::default_device()?);
    for d in [Device::Cpu, Device::Gpu] {
        println!("  {:?}: {}", d, if d.is_available() { format!("{} available", d.count()) } else { "none".into() });
    }
    let backends: Vec<&str> = [Backend::Ring, Backend::Jaccl, Backend::Nccl, Backend::Mpi]
        .into_iter()
        .filter(|b| b.is_available())
        .map(|b| b.name())
        .collect();
    println!("distributed back-ends: {}", if backends.is_empty() { "none".into() } else { backends.join(", ") });
    println!("CPU kernel threads: {}", kernels::num_threads());
    let act = match kernels::qmm_activations()? {
        kernels::QmmActivations::F32 => "f32",
        kernels::QmmActivations::Q8 => "q8 (int8 per 256, K3_QMM_ACT)",
    };
    println!("quantized-kernel activations: {act}");
    println!(
        "codebook layout in memory: {} (--codebook-layout, K3_CODEBOOK_LAYOUT)",
        mlx_k3::codebook::load_layout()?.name()
    );
    // (The 8-bit affine kernel with f32 activations; K3_AVX512=0 keeps to AVX2.)
    println!("AVX-512 kernels: {}", if kernels::avx512()? { "on" } else { "off" });
    println!("dense f32 matmul: {}", kernels::sgemm_path());
    Ok(())
}
