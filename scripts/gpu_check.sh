#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent, offline device machine (CI has
# none). Seen there: one H200, torch 2.11 (CUDA), Python 3.12, numpy, tensorboard, pytest,
# hypothesis, pyyaml, tqdm; no package registry, no Rust toolchain, no fvcore/mlflow/wandb.
# So hookloop is not built there: a wheel built here comes along with the tree.
#
# On the development machine, in the project root (python3.12 must exist here: the wheel is
# for the device's Python):
#     make gpu-wheel            # a cp312 wheel in .gpu-wheel/ (git-ignored: carry it along)
# On the device machine, in the copied tree:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#         .gpu-wheel/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh
#
# hookloop is imported from PYTHONPATH (the installed wheel), never from the tree's python/
# (no compiled _core there): the env part fails if it would be, and pytest runs from the root
# with pyproject's pythonpath (tests/, benches/) and -p no:cacheprovider.
#
# Parts, in order, each under `timeout` (its own cap, and never past the whole run's budget of
# GPU_CHECK_BUDGET seconds, 285 by default: the run ends in under 5 minutes whatever fails; a
# whole run took 162 s on an H200 before bench's loader part, which adds about 60 s):
#   env      CUDA present; hookloop imported from the wheel, a release build
#   pytest   the CUDA-marked tests (`pytest -m cuda` on the files that hold them)
#   demo     `python3 -m hookloop demo --device cuda --iters 3000` (SimpleTrainer)
#   demo-amp the same with --amp (AMPTrainer, float16 with a GradScaler)
#   demo-graph the same with --cuda-graph and 1000 iterations (CUDAGraphTrainer); skipped on
#            the CPU (GPU_CHECK_CPU=1: the command needs a CUDA device)
#   bench    benches/gpu_check.py: sync counts (0 on iterations that write nothing, for
#            SimpleTrainer and AMPTrainer with the default stack; one per write of the default
#            stack, one per iteration for the seeds' every-step stack); a cProfile of 500
#            eager steps of the default stack and of the bookkeeping hand loop (profile.txt);
#            steps/s of the hand loop, the bookkeeping hand loop, SimpleTrainer/AMPTrainer
#            with no hooks, the default stack and the seeds' stack, and the reference
#            engine's; CUDAGraphTrainer over the hand-written eager loop (tiny MLP batch 16, a
#            small CNN batch 128 of 3x32x32; the ratio per round, in one process) and its
#            syncs per iteration (none on iterations after the capture that write nothing);
#            issue 44's loaders (--loader-n 300 steps a run; about 60 s on an H100, estimated,
#            not yet measured): the hand eager loop fed by DataLoader(TensorDataset,
#            shuffle=True, pin_memory=True) beside the one fed by device batches, the hand-made 1-step graph, CUDAGraphTrainer +
#            default stack fed by that DataLoader and by DeviceResidentLoader (its batch made in
#            the graph), per round; the resident run's syncs per iteration, and each of issue
#            44's Done-when goals met or missed (a missed one is a miss).
#            Each of its parts runs in a process of its own under a timeout (cut to
#            what the run has left).
# (`hookloop bench --cuda-graph` times CUDAGraphTrainer on the tiny MLP too; benches/gpu_check.py
# gives the CUDA steps/s here.)
#
# Writes to $OUT (the device runner sets it; ./gpu-out otherwise), all small files:
#   gpu_check.log   everything printed
#   summary.json    each part's status ("ok", "failed", "timeout", "skipped: ..."), seconds,
#                   exit status; the misses
#   gpu_check.json  benches/gpu_check.py's results (sync counts and where, steps/s, misses)
#   profile.txt     the host profile (top 25 by own time, the callers of the top 8)
# Exit status: 0 when every part passed; 1 on any miss (a part failed, timed out, or had no
# time left); 3 with no CUDA device: only env and pytest run (the CUDA tests skip), the rest
# is "skipped: no CUDA device".
#
# GPU_CHECK_CPU=1 runs every part on the CPU with small sizes (the sync debug mode is then a
# stand-in): the script's own test on a machine without a GPU, e.g. here with
#     maturin build --release -i python3.11 -o /tmp/wheel311 && python3 -m pip install -q \
#         --no-index --no-deps --target /tmp/site311 /tmp/wheel311/*.whl
#     GPU_CHECK_CPU=1 PYTHONPATH=/tmp/site311 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUDGET="${GPU_CHECK_BUDGET:-285}"
WORK="$(mktemp -d /tmp/hookloop-gpu-check.XXXXXX)" # demo outputs: checkpoints stay here
PARTS_TSV="$WORK/parts.tsv"
: >"$PARTS_TSV"

if [[ "${GPU_CHECK_CPU:-0}" == 1 ]]; then
    DEVICE=cpu DEMO_ITERS=200
    BENCH_ARGS=(--cpu-dry-run --iters 45 --n 20 --repeats 1 --profile-steps 50 --graph-n 10
        --loader-n 10)
else
    DEVICE=cuda DEMO_ITERS=3000
    BENCH_ARGS=(--iters 200 --n 400 --repeats 3 --profile-steps 500 --graph-n 300
        --loader-n 300)
fi

# part NAME CAP_SECONDS COMMAND...: runs COMMAND under `timeout` (CAP, or what the budget has
# left), records its status, seconds and exit status in $PARTS_TSV
part() {
    local name="$1" cap="$2"
    shift 2
    local left=$((BUDGET - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        echo "=== $name: skipped (${left} s left of the ${BUDGET} s budget)"
        printf '%s\t%s\t%s\t%s\n' "$name" "skipped: out of time" 0 "" >>"$PARTS_TSV"
        return
    fi
    echo "=== $name (timeout ${limit} s): $*"
    local t0=$SECONDS rc status
    timeout -k 5 "$limit" "$@"
    rc=$?
    case $rc in
        0) status=ok ;;
        3) [[ $name == env ]] && status="no CUDA device" || status=failed ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    echo "=== $name: $status (exit status $rc) in $((SECONDS - t0)) s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$rc" >>"$PARTS_TSV"
}

skip() { # skip NAME WHY
    echo "=== $1: skipped ($2)"
    printf '%s\t%s\t%s\t%s\n' "$1" "skipped: $2" 0 "" >>"$PARTS_TSV"
}

# The Python programs of the env and pytest parts, as files (`timeout` runs a program, not a
# shell function).
# env: which hookloop and torch; fails when hookloop would come from the tree's python/;
# exit status 3 without a CUDA device
cat >"$WORK/env_check.py" <<'EOF'
import os, sys

root, device = sys.argv[1], sys.argv[2]
import torch
import hookloop
import hookloop._core  # noqa: F401  (the compiled extension)

where = os.path.realpath(os.path.dirname(hookloop.__file__))
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, hookloop {hookloop.__version__}"
      f" ({hookloop.BUILD_PROFILE} build) from {where}")
cuda = torch.cuda.is_available()
print("CUDA:", torch.cuda.get_device_name() if cuda else "no device")
bad = []
if where.startswith(os.path.realpath(os.path.join(root, "python")) + os.sep):
    bad.append("hookloop is imported from the tree's python/, not the installed wheel: "
               "install it (.gpu-wheel) and set PYTHONPATH to where it is")
if hookloop.BUILD_PROFILE != "release":
    bad.append(f"hookloop._core is a {hookloop.BUILD_PROFILE!r} build")
for b in bad:
    print("env:", b, file=sys.stderr)
sys.exit(1 if bad else 0 if cuda or device == "cpu" else 3)
EOF

# pytest with the arguments after ROOT; then checks that the hookloop the tests imported was
# the installed one
cat >"$WORK/cuda_tests.py" <<'EOF'
import os, sys

import pytest

root = sys.argv[1]
rc = int(pytest.main(sys.argv[2:]))
import hookloop

where = os.path.realpath(os.path.dirname(hookloop.__file__))
print(f"the tests imported hookloop from {where}")
if where.startswith(os.path.realpath(os.path.join(root, "python")) + os.sep):
    print("pytest: hookloop came from the tree's python/, not the installed wheel", file=sys.stderr)
    rc = rc or 1
sys.exit(rc)
EOF

# The test files that hold CUDA-marked tests (other files' imports may need what the device
# machine lacks: fvcore, mlflow, wandb).
mapfile -t CUDA_TEST_FILES < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)

bench() {
    # gpu_check.py's parts have timeouts of their own (syncs 90, graph 75, loader 75, reads 60,
    # profile 45, speed 200 s), cut by --budget to what this part has
    local left=$((BUDGET - SECONDS - 10))
    local limit=$((left < 260 ? left : 260))
    part bench "$limit" python3 benches/gpu_check.py "${BENCH_ARGS[@]}" --budget "$((limit - 8))" \
        --profile "$OUT/profile.txt" --json "$OUT/gpu_check.json"
}

main() {
    echo "gpu_check.sh: $(date -u '+%Y-%m-%d %H:%M UTC'), device $DEVICE, budget ${BUDGET} s," \
        "results in $OUT"
    echo "PYTHONPATH=${PYTHONPATH:-}"
    part env 60 python3 "$WORK/env_check.py" "$ROOT" "$DEVICE"
    local env_status
    env_status=$(tail -n 1 "$PARTS_TSV" | cut -f4)
    part pytest 120 python3 "$WORK/cuda_tests.py" "$ROOT" -q -p no:cacheprovider -m cuda -rs \
        "${CUDA_TEST_FILES[@]}"
    if [[ "$env_status" == 3 ]]; then
        for p in demo demo-amp demo-graph bench; do skip "$p" "no CUDA device"; done
    elif [[ "$env_status" != 0 ]]; then
        for p in demo demo-amp demo-graph bench; do skip "$p" "env failed"; done
    else
        part demo 60 python3 -m hookloop demo --device "$DEVICE" --iters "$DEMO_ITERS" \
            --output "$WORK/demo"
        part demo-amp 60 python3 -m hookloop demo --device "$DEVICE" --amp \
            --iters "$DEMO_ITERS" --output "$WORK/demo_amp"
        if [[ "$DEVICE" == cuda ]]; then
            part demo-graph 45 python3 -m hookloop demo --device "$DEVICE" --cuda-graph \
                --iters 1000 --output "$WORK/demo_graph"
        else
            skip demo-graph "no CUDA device"
        fi
        bench
    fi
    python3 - "$PARTS_TSV" "$OUT/summary.json" "$DEVICE" "$BUDGET" "$SECONDS" <<'EOF'
import json, sys

tsv, out, device, budget, seconds = sys.argv[1:]
parts, misses = {}, []
for line in open(tsv, encoding="utf-8"):
    name, status, secs, rc = line.rstrip("\n").split("\t")
    parts[name] = {"status": status, "seconds": int(secs), "exit_status": int(rc) if rc else None}
    if name == "env" and rc == "3":
        parts[name]["status"] = "no CUDA device"
    elif status != "ok" and status != "skipped: no CUDA device":
        misses.append(f"{name}: {status}")
no_cuda = parts.get("env", {}).get("exit_status") == 3
code = 1 if misses else 3 if no_cuda else 0
summary = {"device": device, "budget_s": int(budget), "seconds": int(seconds), "parts": parts,
           "misses": misses, "exit_status": code}
with open(out, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
for name, p in parts.items():
    print(f"{name:9} {p['status']:28} {p['seconds']:4} s")
print("misses:", "; ".join(misses) if misses else "none")
if no_cuda:
    print("no CUDA device: the CUDA parts were skipped (exit status 3)")
sys.exit(code)
EOF
}

main 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
