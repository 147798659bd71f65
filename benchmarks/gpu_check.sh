#!/usr/bin/env bash
# GPU check of the kernel library, for one GPU machine (sized for one H200,
# under 8 minutes in all). Runs, each under its own deadline:
#   1. the GPU-only tests             (pytest -m gpu tests/kernels tests/bench tests/runner)
#   2. the large benchmarks           (kiln bench, CUDA-graph replay timing)
#   3. the precompiled-artifact check (python -m kiln_kernels.selfcheck: compile for
#      this device's arch, load through kiln_kernels._loader, launch, compare)
# A failed step does not stop the others; the script exits 1 if any failed.
# Results go to $OUT (default: a fresh temporary directory); the table of
# steps is printed last.
#
# Usage: benchmarks/gpu_check.sh            (from the repository root)
#        OUT=/some/dir PYTHON=.venv/bin/python benchmarks/gpu_check.sh
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT_DIR="${OUT:-$(mktemp -d -t kiln-gpu-check.XXXXXX)}"
mkdir -p "$OUT_DIR"
# The interpreter must be off for real GPU runs, whatever the caller's shell says.
unset TRITON_INTERPRET

declare -a NAMES=() STATES=() SECONDS_TAKEN=()

# run_step NAME DEADLINE_S CMD...: run CMD under `timeout`, log to $OUT_DIR/NAME.log
run_step() {
    local name="$1" deadline="$2"
    shift 2
    echo "== ${name}: $* (deadline ${deadline}s, log ${OUT_DIR}/${name}.log)"
    local start rc state
    start=$(date +%s)
    set +e
    timeout --kill-after=15 "${deadline}" "$@" >"${OUT_DIR}/${name}.log" 2>&1
    rc=$?
    set -e
    case "$rc" in
        0) state="passed" ;;
        124|137) state="timed-out" ;;
        *) state="failed(rc=${rc})" ;;
    esac
    tail -n 15 "${OUT_DIR}/${name}.log"
    NAMES+=("$name"); STATES+=("$state"); SECONDS_TAKEN+=("$(( $(date +%s) - start ))")
}

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no GPU visible to ${PYTHON} (torch.cuda.is_available() is False); nothing to check" >&2
    exit 2
fi
timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    >"${OUT_DIR}/gpu.txt" 2>&1 || echo "gpu_check: nvidia-smi unavailable" >"${OUT_DIR}/gpu.txt"

run_step gpu_tests 300 "$PYTHON" -m pytest -m gpu tests/kernels tests/bench tests/runner -q -p no:cacheprovider \
    -o addopts="" --junitxml="${OUT_DIR}/gpu_tests.xml"

# The benchmark harness (tasks/bench.py, flows/bench.py) is owned by the bench stage;
# `kiln bench` is its entry point. Without an installed `kiln` script the same CLI is
# reached through kiln.flows.cli.main.
# TODO(bench stage): once a GPU run has recorded its first history, add
# `--compare last` here so this check also flags regressions.
if command -v kiln >/dev/null 2>&1; then
    KILN=(kiln)
else
    KILN=("$PYTHON" -c "import sys; from kiln.flows.cli import main; sys.exit(main())")
fi
run_step bench 180 "${KILN[@]}" bench --metric graph_replay --size large \
    --run-dir "${OUT_DIR}/bench_run" --out "${OUT_DIR}/bench_gpu.json"

run_step aot_selfcheck 120 "$PYTHON" -m kiln_kernels.selfcheck --out "${OUT_DIR}/aot_selfcheck.json"

failed=0
{
    echo "["
    for i in "${!NAMES[@]}"; do
        sep=$([ "$i" -lt $(( ${#NAMES[@]} - 1 )) ] && echo "," || echo "")
        echo "  {\"step\": \"${NAMES[$i]}\", \"state\": \"${STATES[$i]}\", \"seconds\": ${SECONDS_TAKEN[$i]}}${sep}"
    done
    echo "]"
} >"${OUT_DIR}/gpu_check.json"

echo
echo "GPU: $(head -n 1 "${OUT_DIR}/gpu.txt")"
printf '%-16s %-20s %8s\n' "step" "state" "seconds"
for i in "${!NAMES[@]}"; do
    printf '%-16s %-20s %8s\n' "${NAMES[$i]}" "${STATES[$i]}" "${SECONDS_TAKEN[$i]}"
    case "${STATES[$i]}" in passed|skipped*) ;; *) failed=1 ;; esac
done
echo "results: ${OUT_DIR}"
exit "$failed"
