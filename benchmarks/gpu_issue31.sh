#!/usr/bin/env bash
# Issue 31's GPU check: the restructured engine trains at the speed it did before (no behaviour change).
#   here:   mkdir .baseline && git archive <commit before the restructuring> | tar -x -C .baseline
#           .venv/bin/pip download liger-kernel==0.8.5 --no-deps -d .whl
#   device: LORAPLANE_COMMIT=<HEAD here> bash benchmarks/gpu_issue31.sh [stages]   (carry .baseline .whl; 600 s)
# Stages (default "throughput tests"; ROUNDS=n alternations, default 2):
# tests      = the engine's CUDA tests at HEAD (the split engine, graphs, snapshots, architectures);
# throughput = benchmarks/engine_throughput.py on the Llama-3.2-1B shape (32 trials x batch 1, random weights),
#              the copy before the restructuring and HEAD alternately, twice each, on the same GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
stages="${*:-throughput tests}"
source benchmarks/gpu_setup.sh
here=$(pwd)
for stage in $stages; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout 300 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q tests/engine/test_cuda.py \
             tests/engine/test_cuda_snapshots.py tests/engine/test_architectures.py > "$OUT/tests.log" 2>&1
           tail -3 "$OUT/tests.log"; grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -30 ;;
    throughput)
      for round in $(seq 1 "${ROUNDS:-2}"); do
        for side in before after; do
          dir=$here; [ "$side" = before ] && dir=$here/.baseline
          (cd "$dir" && timeout 140 python -m benchmarks.engine_throughput --shape llama-3.2-1b --batch 1 \
             --steps 10 --skip-peft > "$OUT/throughput-$side-$round.log" 2>&1)
          echo "--- $side round $round"; tail -8 "$OUT/throughput-$side-$round.log"
        done
      done ;;
  esac
done
echo "=== done $(date +%T)"
