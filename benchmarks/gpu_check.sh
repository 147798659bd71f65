#!/usr/bin/env bash
# The GPU check of the kernel library, offline, for one GPU machine (sized for one H200: under
# 8 minutes in all, each step under its own deadline). The machine has torch, Triton, their CUDA
# libraries and numpy, and reaches no package index: everything else comes from the carry that
# benchmarks/gpu_prepare.sh wrote (default .gpu-carry/; carry it with the working tree).
#   0. setup          a venv (uv from the carry) that sees the machine's torch/Triton/numpy through a
#                     path layer; the carry installed into it with no index (--no-index --find-links);
#                     the machine checked against the carry's target; the bench stage's base seeded
#   1. gpu_tests      the GPU tests of kernels, bench and runner (pytest -m gpu, the files that have them)
#   2. aot_selfcheck  python -m kiln_kernels.selfcheck: compile for this device, load, launch, compare
#   3. bench          kiln bench --metric graph_replay --size large: the wheel built, its isolated
#                     environment made by uv from the carry over the machine's torch, every kernel timed
#                     under Kiln's local Prefect server (SQLite)
# A failed step does not stop the others (after a failed setup they are "skipped"); the script exits 1
# if any failed. Results go to $OUT (default: a fresh temporary directory): a log per step,
# gpu_check.json and the table printed last, each failure with the line that names what was missing.
#
# --cpu: the same, proved on a machine without a GPU and without network: the carry is prepared for
# this machine's Python, torch and Triton (PYTHON, default .venv/bin/python; into $OUT/carry unless
# --carry names another folder), then the check runs in a
# network namespace of its own (unshare -n, as root) with the GPU steps skipped and the CPU bench
# (kiln bench --metric cpu --size small) run instead.
#
# Usage: benchmarks/gpu_check.sh [--carry DIR]        (on the GPU machine, from the repository root)
#        OUT=/some/dir PYTHON=python3 benchmarks/gpu_check.sh
#        benchmarks/gpu_check.sh --cpu [--carry DIR]   (here; root; needs PyPI to prepare the carry)
set -euo pipefail

cd "$(dirname "$0")/.."
REPO="$PWD"
MODE=gpu
CARRY="$REPO/.gpu-carry"
CARRY_GIVEN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --offline-cpu) MODE=offline-cpu ;;  # internal: the --cpu check, already inside its namespace
        --carry) [ $# -ge 2 ] || { echo "gpu_check: --carry needs a folder" >&2; exit 2; }
                 CARRY="$(realpath -m "$2")"; CARRY_GIVEN=1; shift ;;
        *) echo "gpu_check: unknown argument $1 (usage: gpu_check.sh [--cpu] [--carry DIR])" >&2; exit 2 ;;
    esac
    shift
done
OUT_DIR="$(realpath -m "${OUT:-$(mktemp -d -t kiln-gpu-check.XXXXXX)}")"
mkdir -p "$OUT_DIR"
export OUT="$OUT_DIR"

if [ "$MODE" = cpu ]; then
    export PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
    [ "$CARRY_GIVEN" = 1 ] || CARRY="$OUT_DIR/carry"  # never over the GPU machine's carry in .gpu-carry/
    read -r PY_V TORCH_V TRITON_V < <("$PYTHON" -c "import sys, torch, triton; from packaging.version import Version; \
print(f'{sys.version_info[0]}.{sys.version_info[1]}', Version(torch.__version__).public, triton.__version__)")
    echo "== prepare: the carry for Python ${PY_V}, torch ${TORCH_V}, Triton ${TRITON_V} (log ${OUT_DIR}/prepare.log)"
    start=$(date +%s)
    if ! timeout --kill-after=15 900 "$PYTHON" benchmarks/gpu_carry.py prepare --python-version "$PY_V" \
            --torch-version "$TORCH_V" --triton-version "$TRITON_V" --out "$CARRY" >"${OUT_DIR}/prepare.log" 2>&1; then
        cat "${OUT_DIR}/prepare.log" >&2
        exit 1
    fi
    cat "${OUT_DIR}/prepare.log"
    echo "$(( $(date +%s) - start ))" >"${OUT_DIR}/prepare.seconds"
    if [ "$(id -u)" -ne 0 ] || ! unshare -n true 2>/dev/null; then
        echo "gpu_check --cpu: cannot make a network namespace here (unshare -n needs root)" >&2
        exit 2
    fi
    # A namespace of its own: no interface but loopback, which Prefect's local server listens on.
    exec unshare -n -- bash -c 'ip link set lo up && exec "$0" --offline-cpu --carry "$1"' "$0" "$CARRY"
fi

PYTHON="${PYTHON:-$( [ "$MODE" = offline-cpu ] && echo "$REPO/.venv/bin/python" || echo python3 )}"
if [ ! -f "$CARRY/carry.json" ]; then
    echo "gpu_check: no carry at $CARRY (prepare it with benchmarks/gpu_prepare.sh, then carry it)" >&2
    exit 2
fi
# The interpreter must be off for real GPU runs, whatever the caller's shell says.
unset TRITON_INTERPRET
if [ "$MODE" = gpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        2>/dev/null; then
    echo "gpu_check: no GPU visible to ${PYTHON} (torch.cuda.is_available() is False); nothing to check" >&2
    exit 2
fi

WORK="$(mktemp -d -t kiln-gpu-work.XXXXXX)"
VENV="$WORK/venv"
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
# Nothing below reaches an index: pip and uv see only the carry; a missing wheel fails, naming it.
unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT UV_INDEX UV_INDEX_URL UV_EXTRA_INDEX_URL UV_DEFAULT_INDEX
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$CARRY" PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
export UV_NO_INDEX=1 UV_FIND_LINKS="$CARRY" UV_OFFLINE=1 UV_NO_CONFIG=1 UV_PYTHON_DOWNLOADS=never \
    UV_CACHE_DIR="$WORK/uv-cache"
# What the machine provides (torch, Triton, numpy) uv never resolves nor installs: the bench stage's
# environment sees the machine's own through its base layer, as a wheel built against them expects.
"$PYTHON" -c "import json, sys; print(''.join(f'{n} ; sys_platform == \"never\"\n' for n in \
json.load(open(sys.argv[1]))['provided']), end='')" "$CARRY/carry.json" >"$WORK/provided-overrides.txt"
export UV_OVERRIDE="$WORK/provided-overrides.txt"
# Kiln's state for this check only: its own local Prefect server and home, the test environments, no daemon.
unset PREFECT_API_URL PREFECT_PROFILE
export PREFECT_HOME="$WORK/prefect" KILN_TEST_ENV_CACHE="$WORK/test-envs" KILN_DAEMON=off
export PATH="$VENV/bin:$WORK/bin:$PATH" PYTHON CARRY VENV WORK OUT_DIR

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

skip_step() {
    echo "== $1: skipped ($2)"
    echo "skipped: $2" >"${OUT_DIR}/$1.log"
    NAMES+=("$1"); STATES+=("skipped"); SECONDS_TAKEN+=(0)
}

# setup: uv out of the carry's wheel, the venv over the machine's layer, the carry installed with no index.
setup() {
    set -euo pipefail
    mkdir -p "$WORK/bin"
    "$PYTHON" -c "import sys, zipfile, glob; w = zipfile.ZipFile(glob.glob(sys.argv[1] + '/uv-*.whl')[0]); \
open(sys.argv[2], 'wb').write(w.read(next(n for n in w.namelist() if n.endswith('/scripts/uv'))))" \
        "$CARRY" "$WORK/bin/uv"
    chmod +x "$WORK/bin/uv"
    "$WORK/bin/uv" venv --quiet --python "$PYTHON" "$VENV"
    "$PYTHON" benchmarks/gpu_carry.py layer --carry "$CARRY" --out "$WORK/machine"
    local site
    site="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    echo "$WORK/machine" >"$site/zz_kiln_machine_layer.pth"
    "$WORK/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-index --find-links "$CARRY" --no-deps \
        "$CARRY"/*.whl
    "$VENV/bin/python" benchmarks/gpu_carry.py check --carry "$CARRY"
    "$VENV/bin/python" benchmarks/gpu_carry.py seed-base
    "$VENV/bin/python" -c "import json, sys; from importlib import metadata; \
json.dump(sorted(f'{d.metadata[\"Name\"]}=={d.version}' for d in metadata.distributions(path=[sys.argv[1]])), \
open(sys.argv[2], 'w'), indent=1)" "$site" "${OUT_DIR}/installed.json"
}
export -f setup

if [ "$MODE" = gpu ]; then
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        >"${OUT_DIR}/gpu.txt" 2>&1 || echo "gpu_check: nvidia-smi unavailable" >"${OUT_DIR}/gpu.txt"
else
    echo "none (--cpu)" >"${OUT_DIR}/gpu.txt"
fi

run_step setup 90 bash -c setup
if [ "${STATES[0]}" != passed ]; then
    for step in gpu_tests aot_selfcheck bench; do skip_step "$step" "setup failed"; done
elif [ "$MODE" = gpu ]; then
    mapfile -t GPU_FILES < <(grep -l "pytest.mark.gpu" tests/kernels/test_*.py tests/bench/test_*.py \
        tests/testing/test_*.py 2>/dev/null)
    run_step gpu_tests 90 "$VENV/bin/python" -m pytest -m gpu "${GPU_FILES[@]}" -q -p no:cacheprovider \
        --junitxml="${OUT_DIR}/gpu_tests.xml"
    run_step aot_selfcheck 60 "$VENV/bin/python" -m kiln_kernels.selfcheck --out "${OUT_DIR}/aot_selfcheck.json"
    # TODO(bench stage): once a GPU run has recorded its first history, add `--compare last` here.
    run_step bench 210 "$VENV/bin/kiln" bench --metric graph_replay --size large \
        --run-dir "${OUT_DIR}/bench_run" --out "${OUT_DIR}/bench_gpu.json"
else
    skip_step gpu_tests "--cpu: no GPU"
    skip_step aot_selfcheck "--cpu: no GPU"
    run_step bench 900 "$VENV/bin/kiln" bench --metric cpu --size small \
        --run-dir "${OUT_DIR}/bench_run" --out "${OUT_DIR}/bench_cpu.json"
fi

# What a failed step's log names: the last line that says what was missing, else its last line.
"$PYTHON" - "$OUT_DIR" "$CARRY" "$MODE" "${NAMES[@]}" -- "${STATES[@]}" -- "${SECONDS_TAKEN[@]}" <<'EOF'
import json, re, socket, sys
from pathlib import Path
out, carry, mode, rest = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
first = rest.index("--")
names, rest = rest[:first], rest[first + 1:]
states, seconds = rest[:rest.index("--")], rest[rest.index("--") + 1:]
said = re.compile(r"No module named|ModuleNotFound|not installed|missing|cannot|not found|no wheel|Error|refused")
def detail(name, state):
    if state in ("passed", "skipped"):
        return (out / f"{name}.log").read_text().strip() if state == "skipped" else ""
    lines = [ln.strip() for ln in (out / f"{name}.log").read_text(errors="replace").splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if said.search(ln)), lines[-1] if lines else "no output")[:500]
try:
    socket.create_connection(("pypi.org", 443), timeout=5).close()
    network = "reachable (pypi.org:443)"
except OSError as exc:
    network = f"none ({type(exc).__name__}: {exc})"
steps = [{"step": n, "state": s, "seconds": int(t), "detail": detail(n, s)} for n, s, t in zip(names, states, seconds)]
size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
prepared = out / "prepare.seconds"
result = {"mode": mode, "gpu": (out / "gpu.txt").read_text().strip(), "network": network,
          "carry": {"path": str(carry), "mib": round(size / 2**20, 1), "target": json.loads((carry / "carry.json").read_text())["target"]},
          "prepare_seconds": int(prepared.read_text()) if prepared.exists() else None, "steps": steps}
(out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"\nGPU: {result['gpu']}\nnetwork: {network}\ncarry: {result['carry']['mib']} MiB at {carry}")
print(f"{'step':16s} {'state':20s} {'seconds':>8s}  detail")
for s in steps:
    print(f"{s['step']:16s} {s['state']:20s} {s['seconds']:8d}  {s['detail'][:100]}")
print(f"results: {out}")
EOF

failed=0
for state in "${STATES[@]}"; do
    case "$state" in passed|skipped) ;; *) failed=1 ;; esac
done
exit "$failed"
