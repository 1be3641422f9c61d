//! The packed-weight kernels' SIMD paths against their scalar paths (`tests/kernel_check/simd_vs_scalar.cpp`:
//! affine 2/3/4/5/6/8-bit with f32/f16/bf16 scales, mxfp4, the codebook in both layouts (compact, and ternary
//! against the compact scalar path); 1-6 activation rows; K with short tails), and the DSA indexer's decode
//! kernel (`tests/kernel_check/indexer_vs_scalar.cpp`: scores and top-k selection), built from the kernel
//! sources alone:
//! - natively, with the build script's compiler: the AVX2 paths, and the AVX-512 ones where the CPU has them (the
//!   model tests also cover them through MLX);
//! - for AArch64 with Debian's cross compiler (`aarch64-linux-gnu-g++`), for the baseline ISA and with the
//!   dot-product extension, run under qemu user emulation
//!   (`qemu-aarch64`, package qemu-user): the only way the NEON paths run on an x86-64 machine.
//!
//! Without the cross compiler or qemu the AArch64 half is skipped with a message, unless
//! `K3_REQUIRE_NEON_CHECK=1` (set by `.ci/run` once it has installed both), which makes their absence a failure.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kernel_sources() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let includes: Vec<PathBuf> = std::env::split_paths(env!("K3_KERNEL_INCLUDES")).collect();
    assert_eq!(includes.len(), 4, "include paths from build.rs");
    let cpp = &includes[0];
    let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernel_check/simd_vs_scalar.cpp");
    // The packed-weight kernels (qmm_cpu.cpp and its per-concern files qmm_cpu_*.cpp), the DSA indexer's decode
    // kernel (indexer_cpu.cpp) and the thread pool.
    let mut sources: Vec<PathBuf> = std::fs::read_dir(cpp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            (name.starts_with("qmm_cpu") || name.starts_with("indexer_cpu")) && name.ends_with(".cpp")
        })
        .collect();
    sources.sort();
    assert!(sources.len() >= 2, "the qmm_cpu sources not found in {}", cpp.display());
    // The DSA indexer decode kernel's cases, which the harness runs on each path.
    sources.insert(0, harness.with_file_name("indexer_vs_scalar.cpp"));
    sources.insert(0, harness);
    sources.push(cpp.join("parallel.cpp"));
    // The kernel sources, the generated grid table and the C ABI header; not MLX's headers (not needed, and
    // there are none for AArch64 here).
    (sources, includes[..3].to_vec())
}

fn compile(cxx: &str, extra: &[&str], out: &Path) -> Output {
    compile_command(cxx, extra, out).output().unwrap_or_else(|e| panic!("start {cxx}: {e}"))
}

fn compile_command(cxx: &str, extra: &[&str], out: &Path) -> Command {
    let (sources, includes) = kernel_sources();
    let mut cmd = Command::new(cxx);
    cmd.args(["-O2", "-std=c++20"]).args(extra);
    for inc in &includes {
        cmd.arg("-I").arg(inc);
    }
    cmd.args(&sources).arg("-lpthread").arg("-o").arg(out);
    cmd
}

fn check(what: &str, out: Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed ({}):\n{stdout}\n{stderr}", out.status);
    let cases = stdout.lines().filter(|l| l.starts_with("ok")).count();
    // 156 cases per path: a harness that ran none (or stopped early) must not pass.
    assert!(cases >= 100, "{what}: only {cases} cases ran:\n{stdout}");
    println!("{what}: {}", stdout.lines().last().unwrap_or(""));
}

fn find(candidates: &[&str]) -> Option<String> {
    candidates
        .iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .map(|c| c.to_string())
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("k3-simd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn avx2_and_avx512_paths_match_the_scalar_paths() {
    let exe = scratch("native");
    let out = compile(env!("K3_KERNEL_CXX"), &["-march=native"], &exe);
    assert!(out.status.success(), "compile: {}", String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    if run.status.code() == Some(3) {
        eprintln!("SKIPPED: this x86-64 CPU has no AVX2/FMA/F16C, so the kernels have no SIMD path to check here");
    } else {
        // Where this CPU has AVX-512 the harness must have run every case a second time with those kernels.
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl");
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        let tagged = stdout.lines().filter(|l| l.starts_with("ok   [avx512]")).count();
        if avx512 {
            assert!(tagged >= 100, "this CPU has AVX-512 but only {tagged} AVX-512 cases passed:\n{stdout}");
        } else {
            assert_eq!(tagged, 0, "AVX-512 cases ran on a CPU without AVX-512:\n{stdout}");
            eprintln!("this CPU has no AVX-512: only the AVX2 paths were compared with the scalar ones");
        }
        check(if avx512 { "x86-64 (AVX2 and AVX-512 vs scalar)" } else { "x86-64 (AVX2 vs scalar)" }, run);
    }
    let _ = std::fs::remove_file(&exe);
}

/// The same harness built for an x86-64 without AVX-512 (`-march=x86-64-v3`): the kernels then have 16 vector
/// registers, and some tiles choose a different shape for that (`affine_rows_bpg`), which the native build on an
/// AVX-512 machine never compiles.
#[test]
fn an_avx2_only_build_matches_the_scalar_paths() {
    // A -march=x86-64-v3 binary may use any of that level's instructions anywhere, so it runs only where all exist.
    let v3 = std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
        && std::arch::is_x86_feature_detected!("bmi1")
        && std::arch::is_x86_feature_detected!("bmi2")
        && std::arch::is_x86_feature_detected!("lzcnt")
        && std::arch::is_x86_feature_detected!("movbe");
    if !v3 {
        eprintln!("SKIPPED: this CPU does not implement x86-64-v3");
        return;
    }
    let exe = scratch("x86-64-v3");
    let out = compile(env!("K3_KERNEL_CXX"), &["-march=x86-64-v3"], &exe);
    assert!(out.status.success(), "compile: {}", String::from_utf8_lossy(&out.stderr));
    check("x86-64-v3 build (AVX2 vs scalar)", Command::new(&exe).output().unwrap());
    let _ = std::fs::remove_file(&exe);
}

#[test]
fn neon_paths_match_the_scalar_paths_under_qemu() {
    let required = std::env::var("K3_REQUIRE_NEON_CHECK").is_ok_and(|v| v == "1");
    let cxx = find(&["aarch64-linux-gnu-g++"]);
    let qemu = find(&["qemu-aarch64", "qemu-aarch64-static"]);
    let (Some(cxx), Some(qemu)) = (cxx, qemu) else {
        let msg = "the AArch64 cross compiler (aarch64-linux-gnu-g++, Debian g++-aarch64-linux-gnu) or qemu-aarch64 \
                   (qemu-user) is missing";
        assert!(!required, "{msg}, and K3_REQUIRE_NEON_CHECK=1");
        eprintln!("SKIPPED: {msg}; the NEON paths were not checked");
        return;
    };
    // Twice: for the baseline ISA, and with the dot-product extension (Apple M chips, Neoverse), which the q8
    // kernels use where the compiler targets it. (qemu-aarch64's default CPU model has it.) Both compile at once;
    // static, so qemu needs no AArch64 loader or libraries.
    let builds: Vec<(&str, PathBuf, std::process::Child)> =
        [("baseline", &["-static"][..]), ("+dotprod", &["-static", "-march=armv8.2-a+dotprod"][..])]
            .into_iter()
            .map(|(tag, flags)| {
                let exe = scratch(&format!("aarch64-{tag}"));
                let mut cmd = compile_command(&cxx, flags, &exe);
                cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
                let child = cmd.spawn().unwrap_or_else(|e| panic!("start {cxx}: {e}"));
                (tag, exe, child)
            })
            .collect();
    let built: Vec<(&str, PathBuf, Output)> =
        builds.into_iter().map(|(tag, exe, child)| (tag, exe, child.wait_with_output().unwrap())).collect();
    for (tag, exe, out) in built {
        assert!(out.status.success(), "cross compile ({tag}): {}", String::from_utf8_lossy(&out.stderr));
        let run = Command::new(&qemu).arg(&exe).output().unwrap();
        let dotprod = String::from_utf8_lossy(&run.stdout).contains("with the dot-product extension");
        assert_eq!(dotprod, tag == "+dotprod", "{tag}: the harness reports the other q8 kernel variant");
        check(&format!("AArch64 {tag} under qemu (NEON vs scalar)"), run);
        let _ = std::fs::remove_file(&exe);
    }
}
