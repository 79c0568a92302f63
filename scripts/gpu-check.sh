#!/usr/bin/env bash
# Every GPU check in one command, on a GPU node, from a clone of this repository:
#
#   bash scripts/gpu-check.sh                       set up .venv (MPICH wheel + the GPU extra), then check
#   PYTHON=/tmp/venv/bin/python bash scripts/gpu-check.sh   use a ready environment: nothing is installed
#   bash scripts/gpu-check.sh --dry-run [--gpus N] [--cuda X.Y]   print the plan (for such a node), run nothing
#   bash scripts/gpu-check.sh --parts train,step    only these parts (after setup and build), e.g. to rerun one
#
# Parts, each ending in one summary line (PASS / FAIL / SKIP, with the reason and the test counts):
#   setup        find the CUDA version the driver supports (nvidia-smi, else libcuda) and the GPUs;
#                without PYTHON, install axonhpc[gpu-cuda12] or [gpu-cuda13] into .venv through
#                scripts/setup-env.sh, unless cupy already imports there
#   build        compile the Cython core in place (with PYTHON; setup-env.sh builds .venv's)
#   info         axonhpc info: the driver, cupy, NCCL and the GPU count as the library sees them
#   gpu-1rank    every test marked gpu, on one rank (pytest -m gpu, --with-mpi so the mpi ones run too)
#   gpu-2shared  the gpu and mpi tests under mpiexec -n 2 with both ranks on one GPU: cupy arrays go
#                through staged MPI; NCCL between the ranks cannot work there and its tests skip
#   gpu-2nccl    the same tests with a GPU per rank (NCCL between ranks); only on a node with 2+ GPUs
#   train        the main job on the GPU: examples/train_digits.py --device cuda, 2 ranks, >= 95%
#   bench        axonhpc bench allreduce --device gpu on 2 ranks: NCCL, CUDA-aware MPI, staged MPI whole
#                and pipelined, beside the pipeline's bound (4 KiB to 256 MiB)
#   step         axonhpc bench step --device cuda on one rank: our training step beside PyTorch's,
#                the GEMM floor and our step captured as a CUDA graph, fp32, TF32 and bf16, small and large MLP
#   step-unfused the same, fp32 and TF32, with fused kernels off (--no-fused): what the fused
#                layer kernels and optimizer update save
#   gpt          axonhpc bench gpt --device cuda: the GPT step (width 768, 4 layers, context 256, batch 8)
#                beside PyTorch's and beside itself with fused kernels off (--unfused)
#
# Exits 0 when no part failed, 1 when one did, 2 when there is no GPU or the arguments are wrong.
# Every mpiexec runs under `timeout` (AXONHPC_GPU_TIMEOUT seconds a part, default 900). Logs:
# test-logs/gpu-check/ (AXONHPC_GPU_LOGS).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }  # the header comment
DRY=0 FAKE_GPUS="" FAKE_CUDA="" PARTS=""
ALL_PARTS="info gpu-1rank gpu-2shared gpu-2nccl train bench step step-unfused gpt"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --gpus) FAKE_GPUS=${2:-}; shift ;;
        --cuda) FAKE_CUDA=${2:-}; shift ;;
        --parts) PARTS=${2:-}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$FAKE_GPUS$FAKE_CUDA" ] && [ "$DRY" = 0 ]; then
    echo "gpu-check: --gpus and --cuda describe a node for --dry-run only; a real run finds them itself" >&2
    exit 2
fi
if [ -n "$PARTS" ] && [ -z "${PARTS//,/}" ]; then
    echo "gpu-check: --parts takes a comma list of parts, got '$PARTS'" >&2; exit 2
fi
for part in ${PARTS//,/ }; do
    if ! [[ " $ALL_PARTS " == *" $part "* ]]; then
        echo "gpu-check: --parts: unknown part '$part'; the parts are: ${ALL_PARTS// /, } (setup and build always run)" >&2
        exit 2
    fi
done
wanted() { [ -z "$PARTS" ] || [[ ",$PARTS," == *",$1,"* ]]; }
if [ -n "$FAKE_GPUS" ] && ! [[ "$FAKE_GPUS" =~ ^[0-9]+$ ]]; then
    echo "gpu-check: --gpus takes a number of GPUs, got '$FAKE_GPUS'" >&2; exit 2
fi
if [ -n "$FAKE_CUDA" ] && ! [[ "$FAKE_CUDA" =~ ^[0-9]+\.[0-9]+$ ]]; then
    echo "gpu-check: --cuda takes a CUDA version such as 13.0, got '$FAKE_CUDA'" >&2; exit 2
fi

LOGS=${AXONHPC_GPU_LOGS:-test-logs/gpu-check}
T=${AXONHPC_GPU_TIMEOUT:-900}
if ! [[ "$T" =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu-check: AXONHPC_GPU_TIMEOUT must be a positive number of seconds, got '$T'" >&2; exit 2
fi
if [ -n "${PYTHON:-}" ]; then
    if ! [ -x "$PYTHON" ] && ! command -v "$PYTHON" >/dev/null 2>&1; then
        echo "gpu-check: PYTHON=$PYTHON is not an executable" >&2; exit 2
    fi
    PY=$PYTHON GIVEN=1
else
    PY=${AXONHPC_VENV:-.venv}/bin/python GIVEN=0
fi
BASE_PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 AXONHPC_ABORT_ON_EXCEPTION=1
# Open MPI (a wheel or the system's) refuses root and more ranks than cores unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe

SUMMARY=() status=0
record() {  # record PART VERDICT DETAIL
    SUMMARY+=("$(printf '%-4s %-12s %s' "$2" "$1" "$3")")
    [ "$2" = FAIL ] && status=1
    return 0
}
finish() {
    echo
    echo "== gpu-check summary"
    printf '%s\n' "${SUMMARY[@]}"
    [ "$DRY" = 1 ] && echo "(dry run: nothing was installed or run)"
    exit "$status"
}
fatal() {  # fatal PART DETAIL: a failure the later parts cannot run without (a dry run goes on)
    record "$1" FAIL "$2"
    [ "$DRY" = 1 ] || finish
}
shown() {  # a command as one would type it: words with spaces or shell characters in single quotes
    local out="" a q="'"
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+="$a "; else out+="$q${a//$q/$q\\$q$q}$q "; fi
    done
    echo "${out% }"
}
run() {  # run LOG CMD...: the command, its output shown and kept in LOG; its exit status
    local log=$1; shift
    if [ "$DRY" = 1 ]; then echo "  would run: $(shown "$@")"; return 0; fi
    mkdir -p "$(dirname "$log")"
    echo "== $*"
    "$@" 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}
counts() {  # counts JUNIT: "N passed, N failed, N skipped" and the distinct skip reasons
    "$PY" - "$1" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"no test report ({exc})"); sys.exit()
tests = failed = skipped = 0
reasons = {}
for suite in root.iter("testsuite"):
    tests += int(suite.get("tests", 0))
    failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped += int(suite.get("skipped", 0))
for case in root.iter("testcase"):
    for skip in case.findall("skipped"):
        why = (skip.get("message") or "").removeprefix("Skipped: ")
        reasons[why] = reasons.get(why, 0) + 1
line = f"{tests - failed - skipped} passed, {failed} failed, {skipped} skipped"
if reasons:
    line += "; skipped: " + "; ".join(f"{n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
print(line)
PYEOF
}
verdict() {  # verdict PART EXIT JUNIT: PASS/FAIL with the counts (FAIL also when nothing passed)
    local line
    if [ "$DRY" = 1 ]; then record "$1" PLAN "as above"; return; fi
    line=$(counts "$3")
    if [ "$2" -ne 0 ]; then
        record "$1" FAIL "exit $2: $line (log: $(dirname "$3"))"
    elif [[ "$line" == "0 passed"* || "$line" == "no test report"* ]]; then
        record "$1" FAIL "no test passed: $line"
    else
        record "$1" PASS "$line"
    fi
}

part() {  # part PART LINE CMD...: run CMD, its output in $LOGS/PART.log; PASS with what LINE prints from the log,
          # FAIL with the exit status and the log's last error line
    local name=$1 line=$2 log="$LOGS/$1.log" code why; shift 2
    run "$log" "$@"
    code=$?
    if [ "$DRY" = 1 ]; then
        record "$name" PLAN "as above"
    elif [ "$code" = 0 ]; then
        record "$name" PASS "$("$line" "$log")"
    else
        why=$(grep -a -E '[A-Za-z]+(Error|Exception)\b|below the required' "$log" 2>/dev/null | tail -n 1 | cut -c1-200)
        record "$name" FAIL "exit $code${why:+: $why} (log: $log)"
    fi
}

# -- setup: the driver, the GPUs, cupy -------------------------------------------------------------
if [ -n "$FAKE_CUDA$FAKE_GPUS" ]; then
    CUDA=${FAKE_CUDA:-13.0} GPUS=${FAKE_GPUS:-1} HOW="given on the command line"
else
    CUDA="" GPUS="" HOW="" WHY=()
    if command -v nvidia-smi >/dev/null 2>&1; then
        smi=$(nvidia-smi 2>&1)
        CUDA=$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' <<<"$smi" | head -n 1)
        GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
        [ -n "$CUDA" ] && HOW="nvidia-smi" || WHY+=("nvidia-smi: $(head -n 1 <<<"$smi")")
    else
        WHY+=("nvidia-smi: not found")
    fi
    # The driver library counts the devices this process may use (CUDA_VISIBLE_DEVICES applies).
    driver=$("$BASE_PY" - <<'PYEOF' 2>&1
import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    raise SystemExit(f"none {exc}")
version, count = ctypes.c_int(0), ctypes.c_int(0)
if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
    raise SystemExit("none libcuda.so.1: cuDriverGetVersion failed")
status = lib.cuInit(0)
if status == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
    count.value = 0
print(f"{version.value // 1000}.{version.value % 1000 // 10} {count.value} {status}")
PYEOF
)
    if [[ "$driver" =~ ^([0-9]+\.[0-9]+)\ ([0-9]+)\ ([0-9]+)$ ]]; then
        [ -z "$CUDA" ] && CUDA=${BASH_REMATCH[1]} HOW="libcuda.so.1"
        GPUS=${BASH_REMATCH[2]}
        [ "${BASH_REMATCH[3]}" != 0 ] && WHY+=("libcuda.so.1: cuInit returned ${BASH_REMATCH[3]}")
    else
        WHY+=("${driver#none }")
    fi
    GPUS=${GPUS:-0}
    if [ -z "$CUDA" ] || [ "$GPUS" -lt 1 ]; then
        [ ${#WHY[@]} -eq 0 ] && WHY=("the driver reports 0 devices")
        echo "gpu-check: no GPU found ($(printf '%s; ' "${WHY[@]}" | sed 's/; $//')); run this on a GPU node" >&2
        exit 2
    fi
fi
MAJOR=${CUDA%%.*}
echo "gpu-check: CUDA $CUDA driver ($HOW), $GPUS GPU(s); python: $PY"
if [ "$MAJOR" -lt 12 ]; then
    fatal setup "the driver supports CUDA $CUDA; the GPU extras need a CUDA 12 or 13 driver (update the driver)"
fi
EXTRA=gpu-cuda$(( MAJOR >= 13 ? 13 : 12 ))
has_cupy() { [ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || return 1; "$PY" -c "import cupy" >/dev/null 2>&1; }
if [ "$MAJOR" -lt 12 ]; then
    :  # refused above (a dry run goes on to show the rest of the plan)
elif [ "$GIVEN" = 1 ]; then
    missing=$("$PY" - <<'PYEOF' 2>&1
import importlib.util
need = ("cupy", "mpi4py", "numpy", "Cython", "pytest", "pytest_mpi", "pytest_timeout")
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PYEOF
)
    if [ -n "$missing" ]; then
        fatal setup "$PY lacks: $missing (install axonhpc[$EXTRA,test] into it, or leave PYTHON unset to set up .venv)"
    else
        record setup PASS "CUDA $CUDA driver, $GPUS GPU(s); $PY has cupy and the test tools: nothing installed"
    fi
else
    extras=test,bf16,bench,examples
    if has_cupy; then
        note="cupy already imports in $PY: no GPU extra installed"
    else
        verb=$([ "$DRY" = 1 ] && echo "would install" || echo "installed")
        extras=$extras,$EXTRA note="$verb axonhpc[$EXTRA] (CUDA $MAJOR driver) into $(dirname "$(dirname "$PY")")"
    fi
    if run "$LOGS/setup.log" env AXONHPC_EXTRAS="$extras" bash scripts/setup-env.sh; then
        record setup "$([ "$DRY" = 1 ] && echo PLAN || echo PASS)" "CUDA $CUDA driver, $GPUS GPU(s); $note"
    else
        fatal setup "scripts/setup-env.sh failed (log: $LOGS/setup.log and the venv's setup.log)"
    fi
fi
if [ "$DRY" = 0 ] && ! has_cupy; then
    fatal setup "cupy does not import in $PY after the set-up: $("$PY" -c 'import cupy' 2>&1 | tail -n 1)"
fi

# -- build -------------------------------------------------------------------------------------------
if [ "$GIVEN" = 1 ]; then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    if run "$LOGS/build.log" "$PY" setup.py -q build_ext --inplace; then
        record build "$([ "$DRY" = 1 ] && echo PLAN || echo PASS)" "compiled in place, PYTHONPATH=$PWD"
    else
        fatal build "setup.py build_ext failed (log: $LOGS/build.log)"
    fi
else
    record build SKIP "scripts/setup-env.sh built .venv's copy"
fi
MPIEXEC=$(dirname "$PY")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)

# -- info ----------------------------------------------------------------------------------------------
if wanted info; then
    if run "$LOGS/info.json" "$PY" -m axonhpc info --json; then
        if [ "$DRY" = 1 ]; then
            record info PLAN "as above"
        else
            line=$("$PY" - "$LOGS/info.json" <<'PYEOF'
import json, sys
text = open(sys.argv[1], errors="replace").read()
try:  # the JSON object, whatever warnings were printed around it
    f = json.loads(text[text.index("{"):text.rindex("}") + 1])
except ValueError as exc:
    print(f"FAIL could not read the JSON of axonhpc info ({exc})"); sys.exit()
bad = f.get("gpu_problems")
print(("FAIL " if not f.get("cupy") or not f.get("cuda_devices") else "PASS ")
      + f"driver CUDA {f.get('cuda_driver')}, {f.get('cupy_package')}, NCCL {f.get('nccl')}, "
      + f"{f.get('cuda_devices')} GPU(s), device {f.get('device')}" + (f"; problems: {bad}" if bad else ""))
PYEOF
    )
            record info "${line%% *}" "${line#* }"
        fi
    else
        record info FAIL "axonhpc info failed (log: $LOGS/info.json)"
    fi
fi

# -- the gpu tests ---------------------------------------------------------------------------------------
PYTEST_ARGS=(-p no:cacheprovider --color=no --timeout=300 --timeout-method=thread -rs)
if wanted gpu-1rank; then
    run "$LOGS/gpu-1rank.log" timeout -k 10 "$T" "$PY" -m pytest -q -m gpu --with-mpi "${PYTEST_ARGS[@]}" \
        --junitxml="$LOGS/gpu-1rank/junit.xml" tests/
    verdict gpu-1rank $? "$LOGS/gpu-1rank/junit.xml"
fi

# Two ranks on one GPU: the first device this process may use, for both.
if wanted gpu-2shared; then
    first=${CUDA_VISIBLE_DEVICES:-0}
    first=${first%%,*}
    run "$LOGS/gpu-2shared.log" env CUDA_VISIBLE_DEVICES="$first" timeout -k 10 "$T" "$MPIEXEC" -n 2 "$PY" \
        scripts/mpi_pytest.py "$LOGS/gpu-2shared" -q -m "gpu and mpi" "${PYTEST_ARGS[@]}" tests/
    verdict gpu-2shared $? "$LOGS/gpu-2shared/junit-rank0.xml"
fi

if wanted gpu-2nccl; then
    if [ "$GPUS" -ge 2 ]; then
        run "$LOGS/gpu-2nccl.log" timeout -k 10 "$T" "$MPIEXEC" -n 2 "$PY" \
            scripts/mpi_pytest.py "$LOGS/gpu-2nccl" -q -m "gpu and mpi" "${PYTEST_ARGS[@]}" tests/
        verdict gpu-2nccl $? "$LOGS/gpu-2nccl/junit-rank0.xml"
    else
        record gpu-2nccl SKIP "one GPU: NCCL refuses two ranks on one GPU, so NCCL between ranks needs a node with 2+ GPUs"
    fi
fi

# -- the main job on the GPU --------------------------------------------------------------------------------
train_line() { echo "$(grep -a 'final test accuracy' "$1" | tail -n 1); $(grep -a -o 'training on .*:' "$1" | head -n 1)"; }
if wanted train; then
    if [ "$DRY" = 0 ] && ! "$PY" -c "import sklearn" >/dev/null 2>&1; then
        record train SKIP "scikit-learn is not installed in $PY (the digits data set: extra 'examples')"
    else
        rm -rf "$LOGS/train-checkpoints"
        part train train_line timeout -k 10 "$T" "$MPIEXEC" -n 2 "$PY" examples/train_digits.py --device cuda \
            --epochs 20 --min-accuracy 0.95 --checkpoint-dir "$LOGS/train-checkpoints"
    fi
fi

# -- the benchmark ---------------------------------------------------------------------------------------------
bench_line() {
    echo "$(grep -a -c -E '^ *[0-9.]+ [KMG]?i?B ' "$1") sizes timed; 256 MiB bound/pipelined $(grep -a -E '^ *256 MiB ' "$1" \
        | awk '{print $NF}'); $(grep -a '^# nccl' "$1" | head -n 1 | cut -c1-160)"
}
if wanted bench; then
    # AXONHPC_BACKEND=mpi: the world's group stages cupy arrays (where MPI is not CUDA-aware), so the pipelined
    # staged all-reduce is timed beside its bound; the nccl column makes its own communicator either way.
    part bench bench_line timeout -k 10 "$T" env AXONHPC_BACKEND=mpi "$MPIEXEC" -n 2 "$PY" -m axonhpc bench allreduce \
        --device gpu
fi

# -- the training step -------------------------------------------------------------------------------------------
step_line() { echo "$(grep -a -c -E ' (fp32|tf32|bf16) ' "$1") rows; ours/floor, ours/torch and graphed/torch in $1"; }
unfused_line() { echo "$(grep -a -c -E ' (fp32|tf32) ' "$1") rows with fused kernels off; compare with $LOGS/step.log"; }
gpt_line() { grep -a -E '^  (axonhpc|unfused|torch|fused|ratio) ' "$1" | tr -s ' ' | paste -sd ';' | cut -c1-200; }
if wanted step; then
    part step step_line timeout -k 10 "$T" "$PY" -m axonhpc bench step --device cuda
fi
if wanted step-unfused; then
    part step-unfused unfused_line timeout -k 10 "$T" "$PY" -m axonhpc bench step --device cuda --precisions fp32,tf32 \
        --no-fused
fi
if wanted gpt; then
    part gpt gpt_line timeout -k 10 "$T" "$PY" -m axonhpc bench gpt --device cuda --width 768 --heads 12 \
        --layers 4 --context 256 --batch 8 --rounds 5 --steps 3 --profile-steps 5 --no-scaling --unfused
fi
finish
