#!/usr/bin/env bash
# Runs mlx-k3's library tests for AArch64 Linux on an x86-64 Linux machine: the crates cross-compiled with
# Debian's AArch64 toolchain against MLX's own aarch64 CPU wheel (the pinned version, from PyPI), each test
# binary run under qemu user emulation. This is how the NEON kernel paths run inside MLX here, against MLX's
# kernels and the mlx-lm fixtures, without ARM hardware. Timings under emulation mean nothing.
#
#   scripts/check_aarch64.sh                 # the default test list below
#   scripts/check_aarch64.sh --test model    # any `cargo test` arguments instead
#
# Needs: Debian/Ubuntu (apt-get, run as root or with sudo) for g++-aarch64-linux-gnu and qemu-user, and
# rustup (it adds the aarch64-unknown-linux-gnu target). Builds into target/aarch64-check (K3_AARCH64_TARGET_DIR
# overrides): about 5 minutes to build on 2 cores, 8 to run the default list (k3_nano alone takes 3).
# Not in the list: the tests that start the CLI binary, a browser or distributed ranks (cli, chat, server_*,
# distributed*, compress); the binary is an AArch64 executable that this machine cannot start directly.
set -euo pipefail
cd "$(dirname "$0")/.."

pin=$(sed -n 's/^const PIN_STR: &str = "\([0-9.]*\)";/\1/p' mlx-k3-sys/build.rs)
[ -n "$pin" ] || { echo "could not read the pinned MLX version from mlx-k3-sys/build.rs" >&2; exit 1; }

if ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || ! command -v qemu-aarch64 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get install -y -q g++-aarch64-linux-gnu qemu-user >/dev/null \
        || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q g++-aarch64-linux-gnu qemu-user >/dev/null; }
fi
rustup target add aarch64-unknown-linux-gnu >/dev/null

dir="${K3_AARCH64_TARGET_DIR:-$PWD/target/aarch64-check}"
site="$dir/mlx-wheel"
if [ ! -f "$site/mlx/lib/libmlx.so" ]; then
    # The host build makes .venv (pip); the wheels are only unpacked, never installed.
    [ -x .venv/bin/python ] || cargo build -q -p mlx-k3-sys
    rm -rf "$site" "$dir/wheels"
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --platform manylinux_2_35_aarch64 --python-version 3.11 "mlx==$pin" "mlx-cpu==$pin" -d "$dir/wheels"
    for whl in "$dir"/wheels/*.whl; do .venv/bin/python -m zipfile -e "$whl" "$site"; done
fi

export MLX_DIR="$site/mlx"
export MLX_K3_BACKEND=cpu
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CARGO_TARGET_DIR="$dir"
unset VIRTUAL_ENV

args=("$@")
if [ ${#args[@]} -eq 0 ]; then
    for t in attn_res codebook dense fast gate_up_situ kda_step model model_errors moe_combine ops quant router \
        situ tiers errors io memory generate decode_hygiene k3_nano; do
        args+=(--test "$t")
    done
fi
cargo test --release --target aarch64-unknown-linux-gnu -p mlx-k3 "${args[@]}"
