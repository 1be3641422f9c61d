//! `cargo run --release --example generate`: the README's first command.
//!
//! What it does today: the model graph, tokenizer and generation engine come with their own issues, so this
//! example proves the stack underneath them on this machine: it reports the MLX wheel the build found,
//! the devices present, then runs the SiTU primitive (the first custom kernel) against its plain-ops
//! reference on every available device and prints the agreement and the time of each. When the model
//! lands this example generates text with the embedded default model instead.

use std::time::Instant;

use mlx_k3::kernels::{situ, situ_reference};
use mlx_k3::{random, with_device, Device, Dtype, Result};

fn main() {
    if let Err(e) = run() {
        eprintln!("generate: error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    println!("mlx-k3 {} on MLX {} ({})", env!("CARGO_PKG_VERSION"), mlx_k3::mlx_version(), mlx_k3::MLX_ORIGIN);
    println!("text generation is not available yet: the Kimi K3 model graph and tokenizer are separate issues.");
    println!("checking the kernel stack instead (SiTU primitive vs plain MLX ops, 16 experts x 3072):");
    for device in Device::available() {
        with_device(device, || -> Result<()> {
            let key = random::key(7)?;
            let ks = random::split(&key, 2)?;
            let up = random::normal(&[16, 3072], Dtype::F32, 0.0, 2.0, Some(&ks.slice_axis(0, 0, 1)?.squeeze(&[0])?))?;
            let gate =
                random::normal(&[16, 3072], Dtype::F32, 0.0, 2.0, Some(&ks.slice_axis(0, 1, 2)?.squeeze(&[0])?))?;
            mlx_k3::eval(&[&up, &gate])?;
            let t = Instant::now();
            let fused = situ(&up, &gate, 1.0, Some(8.0))?;
            fused.eval()?;
            let t_fused = t.elapsed();
            let t = Instant::now();
            let reference = situ_reference(&up, &gate, 1.0, Some(8.0))?;
            reference.eval()?;
            let t_ref = t.elapsed();
            let diff = fused.subtract(&reference)?.abs()?.max_all(false)?.item::<f32>()?;
            let scale = reference.abs()?.max_all(false)?.item::<f32>()?;
            println!(
                "  {device:?}: max |fused - reference| = {diff:.3e} (max |reference| = {scale:.3}); \
                 fused {:.3} ms, plain ops {:.3} ms (one cold run each; see `cargo bench` for timings)",
                t_fused.as_secs_f64() * 1e3,
                t_ref.as_secs_f64() * 1e3
            );
            Ok(())
        })??;
    }
    Ok(())
}
