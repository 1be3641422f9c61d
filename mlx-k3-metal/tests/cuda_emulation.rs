//! The CUDA kernels (kernels/situ.cu, router.cu, attn_res.cu, kda_step.cu, packed_qmm.cu) run on the CPU
//! under an emulator of CUDA's execution model and are compared with the CPU paths, so every CI run checks what
//! they compute, not only that they compile (scripts/check_cuda_kernels.py); no CI machine has a GPU.
//!
//! `tests/cuda_emulation/main.cpp` is a C++ program linked with this crate's kernel library, the shim and
//! libmlx. It defines `mlx::core::fast::cuda_kernel` itself (the executable's definition takes the place of
//! libmlx's), so the kernels' GPU branch, forced on CPU streams by `k3::kernels::gpu_branch_on_cpu`
//! (cpp/gpu_branch.hpp), hands each launch to the emulator: it writes the translation unit MLX's JIT would
//! build (same signature, template constants and body) with `tests/cuda_emulation/cuda_emu.hpp` in place of
//! MLX's device header, compiles it with AddressSanitizer, and runs the grid: blocks in turn, each block's
//! threads as fibers that meet at every `__syncthreads()`. Every launch runs twice, threads in index order and
//! backwards, and must give the same bits (a missing barrier shows as a difference: taking the one after the
//! router's group sums out fails this test); inputs and outputs are buffers of their exact size, so an
//! out-of-bounds access stops it with ASan's report; outputs start as NaN, so a skipped element shows.
//! Tolerances per kernel are in main.cpp (f32: a few ulp of the result or the summation-order bound).
//!
//! Not modelled: warps and warp primitives (the kernels use none), concurrent threads and atomics, resource
//! limits, speed, and the GPU's math library (the C library's functions stand in; CUDA's are within 2 ulp).
//! Those were checked once on a real GPU (README, "CUDA kernels on a GPU").

#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
fn cuda_kernels_match_the_cpu_paths_under_emulation() {
    let includes: Vec<PathBuf> = std::env::split_paths(env!("K3_KERNEL_INCLUDES")).collect();
    let (mlx_include, local) = includes.split_last().expect("K3_KERNEL_INCLUDES ends with MLX's include folder");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_emulation");
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_emulation");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let exe = scratch.join("cuda_emulation");
    let cxx = env!("K3_KERNEL_CXX");
    let mlx_lib = env!("K3_MLX_LIBDIR");

    let mut cc = Command::new(cxx);
    cc.args(["-std=c++20", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]);
    for inc in local {
        cc.arg("-I").arg(inc);
    }
    cc.arg("-isystem").arg(mlx_include).arg(dir.join("main.cpp"));
    cc.arg(Path::new(env!("OUT_DIR")).join("libmlx_k3_kernels.a"));
    cc.arg(Path::new(env!("K3_SHIM_LIBDIR")).join("libmlx_k3_shim.a"));
    cc.arg(format!("-L{mlx_lib}")).arg("-lmlx").arg(format!("-Wl,-rpath,{mlx_lib}"));
    cc.args(["-lpthread", "-ldl", "-o"]).arg(&exe);
    let built = cc.output().unwrap();
    assert!(built.status.success(), "building the emulator failed:\n{}", String::from_utf8_lossy(&built.stderr));

    // Leak checking off: MLX keeps its caches until exit. The one warning ASan prints about swapcontext is
    // expected (the fibers tell it about each stack switch).
    let run = Command::new(&exe)
        .arg(cxx)
        .arg(&dir)
        .arg(mlx_include)
        .arg(scratch.join("units"))
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    print!("{stdout}");
    assert!(run.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&run.stderr));
    // "cuda_emulation: P of N cases passed (L kernel launches, U compiled units)"
    let summary = stdout.lines().find(|l| l.starts_with("cuda_emulation: ")).expect("no summary line");
    let words: Vec<&str> = summary.split_whitespace().collect();
    let (passed, total): (usize, usize) = (words[1].parse().unwrap(), words[3].parse().unwrap());
    assert_eq!(passed, total, "{summary}");
    // 6 SiTU, 7 router, 5 residual-mix, 5 x 3 KDA-step, 4 codebook, 3 x 2 gathered-codebook and 9 tiered checks:
    // fewer means a case stopped being checked.
    assert!(total >= 52, "only {total} cases ran: {summary}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("ok   ")).count(), total, "{summary}");
}
