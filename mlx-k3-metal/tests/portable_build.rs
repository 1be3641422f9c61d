//! `MLX_K3_PORTABLE=1` builds the kernels for the baseline x86-64 ISA (no `-march=native`): every AVX2 path must
//! then carry its own `target` attribute (lambdas too; they do not inherit it), or GCC refuses to inline the
//! intrinsics. Default builds target the host and cannot see such a mistake, so this compiles each kernel
//! source for `-march=x86-64` with the compiler and include paths the build script used. `-O0` is enough:
//! always-inline intrinsics are inlined (and rejected) at every optimization level.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::path::PathBuf;
use std::process::{Command, Stdio};

#[test]
fn kernels_compile_for_the_baseline_isa() {
    let cxx = env!("K3_KERNEL_CXX");
    let includes: Vec<PathBuf> = std::env::split_paths(env!("K3_KERNEL_INCLUDES")).collect();
    assert_eq!(includes.len(), 4, "include paths from build.rs");
    let cpp_dir = &includes[0];
    let out_dir = std::env::temp_dir().join(format!("k3-portable-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let mut sources: Vec<_> = std::fs::read_dir(cpp_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    sources.sort();
    assert!(sources.len() >= 10, "kernel sources not found in {}", cpp_dir.display());
    // Two compilers at a time (the CI machine has two cores).
    let mut failures = Vec::new();
    for pair in sources.chunks(2) {
        let children: Vec<_> = pair
            .iter()
            .map(|src| {
                let mut cmd = Command::new(cxx);
                cmd.args(["-O0", "-std=c++20", "-march=x86-64", "-c"]).arg(src);
                for (i, inc) in includes.iter().enumerate() {
                    cmd.arg(if i == 3 { "-isystem" } else { "-I" }).arg(inc);
                }
                cmd.arg("-o").arg(out_dir.join(src.file_name().unwrap()).with_extension("o"));
                cmd.stdout(Stdio::null()).stderr(Stdio::piped());
                (src, cmd.spawn().expect("start the C++ compiler"))
            })
            .collect();
        for (src, child) in children {
            let out = child.wait_with_output().expect("wait for the C++ compiler");
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                let first: Vec<_> = err.lines().filter(|l| l.contains("error")).take(3).collect();
                failures.push(format!("{}: {}", src.display(), first.join(" | ")));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&out_dir);
    assert!(failures.is_empty(), "baseline-ISA compile failed:\n{}", failures.join("\n"));
}
