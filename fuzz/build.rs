//! The fuzz binaries link the wheel's libmlx as the workspace's binaries do: mlx-k3-sys's rpath does not
//! reach dependents, so it is set here from what mlx-k3-sys found.
fn main() {
    let libdir = std::env::var("DEP_MLX_LIBDIR").expect("DEP_MLX_LIBDIR from mlx-k3-sys");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    println!("cargo:rerun-if-changed=build.rs");
}
