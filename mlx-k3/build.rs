//! rpath to the wheel's libmlx for every binary, test, bench and example of this crate (rpath set by
//! mlx-k3-sys does not propagate), plus the interpreter of the MLX environment for tests that launch
//! `mlx.launch`.
fn main() {
    let libdir = std::env::var("DEP_MLX_LIBDIR").expect("DEP_MLX_LIBDIR from mlx-k3-sys");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    let python = std::env::var("DEP_MLX_PYTHON").unwrap_or_default();
    println!("cargo:rustc-env=MLX_K3_PYTHON={python}");
    println!("cargo:rustc-env=MLX_K3_BACKEND={}", std::env::var("DEP_MLX_BACKEND").unwrap_or_default());
    println!("cargo:rerun-if-changed=build.rs");
}
