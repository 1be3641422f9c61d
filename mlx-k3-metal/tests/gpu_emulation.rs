//! The CUDA and Metal kernels (kernels/*.cu: situ, router, attn_res, kda_step, packed_qmm; kernels/*.metal: situ,
//! router, packed_qmm) run on the CPU under emulators of the two execution models and are compared with the CPU
//! paths, so every CI run checks what they compute; no CI machine has either GPU (scripts/check_cuda_kernels.py
//! also compiles the CUDA ones with NVRTC; nothing here has a Metal compiler).
//!
//! `tests/gpu_emulation/main.cpp` is a C++ program linked with this crate's kernel library, the shim and libmlx.
//! It defines `mlx::core::fast::cuda_kernel` and `metal_kernel` itself (the executable's definitions take the
//! place of libmlx's), so the kernels' GPU branch, forced on CPU streams by `k3::kernels::gpu_branch_on_cpu`
//! with the API of `emulated_gpu_api` (cpp/gpu_branch.hpp), hands each launch to the emulator: it writes the
//! translation unit MLX's JIT would build (same signature, template parameters and body) with
//! `tests/gpu_emulation/cuda_emu.hpp` or `metal_emu.hpp` in place of MLX's device header, compiles it with
//! AddressSanitizer, and runs the grid: blocks in turn, each block's threads as fibers (`fibers.hpp`) that meet
//! at every barrier and, for Metal, at every SIMD-group function (simd_sum and the rest, over 32-lane groups).
//! Every launch runs twice, threads in index order and backwards, and must give the same bits (a missing
//! barrier shows as a difference: taking the one after the router's group sums out fails this test); inputs,
//! outputs and threadgroup arrays are buffers of their exact size, so an out-of-bounds access stops it with
//! ASan's report; outputs and threadgroup memory start as NaN, so a skipped element or an unwritten read shows.
//! Metal threadgroups at the grid's edge are partial, as Metal's non-uniform dispatch makes them; a Metal
//! barrier that a returned thread misses, lanes of a SIMD group calling different SIMD-group functions, and more
//! than 32 KiB of threadgroup memory are errors. Tolerances per kernel are in main.cpp (f32: a few ulp of the
//! result or the summation-order bound).
//!
//! Metal's address spaces are empty macros when a kernel runs; where a clang++ is found (`find_clang`; CI requires
//! one with K3_REQUIRE_METAL_AS_CHECK=1) clang also reads every Metal unit with device, constant and threadgroup
//! as clang address spaces, so a pointer or cast that mixes them fails as it would under Metal's compiler.
//!
//! Not modelled: concurrent threads and atomics, warp-level CUDA primitives (the CUDA kernels use none),
//! whatever else Metal's compiler might reject, resource limits beyond threadgroup memory, speed, and the GPUs'
//! math libraries (the C library's functions stand in; CUDA's and Metal's precise ones are within a few ulp). The CUDA kernels were
//! checked once on a real GPU (README, "CUDA kernels on a GPU"); the Metal ones never have been.

#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
fn gpu_kernels_match_the_cpu_paths_under_emulation() {
    let includes: Vec<PathBuf> = std::env::split_paths(env!("K3_KERNEL_INCLUDES")).collect();
    let (mlx_include, local) = includes.split_last().expect("K3_KERNEL_INCLUDES ends with MLX's include folder");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gpu_emulation");
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpu_emulation");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let exe = scratch.join("gpu_emulation");
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
    // expected (the fibers tell it about each stack switch). The CUDA and the Metal checks run in two processes
    // at once (K3EMU_API), each compiling its own units.
    let clang = find_clang();
    if clang.is_none() {
        if std::env::var("K3_REQUIRE_METAL_AS_CHECK").is_ok_and(|v| v == "1") {
            panic!("K3_REQUIRE_METAL_AS_CHECK=1 but no clang++ was found (K3EMU_CLANG, clang++, clang++-14..19)")
        }
        eprintln!(
            "WARNING: no clang++ (K3EMU_CLANG, clang++, clang++-14..19): the Metal kernels' address spaces are not \
             checked (Debian: apt-get install clang-14)"
        );
    }
    let children: Vec<(&str, std::process::Child)> = ["cuda", "metal"]
        .into_iter()
        .map(|api| {
            let mut emulator = Command::new(&exe);
            emulator.arg(cxx).arg(&dir).arg(mlx_include).arg(scratch.join(format!("units-{api}")));
            if let Some(c) = &clang {
                emulator.arg(c);
            }
            emulator.env("ASAN_OPTIONS", "detect_leaks=0").env("K3EMU_API", api);
            emulator.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            (api, emulator.spawn().unwrap())
        })
        .collect();
    let mut total = [0usize; 6]; // passed, cases, cuda cases, metal cases, ok lines, address-space checked
    for (api, child) in children {
        let run = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        print!("{stdout}");
        assert!(run.status.success(), "{api}: {}\n{}", stdout, String::from_utf8_lossy(&run.stderr));
        // "gpu_emulation: P of N cases passed (cuda A of B, metal C of D; L kernel launches, U compiled units,
        // S Metal units address-space checked)"
        let summary = stdout.lines().find(|l| l.starts_with("gpu_emulation: ")).expect("no summary line");
        let words: Vec<&str> =
            summary.split(|c: char| c.is_whitespace() || "(,;".contains(c)).filter(|w| !w.is_empty()).collect();
        let num = |i: usize| -> usize { words[i].parse().unwrap_or_else(|_| panic!("summary word {i}: {summary}")) };
        assert_eq!(words[6], "cuda", "{summary}");
        assert_eq!(words[10], "metal", "{summary}");
        assert_eq!(words[21..24], ["Metal", "units", "address-space"], "{summary}");
        assert_eq!(num(1), num(3), "{api}: {summary}");
        assert_eq!(num(9) + num(13), num(3), "{api}: {summary}");
        let ok_lines = stdout.lines().filter(|l| l.starts_with("ok   ")).count();
        for (t, v) in total.iter_mut().zip([num(1), num(3), num(9), num(13), ok_lines, num(20)]) {
            *t += v;
        }
    }
    let [passed, cases, cuda_total, metal_total, ok_lines, as_checked] = total;
    assert_eq!(passed, cases);
    // CUDA: 6 SiTU, 7 router, 5 residual-mix, 5 x 3 KDA-step, 4 codebook, 3 x 2 gathered-codebook and 9 tiered
    // checks; Metal: the same SiTU, router, codebook, gathered and tiered checks, and 2 refusals (the residual mix
    // and the KDA step have no Metal kernel). Fewer means a case stopped being checked.
    assert!(cuda_total >= 52, "only {cuda_total} CUDA cases ran");
    assert!(metal_total >= 34, "only {metal_total} Metal cases ran");
    assert_eq!(ok_lines, cases);
    if clang.is_some() {
        assert!(as_checked > 0, "clang++ was given but no Metal unit was address-space checked");
    }
}

/// A clang++ for the Metal address-space check: $K3EMU_CLANG, else the first of clang++, clang++-19 ... -14 that
/// runs.
fn find_clang() -> Option<String> {
    if let Ok(c) = std::env::var("K3EMU_CLANG") {
        return Some(c);
    }
    let names = ["clang++"].into_iter().map(String::from).chain((14..=19).rev().map(|v| format!("clang++-{v}")));
    names.into_iter().find(|n| Command::new(n).arg("--version").output().is_ok_and(|o| o.status.success()))
}
