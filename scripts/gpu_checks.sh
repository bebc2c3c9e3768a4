#!/usr/bin/env bash
# GPU checks in one call: JAX backend only (the GPU machine has no TensorFlow), well inside
# 8 minutes on one H200, everything written under OUT_DIR (JSON, markdown, PNG, logs).
#   bash scripts/gpu_checks.sh OUT_DIR
# ../shared/gpu/README.md says how to run it there (bash .gpu/on-device.sh runs this script).
# GPU_CHECKS_QUICK=1 shrinks every part to a smoke test (to try the script on a CPU first).
# Each part has its own time limit, so one slow part cannot eat the others' time; a part that
# fails or times out is reported and the script goes on, exiting 1 at the end.
set -uo pipefail
out="${1:?usage: bash scripts/gpu_checks.sh OUT_DIR}"
mkdir -p "$out"
export KERAS_BACKEND=jax KBACKEND_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
quick="${GPU_CHECKS_QUICK:-0}"
failed=0

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=1
}

python3 -m kbackend info > "$out/info.txt" 2>&1 || failed=1

if [ "$quick" = 1 ]; then
  part study_default 300 python3 -m kbackend study --no-progress --out "$out/study_default" \
    --optimizers sgd,adam --batch-sizes 32,1024 --seeds 2 --lrs sgd=0.6 --lrs adam=0.004 \
    --step-time-repeats 1 --noise-points 0
  part engines 120 python3 scripts/bench_engines.py --quick --backends jax --out "$out/bench"
  part knee 120 python3 scripts/bench_throughput.py --backends jax --batch-sizes 8,64,512 \
    --budget-s 20 --repeats 1 --out "$out/bench"
  part data_parallel 120 python3 scripts/bench_parallel.py --quick --devices 1 --out "$out/bench"
else
  # Budgets (s): 130 + 60 + 45 + 30 + 140 = 405, plus start-up: well inside 8 minutes (the
  # default study trains to 0.65 since 2026-12-04, twice the steps of the 0.6 it had).
  # The default study (mnist1d_large) on the GPU: the same question as on the CPU, other hardware.
  part study_default 130 python3 -m kbackend study --no-progress --out "$out/study_default"
  # The engine table (quick: its full version's budget is sized for CPUs).
  part engines 60 python3 scripts/bench_engines.py --quick --backends jax --out "$out/bench"
  # Throughput vs batch size up to 8192 and its knee (samples/s gain per doubling < 10%).
  part knee 45 python3 scripts/bench_throughput.py --backends jax --repeats 1 --budget-s 35 \
    --batch-sizes 8,16,32,64,128,256,512,1024,2048,4096,8192 --out "$out/bench"
  # The data-parallel engine's step on the one GPU (jax.shard_map over one device) against
  # itself at fixed per-device and global batches: its overhead where a second GPU would go.
  part data_parallel 30 python3 scripts/bench_parallel.py --quick --devices 1 --out "$out/bench"
  # The MNIST study of issue 12 (batch 8..4096, 3 seeds) with populations: --population auto
  # probes vmapped populations against sequential runs per cell on the GPU and records the
  # choice; when the MNIST file came along.
  if [ -n "${KBACKEND_DATA_DIR:-}" ] && [ -f "$KBACKEND_DATA_DIR/mnist.npz" ]; then
    part study_mnist 140 python3 -m kbackend study --no-progress --out "$out/study_mnist" \
      --dataset mnist --model seed_mlp --seeds 3 --optimizers sgd,momentum,adam \
      --batch-sizes 8,16,32,64,128,256,512,1024,2048,4096 --max-steps 4000 --noise-points 2 \
      --population auto
  else
    echo "== study_mnist skipped: no mnist.npz in KBACKEND_DATA_DIR"
  fi
fi
exit "$failed"
