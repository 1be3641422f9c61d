//! rpath to the wheel's libmlx for every binary, test, bench and example of this crate (rpath set by
//! mlx-k3-sys does not propagate), plus the interpreter of the MLX environment for tests that launch
//! `mlx.launch`.
fn main() {
    let libdir = std::env::var("DEP_MLX_LIBDIR").expect("DEP_MLX_LIBDIR from mlx-k3-sys");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    // Export the project's cblas_sgemm (mlx-k3-metal/cpp/dense_sgemm.cpp) from every binary so the dynamic
    // linker binds MLX's float32 matmuls to it instead of the CPU wheel's reference BLAS.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg=-Wl,--undefined=cblas_sgemm");
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=cblas_sgemm");
    }
    let python = std::env::var("DEP_MLX_PYTHON").unwrap_or_default();
    println!("cargo:rustc-env=MLX_K3_PYTHON={python}");
    println!("cargo:rustc-env=MLX_K3_BACKEND={}", std::env::var("DEP_MLX_BACKEND").unwrap_or_default());
    println!("cargo:rerun-if-changed=build.rs");
}
