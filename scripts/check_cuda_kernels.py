#!/usr/bin/env python3
"""Compiles every CUDA kernel of mlx-k3-metal/kernels/ the way MLX's `fast::cuda_kernel` compiles it on a GPU
machine, with NVRTC from PyPI, on a machine that has no GPU.

No development machine or CI run of this project has a GPU (four of the kernels ran once on a lent H200, see
scripts/gpu_check.sh; packed_qmm.cu never has). This check catches, on every CI run, what a GPU user would
otherwise hit first: a kernel that does not compile. It builds, for each kernel and a set of launch variants
(element types, template constants), the exact translation unit that MLX 0.32.4 generates at run time
(`build_kernel` in mlx/backend/cuda/custom_kernel.cpp: MLX's default header, `namespace mlx::core::cu`, the
`__global__` signature from the input and output names and dtypes, the template constants, then the kernel body),
and compiles it as MLX's JIT does (`jit_module.cpp`): the same options (`--device-as-default-execution-space`,
`--gpu-architecture=sm_XY[a]`), MLX's device headers given to NVRTC in memory, and the wheel's include folders.
MLX's device headers (`mlx/backend/cuda/device/*.cuh`) ship only inside `libmlx.so` of the `mlx-cuda-13` wheel,
as the `jit_source_*` string constants; they are read from there by their symbols (`nm`), so they are exactly the
headers of the pinned wheel.

What it does not check: that a kernel is right. That needs a GPU (the kernels' parity tests, e.g.
`tests/router.rs`, run the GPU path where a GPU stream exists) or, short of one, the CPU emulator of CUDA that CI
runs (mlx-k3-metal/tests/gpu_emulation.rs).

The input and output names of each kernel are read from its `cuda_kernel(...)` call in mlx-k3-metal/cpp/
and must equal the table below, so the table cannot drift from the call sites unnoticed; the dtypes and
template constants are the table's (they are computed at run time there).

Usage:
  scripts/check_cuda_kernels.py --fetch     # download the wheels into target/cuda-jit (about 150 MB)
  scripts/check_cuda_kernels.py             # compile
Exit status: 0 all compiled, 1 a kernel failed to compile or the table disagrees with the call sites, 3 no
toolchain (not fetched, or the download failed).
Environment: K3_CUDA_JIT_DIR overrides target/cuda-jit.
"""

import concurrent.futures
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "mlx-k3-metal" / "kernels"
CPP = ROOT / "mlx-k3-metal" / "cpp"
# GPU architectures compiled for: Ampere (A100, the oldest MLX's CUDA back-end targets) and Hopper (H100/H200,
# with the "a" features MLX enables from compute capability 9 on).
ARCHS = [(8, 0), (9, 0)]
NVRTC_SPEC = "nvidia-cuda-nvrtc==13.*"
CUDART_SPEC = "nvidia-cuda-runtime==13.*"

F32, F16, BF16 = "float32", "float16", "bfloat16"
FLOATS = [F32, F16, BF16]
# MLX's dtype_to_cuda_type (mlx/backend/cuda/utils.cpp).
CUDA_TYPE = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    F16: "__half", BF16: "__nv_bfloat16", F32: "float",
}


def mlx_pin():
    text = (ROOT / "mlx-k3-sys" / "build.rs").read_text()
    m = re.search(r'const PIN_STR: &str = "([0-9.]+)";', text)
    if not m:
        sys.exit("check_cuda_kernels: no PIN_STR in mlx-k3-sys/build.rs")
    return m.group(1)


def jit_dir():
    return Path(os.environ.get("K3_CUDA_JIT_DIR", ROOT / "target" / "cuda-jit"))


# ---------------------------------------------------------------------------------------------------------
# The kernels and their launch variants. Each variant: input dtypes, output dtypes, template constants in the
# order the call site passes them (MLX emits them in that order).


def situ_variants():
    for t in FLOATS:
        yield {"in": [t, t, F32, "int32"], "out": [t], "targs": [("T", t)]}


def router_variants():
    # (element type, E, k, n_group, topk_group, renormalize, has_bias, has_mask): K3 (896 experts, top-16) in
    # every type; DeepSeek-V3 style groups (256 experts, 8 groups, top-4 groups) with a protected-tier mask;
    # one expert.
    cases = [(t, 896, 16, 1, 1, True, True, False) for t in FLOATS]
    cases += [(F32, 256, 8, 8, 4, False, True, True), (F32, 1, 1, 1, 1, False, False, True)]
    for t, e, k, ng, kg, renorm, has_bias, has_mask in cases:
        ep = 1
        while ep < e:
            ep <<= 1
        threads = min(max(ep // 2, 32), 512)  # as route_gpu computes it
        yield {
            "in": [t, F32, "bool", F32],
            "out": ["uint32", t, "bool"],
            "targs": [("T", t), ("E", e), ("EP", ep), ("K", k), ("NG", ng), ("KG", kg), ("RENORM", renorm),
                      ("HAS_BIAS", has_bias), ("HAS_MASK", has_mask), ("THREADS", threads)],
        }


def attn_res_variants():
    for t, (k, d) in [(t, (4, 2048)) for t in FLOATS] + [(F32, (16, 7168))]:
        yield {"in": [t, F32, t, F32, F32], "out": [t], "targs": [("T", t), ("K", k), ("D", d), ("THREADS", 256)]}


def kda_step_variants():
    # (element type, heads, head_dim, conv kernel, lower bound, conv state, ssm state)
    cases = [(t, 16, 128, 4, False, True, True) for t in FLOATS] + [(F32, 2, 16, 1, True, False, False)]
    for t, h, d, kc, lb, conv, ssm in cases:
        yield {
            "in": [t, t, t, t, F32, F32, F32, F32, t, F32, F32],
            "out": [t, t, F32],
            "targs": [("T", t), ("H", h), ("D", d), ("KC", kc), ("HAS_LB", lb), ("HAS_CONV", conv),
                      ("HAS_SSM", ssm)],
        }


def packed_qmm_variants():
    # Inputs: x, lhs, rhs, tier, slot, cb_codes, cb_qh, cb_scales, grid, fp4_w, fp4_scales, aff_w, aff_scales,
    # aff_biases, dims. (tiered, affine bits, affine group, affine scale type): the plain and gathered codebook
    # op; tiered stacks with each affine width and scale type MLX writes (absent tiers are placeholders with a
    # stack size of 0 in dims, the same code).
    cases = [(False, 4, 64, F32)]
    cases += [(True, bits, 64, F32) for bits in (2, 3, 4, 5, 6, 8)]
    cases += [(True, 4, 32, F16), (True, 4, 128, BF16), (True, 2, 32, BF16)]
    for tiered, bits, group, st in cases:
        yield {
            "in": [F32, "uint32", "uint32", "uint8", "uint32", "uint8", "uint16", F16, "uint32", "uint32", "uint8",
                   "uint32", st, st, "int32"],
            "out": [F32],
            "targs": [("THREADS", 128), ("TIERED", tiered), ("AFF_BITS", bits), ("AFF_GROUP", group), ("ST", st)],
        }


# name -> (source file, input names, output names, variants)
TABLE = {
    "k3_situ": ("situ.cu", ["up", "gate", "params", "count"], ["out"], situ_variants),
    "k3_moe_router": ("router.cu", ["logits", "bias", "mask", "params"], ["inds", "weights", "prot"],
                      router_variants),
    "k3_attn_res_mix": ("attn_res.cu", ["raw", "inv_rms", "partial", "w_eff", "params"], ["out"],
                        attn_res_variants),
    "k3_kda_step": ("kda_step.cu",
                    ["qkv", "a", "b", "gate", "conv_w", "a_log", "dt_bias", "norm_w", "conv_state", "ssm",
                     "params"],
                    ["out", "new_conv", "new_ssm"], kda_step_variants),
    "k3_packed_qmm": ("packed_qmm.cu",
                      ["x", "lhs", "rhs", "tier", "slot", "cb_codes", "cb_qh", "cb_scales", "grid", "fp4_w",
                       "fp4_scales", "aff_w", "aff_scales", "aff_biases", "dims"],
                      ["out"], packed_qmm_variants),
}


def call_sites():
    """name -> (source symbol, inputs, outputs) from every `mx::fast::cuda_kernel(...)` call in cpp/."""
    found = {}
    call = re.compile(r'cuda_kernel\(\s*"(\w+)"\s*,\s*\{([^}]*)\}\s*,\s*\{([^}]*)\}\s*,\s*(\w+)', re.S)
    for path in sorted(CPP.glob("*.cpp")):
        for m in call.finditer(path.read_text()):
            names = lambda s: re.findall(r'"(\w+)"', s)
            if m.group(1) in found:
                sys.exit(f"check_cuda_kernels: two cuda_kernel calls named {m.group(1)}")
            found[m.group(1)] = (m.group(4), names(m.group(2)), names(m.group(3)), path.name)
    return found


# ---------------------------------------------------------------------------------------------------------
# MLX's generated translation unit (custom_kernel.cpp, build_kernel; ensure_row_contiguous, so no shape or
# stride parameters unless the body names them, which ours do not: checked below).

DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'


def build_kernel(name, body, in_names, in_dtypes, out_names, out_dtypes, targs):
    src = DEFAULT_HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void {name}(\n"
    for n, t in zip(in_names, in_dtypes):
        src += f"    const {CUDA_TYPE[t]}* {n},\n"
    for i, (n, t) in enumerate(zip(out_names, out_dtypes)):
        src += f"    {CUDA_TYPE[t]}* {n}" + (",\n" if i + 1 < len(out_names) else ") {\n")
    if targs:
        for k, v in targs:
            if isinstance(v, bool):
                src += f"  constexpr bool {k} = {'true' if v else 'false'};\n"
            elif isinstance(v, int):
                src += f"  constexpr int {k} = {v};\n"
            else:
                src += f"  using {k} = {CUDA_TYPE[v]};\n"
        src += "\n"
    return src + body + "\n}\n\n} // namespace mlx::core::cu\n"


# ---------------------------------------------------------------------------------------------------------
# The toolchain: NVRTC and the CUDA headers from NVIDIA's wheels, MLX's headers from the mlx-cuda-13 wheel.


def fetch():
    d = jit_dir()
    d.mkdir(parents=True, exist_ok=True)
    wheels = d / "wheels"
    specs = [f"mlx-cuda-13=={mlx_pin()}", NVRTC_SPEC, CUDART_SPEC]
    print("check_cuda_kernels: downloading", " ".join(specs), flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--only-binary", ":all:", "-d", str(wheels), *specs], check=True)
    tree = d / "tree"
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                n = info.filename
                keep = (n.startswith("mlx/include/") or n == "mlx/lib/libmlx.so"
                        or n.startswith("nvidia/cu13/include/") or re.match(r"nvidia/cu13/lib/libnvrtc", n))
                if keep and not (tree / n).exists():
                    z.extract(info, tree)
    extract_mlx_headers(tree)
    (tree / "mlx" / "lib" / "libmlx.so").unlink()  # 146 MB, only needed for its headers
    print("check_cuda_kernels: toolchain in", tree)


def extract_mlx_headers(tree):
    """Writes MLX's JIT device headers (the `jit_source_<name>` constants of libmlx.so) to tree/mlx-jit."""
    lib = tree / "mlx" / "lib" / "libmlx.so"
    syms = subprocess.run(["nm", "-S", str(lib)], check=True, capture_output=True, text=True).stdout
    data = lib.read_bytes()
    # Section offsets equal virtual addresses for .rodata in this library, checked on the first header.
    out = tree / "mlx-jit"
    out.mkdir(exist_ok=True)
    # The headers MLX gives NVRTC are the ones its include-name table lists (`g_include_names`, strings that
    # end in NUL; the linker may share the tail of a longer string for one).
    listed = set(m.group(1).decode() for m in re.finditer(rb"mlx/backend/cuda/device/(\w+)\.(?:cuh|h)\0", data))
    seen = {}
    for line in syms.splitlines():
        m = re.match(r"([0-9a-f]+) ([0-9a-f]+) [rR] _ZN3mlx4coreL\d+jit_source_(\w+)E$", line)
        if not m:
            continue
        addr, size, name = int(m.group(1), 16), int(m.group(2), 16), m.group(3)
        if name not in listed:
            continue
        text = data[addr:addr + size].rstrip(b"\0")
        if b"\0" in text or b"Apple Inc" not in text[:80]:
            sys.exit(f"check_cuda_kernels: jit_source_{name} at {addr:#x} is not a header's text")
        if name in seen and seen[name] != text:
            sys.exit(f"check_cuda_kernels: two different jit_source_{name}")
        seen[name] = text
    if "utils" not in seen or "config" not in seen or set(seen) != listed:
        sys.exit(f"check_cuda_kernels: MLX's JIT headers not found in {lib} (found {sorted(seen)})")
    for name, text in seen.items():
        (out / name).write_bytes(text)


class Nvrtc:
    def __init__(self, tree):
        lib = tree / "nvidia" / "cu13" / "lib"
        for b in sorted(lib.glob("libnvrtc-builtins.so*")):
            ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
        cands = sorted(lib.glob("libnvrtc.so*"))
        if not cands:
            raise FileNotFoundError(lib / "libnvrtc.so.13")
        self.lib = ctypes.CDLL(str(cands[0]))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._ok(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _ok(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source, name, headers, options, kernel):
        """Returns (ok, log, lowered name)."""
        prog = ctypes.c_void_p()
        hs = (ctypes.c_char_p * len(headers))(*[t for _, t in headers])
        hn = (ctypes.c_char_p * len(headers))(*[n.encode() for n, _ in headers])
        self._ok(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                             len(headers), hs, hn), "nvrtcCreateProgram")
        try:
            self._ok(self.lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._ok(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value)
            self._ok(self.lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            if rc != 0:
                return False, log.value.decode(errors="replace"), None
            lowered = ctypes.c_char_p()
            self._ok(self.lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered)),
                     "nvrtcGetLoweredName")
            cubin = ctypes.c_size_t()
            self._ok(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)), "nvrtcGetCUBINSize")
            if cubin.value == 0:
                return False, "NVRTC produced no machine code", None
            return True, log.value.decode(errors="replace"), lowered.value.decode()
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main():
    if "--fetch" in sys.argv[1:]:
        try:
            fetch()
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"check_cuda_kernels: could not fetch the toolchain: {e}", file=sys.stderr)
            return 3
    tree = jit_dir() / "tree"
    if not (tree / "mlx-jit" / "utils").exists():
        print(f"check_cuda_kernels: no toolchain in {tree}; run with --fetch first", file=sys.stderr)
        return 3
    nvrtc = Nvrtc(tree)
    headers = [(f"mlx/backend/cuda/device/{p.name}{'.h' if p.name == 'config' else '.cuh'}", p.read_bytes())
               for p in sorted((tree / "mlx-jit").iterdir())]
    includes = [tree / "mlx" / "include", tree / "mlx" / "include" / "cccl", tree / "nvidia" / "cu13" / "include"]
    for inc in includes:
        if not inc.is_dir():
            sys.exit(f"check_cuda_kernels: missing {inc}")

    sites = call_sites()
    cu_files = sorted(p.name for p in KERNELS.glob("*.cu"))
    listed = sorted(f for f, *_ in TABLE.values())
    problems = []
    if cu_files != listed:
        problems.append(f"kernels/*.cu are {cu_files} but the table lists {listed}")
    if sorted(sites) != sorted(TABLE):
        problems.append(f"cuda_kernel calls in cpp/ are {sorted(sites)} but the table lists {sorted(TABLE)}")
    jobs = []
    for name, (file, ins, outs, variants) in TABLE.items():
        if name in sites:
            sym, s_ins, s_outs, cpp = sites[name]
            want_sym = "k3_src_" + file.replace(".", "_")
            if (sym, s_ins, s_outs) != (want_sym, ins, outs):
                problems.append(f"{name}: {cpp} calls it with {sym} {s_ins} -> {s_outs}, the table says "
                                f"{want_sym} {ins} -> {outs}")
            # Every template constant of the table must be one the call site passes (the compile below catches
            # the other direction: a constant the body uses and the table lacks).
            cpp_text = (CPP / cpp).read_text()
            for k in sorted({k for v in variants() for k, _ in v["targs"]}):
                if not re.search(rf'\{{"{k}",', cpp_text):
                    problems.append(f"{name}: template constant {k} is not passed in {cpp}")
        body = (KERNELS / file).read_text()
        for n in ins:
            if re.search(rf"\b{n}_(shape|strides|ndim)\b", body):
                problems.append(f"{name}: the body uses {n}_shape/_strides/_ndim, which this check does not emit")
        for v in variants():
            src = build_kernel(name, body, ins, v["in"], outs, v["out"], v["targs"])
            tag = hashlib.sha1(src.encode()).hexdigest()[:8]
            for cc in ARCHS:
                arch = f"--gpu-architecture=sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"
                opts = ["--device-as-default-execution-space", arch] + [f"--include-path={i}" for i in includes]
                desc = f"{name} sm_{cc[0]}{cc[1]} " + ", ".join(f"{k}={val}" for k, val in v["targs"])
                jobs.append((desc, src, f"{name}_{tag}", opts, f"mlx::core::cu::{name}"))

    def run(job):
        desc, src, unit, opts, kernel = job
        return desc, nvrtc.compile(src, unit, headers, opts, kernel)

    failures, compiled = 0, 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for desc, (ok, log, lowered) in pool.map(run, jobs):
            compiled += 1
            if not ok:
                failures += 1
                print(f"FAIL {desc}\n{log}")
            elif "warning" in log:
                print(f"ok (warnings) {desc}\n{log}")
            else:
                print(f"ok   {desc}")
    for p in problems:
        print("FAIL", p)
    print(f"check_cuda_kernels: NVRTC {nvrtc.version[0]}.{nvrtc.version[1]}, MLX {mlx_pin()} headers: "
          f"{compiled - failures} of {compiled} compilations ok, {len(problems)} table problems")
    return 1 if failures or problems or compiled == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
