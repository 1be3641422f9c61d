#!/usr/bin/env bash
# Runs the GPU paths of mlx-k3 (the CUDA kernels' parity tests, the model fixtures, k3-nano, generation and two
# benches) on a Linux machine with an NVIDIA GPU, with test binaries built on a machine without one.
#
#   scripts/gpu_check.sh pack DIR   # here (no GPU needed): build the tests, pack them with the pinned
#                                   # mlx-cuda-13 libmlx.so into DIR (bin.tar.xz, libs.tar.xz, include.tar.xz,
#                                   # libmlx.so.xz; about 37 MB, or 83 MB with libmlx.so.xz)
#   scripts/gpu_check.sh run DIR    # on the GPU machine, from a checkout of the same commit; logs to $OUT or DIR/logs
#
# Why a swapped library works: the binaries are built against the mlx 0.32.4 headers, which are the same for the
# CPU and the CUDA wheel, and find libmlx through RUNPATH, which LD_LIBRARY_PATH overrides; `mlx-k3 info` then
# says "default device: Gpu". A machine that can build the project itself gets the same by building with
# MLX_K3_BACKEND=cuda and running `cargo test -p mlx-k3 --test situ --test router --test attn_res --test kda_step
# --test codebook`.
#
# The GPU machine needs python3 with NVIDIA's CUDA 13 pip packages (nvidia/cu13/lib: cudart, cublas, nvrtc;
# cudnn, nccl) and a CUDA 13 toolkit (CUDA_HOME, default /usr/local/cuda) for the headers MLX's JIT includes:
# MLX looks in <site>/nvidia/cu13/include first, and the pip copy there can lack crt/mma.h, which MLX's own
# quantized-matmul kernels need, so <site>/nvidia/cu13/include is pointed at the toolkit's include folder.
# libmlx.so.xz may be given in parts (libmlx.so.xz.00, .01, ...: they are concatenated in name order).
set -u
cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n 2,9p "$0"; exit 2; }
[ "$cmd" = pack ] && mkdir -p "$dir"
dir=$(cd "$dir" && pwd) || exit 2
cd "$(dirname "$0")/.."
tests=(situ router attn_res kda_step codebook tiers model k3_nano)

if [ "$cmd" = pack ]; then
    set -e
    wheel=$(ls target/cuda-jit/wheels/mlx_cuda_13-0.32.4-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no mlx-cuda-13 wheel: run scripts/check_cuda_kernels.py --fetch first" >&2; exit 2; }
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    args=(); for t in "${tests[@]}"; do args+=(--test "$t"); done
    cargo test --no-run -p mlx-k3 "${args[@]}" --message-format=json \
        | grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//' > "$tmp/exes"
    mkdir -p "$tmp/bin"
    while read -r e; do
        n=$(basename "$e" | sed 's/-[0-9a-f]*$//'); cp "$e" "$tmp/bin/$n"; strip "$tmp/bin/$n"
    done < "$tmp/exes"
    (cd "$tmp" && tar cJf "$dir/bin.tar.xz" bin)
    unzip -q -o "$wheel" 'mlx/lib/*' 'mlx_cuda_13.libs/*' 'mlx/include/*' -d "$tmp/w"
    (cd "$tmp/w" && tar cJf "$dir/libs.tar.xz" mlx_cuda_13.libs && tar cJf "$dir/include.tar.xz" mlx/include)
    strip --strip-unneeded "$tmp/w/mlx/lib/libmlx.so"
    xz -9e -T0 -c "$tmp/w/mlx/lib/libmlx.so" > "$dir/libmlx.so.xz"
    pwd > "$dir/built_root"   # the tests find their fixtures through the absolute path they were built in
    ls -la "$dir"
    exit 0
fi
[ "$cmd" = run ] || { echo "unknown command $cmd (pack or run)" >&2; exit 2; }

log=${OUT:-$dir/logs}; mkdir -p "$log"
root=$(mktemp -d); trap 'rm -rf "$root"' EXIT; site=$root/site; mkdir -p "$site/mlx/lib" "$site/nvidia/cu13"
cat "$dir"/libmlx.so.xz* | xz -d -T0 > "$site/mlx/lib/libmlx.so" || { echo "libmlx.so.xz missing or corrupt" >&2; exit 2; }
for t in libs include bin; do tar xJf "$dir/$t.tar.xz" -C "$([ $t = bin ] && echo "$root" || echo "$site")" || exit 2; done
nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])') || { echo "no nvidia pip packages" >&2; exit 2; }
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
ln -sfn "$nv/cu13/lib" "$site/nvidia/cu13/lib"; ln -sfn "$CUDA_HOME/include" "$site/nvidia/cu13/include"
for d in cudnn nccl; do ln -sfn "$nv/$d" "$site/nvidia/$d"; done
ldp=$site/mlx/lib; for d in "$nv"/*/lib; do ldp=$ldp:$d; done
# TF32 off: the model fixtures are f32 references (MLX's CUDA matmuls use TF32 by default).
export LD_LIBRARY_PATH=$ldp MLX_ENABLE_TF32=0 MLX_PTX_CACHE_DIR=$root/ptx RUST_BACKTRACE=1
built=$(cat "$dir/built_root" 2>/dev/null)
if [ -n "$built" ] && [ ! -e "$built" ]; then mkdir -p "$(dirname "$built")"; ln -s "$PWD" "$built"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$root/bin/mlx-k3" info | tee "$log/info.log"
fail=0
step() { # name timeout command...
    local n=$1 to=$2; shift 2; local s; s=$(date +%s)
    timeout "$to" "$@" > "$log/$n.log" 2>&1; local rc=$?
    [ $rc -ne 0 ] && fail=1
    echo "== $n: rc=$rc, $(( $(date +%s) - s )) s"
    grep -E "^test |test result|panicked|Gpu|router:|rel err|SUMMARY" "$log/$n.log" | head -40
}
# codebook: only its GPU test (the CPU ones, in a debug build, take minutes and say nothing about the GPU).
for t in "${tests[@]}"; do
    filter=(); [ "$t" = codebook ] && filter=(on_gpu_devices)
    step "$t" 300 "$root/bin/$t" --test-threads=1 --nocapture "${filter[@]}"
done
gen=("$root/bin/mlx-k3" generate --model models/k3-nano --dtype f32 --max-tokens 40 --raw --prompt "Once upon a time")
step generate 60 "${gen[@]}"
echo "generate stdout md5: $("${gen[@]}" 2>/dev/null | md5sum) (compare with the same command on a CPU)"
step bench_router 60 "$root/bin/mlx-k3" bench --router
step bench_nano 120 "$root/bin/mlx-k3" bench --model models/k3-nano --prompt-tokens 512 --gen-tokens 32
cat "$log/bench_router.log" "$log/bench_nano.log"
if command -v compute-sanitizer > /dev/null; then
    for t in router:router_matches_on_gpu_devices attn_res:every_device kda_step:every_device; do
        for tool in memcheck racecheck; do
            step "san_${tool}_${t%%:*}" 300 compute-sanitizer --tool $tool --error-exitcode 9 "$root/bin/${t%%:*}" "${t#*:}" --test-threads=1 --nocapture
        done
    done
fi
exit $fail
