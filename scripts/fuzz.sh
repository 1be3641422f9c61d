#!/usr/bin/env bash
# Builds the fuzz targets of fuzz/ with stable Rust and runs each for a fixed time on a scratch copy of its
# seed corpus (fuzz/corpus/<target>); fails on any crash, panic, failed assertion, hang (10 s) or
# out-of-memory, leaving the input under fuzz/artifacts/<target>/. Prints executions and coverage per target.
#
#   scripts/fuzz.sh                      # every target, 60 s each (what .ci/run does)
#   scripts/fuzz.sh -t 600 gguf          # one target, 10 minutes
#   scripts/fuzz.sh --build-only
#   FUZZ_JOBS=4 scripts/fuzz.sh -t 3600  # libFuzzer -fork=4: four processes per target, one target at a time
#
# The build uses the flags `cargo fuzz build --sanitizer none` passes (cargo-fuzz's src/project.rs), so no
# nightly toolchain and no cargo-fuzz are needed: SanitizerCoverage instrumentation of every crate (inline
# 8-bit counters, PC table, compare tracing, stack depth), `--cfg fuzzing`, no branch folding, debug
# assertions; overflow checks come from fuzz/Cargo.toml's release profile. Build scripts and proc macros are
# not instrumented (`--target` keeps RUSTFLAGS off them). One difference: cargo-fuzz forces
# `-Ccodegen-units=1` in release; this script keeps cargo's default, which builds faster on CI's two
# cores (FUZZ_CODEGEN_UNITS=1 gives cargo-fuzz's setting).
set -euo pipefail
cd "$(dirname "$0")/.."

time_s=60
build_only=0
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        -t|--time) time_s="$2"; shift 2 ;;
        --build-only) build_only=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done
all=(config safetensors_header gguf tokenizer_chat http_request)
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

triple=$(rustc -vV | sed -n 's/^host: //p')
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table"
flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
flags+=" -Cllvm-args=-simplifycfg-branch-fold-threshold=0 -Cdebug-assertions"
case "$triple" in *-linux-*) flags+=" -Cllvm-args=-sanitizer-coverage-stack-depth" ;; esac
[ -z "${FUZZ_CODEGEN_UNITS:-}" ] || flags+=" -Ccodegen-units=$FUZZ_CODEGEN_UNITS"
target_dir="$PWD/fuzz/target"
echo "== fuzz: building ${targets[*]} ($triple, --sanitizer none flags)"
build_start=$SECONDS
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
# The workspace's CARGO_TARGET_DIR is not this build's: it has its own flags and lock file.
env -u CARGO_TARGET_DIR RUSTFLAGS="$flags ${RUSTFLAGS:-}" \
    cargo build --manifest-path fuzz/Cargo.toml --release --target "$triple" \
    --target-dir "$target_dir" --config 'profile.release.debug="line-tables-only"' "${bins[@]}"
echo "build: $((SECONDS - build_start)) s"
[ "$build_only" -eq 0 ] || exit 0

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Targets run side by side, one per core (FUZZ_PARALLEL overrides): libFuzzer runs one process per target.
parallel="${FUZZ_PARALLEL:-$(nproc 2>/dev/null || echo 1)}"
fork=()
[ -z "${FUZZ_JOBS:-}" ] || { fork=(-fork="$FUZZ_JOBS"); parallel=1; }

run_one() {
    local t="$1" corpus="$scratch/$1" log="$scratch/$1.log" rc=0
    # -timeout: one input running for 10 s is a hang. -rss_limit_mb: the process's memory. -max_len: inputs
    # up to 64 KiB (GGUF and safetensors files with several tensors).
    "$target_dir/$triple/release/$t" "$corpus" "${fork[@]}" -max_total_time="$time_s" -timeout=10 \
        -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$t/" \
        > "$log" 2>&1 || rc=$?
    echo "$rc" > "$scratch/$t.rc"
}

echo "== fuzz: ${targets[*]}, ${time_s} s each, $parallel at a time"
running=0
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t" "fuzz/artifacts/$t"
    cp -r "fuzz/corpus/$t/." "$scratch/$t/"
    find "$scratch/$t" -type f | wc -l > "$scratch/$t.seeds"
    run_one "$t" &
    running=$((running + 1))
    if [ "$running" -ge "$parallel" ]; then
        wait -n || true
        running=$((running - 1))
    fi
done
wait

summary=()
failed=()
for t in "${targets[@]}"; do
    log="$scratch/$t.log"
    rc=$(cat "$scratch/$t.rc")
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
    line=$(printf '%-20s rc=%-3s execs=%-10s cov=%-6s ft=%-6s corpus=%s (from %s seeds)' \
        "$t" "$rc" "${execs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$(cat "$scratch/$t.seeds")")
    summary+=("$line")
    if [ "$rc" -ne 0 ]; then
        echo "== fuzz: $t failed (exit $rc); the end of its log:"
        tail -n 60 "$log"
        failed+=("$t")
    fi
done
echo "== fuzz summary (${time_s} s each)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}: the inputs are under fuzz/artifacts/; reproduce with" \
        "fuzz/target/$triple/release/<target> <input>" >&2
    exit 1
fi
