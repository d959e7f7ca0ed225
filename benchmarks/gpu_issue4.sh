#!/usr/bin/env bash
# Issue 4 on the device, in one call (the device tool runs it in the repository root):
#   run: LORAPLANE_COMMIT=<hash of HEAD here> bash benchmarks/gpu_issue4.sh [stages]   (nvidia-h100-x1, 600 s)
# (the device's copy of .git can be stale: the hash written into the results comes from LORAPLANE_COMMIT)
# Stages (default "tests e2e1 layer"): tests = the kernel tests on the GPU; e2e1 = the engine at per-trial
# batch 1, torch vs Triton backends, PEFT, frozen ceiling, MFU and a profiler table; e2e24 = batches 2 and 4
# (decoder layers recomputed); e2e8b = Llama-3.1-8B shape, 8 trials; layer = the layer-level grid.
# Each stage is time-boxed and copies its results to $OUT as it finishes.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
stages="${*:-tests e2e1 layer}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
touch /tmp/gpu_issue4.start
save() { find benchmarks/results -name '*gpu*.json' -newer /tmp/gpu_issue4.start -exec cp {} "$OUT/" \; ; true; }
for stage in $stages; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout 200 python -m pytest --confcutdir=tests/kernels -p no:cacheprovider -q tests/kernels \
             > "$OUT/tests.log" 2>&1; tail -4 "$OUT/tests.log"; grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20 ;;
    enginetests) timeout 240 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q tests/engine \
             > "$OUT/enginetests.log" 2>&1; tail -4 "$OUT/enginetests.log"
             grep -E "^(FAILED|E  )" "$OUT/enginetests.log" | head -20 ;;
    e2e1) timeout 300 python -m benchmarks.engine_throughput --shape llama-3.2-1b --trials 32 --batch 1 \
            --seq-len 512 --backends torch triton --profile --mfu > "$OUT/e2e1.log" 2>&1; tail -30 "$OUT/e2e1.log" ;;
    e2e24) timeout 400 python -m benchmarks.engine_throughput --shape llama-3.2-1b --trials 32 --batch 2 4 \
             --seq-len 512 --backends torch triton --activation-checkpointing --mfu 2>&1 | tail -12 ;;
    e2e8b) timeout 400 python -m benchmarks.engine_throughput --shape llama-3.1-8b --trials 8 --batch 1 \
             --seq-len 512 --backends torch triton --mfu --peft-steps 2 2>&1 | tail -12 ;;
    layer) timeout 300 python -m benchmarks.lora_layer --slots 1 8 32 --tokens 1024 4096 8192 > "$OUT/layer.log" 2>&1
           tail -40 "$OUT/layer.log" ;;
    layer48) timeout 240 python -m benchmarks.lora_layer --slots 8 32 --tokens 4096 8192 > "$OUT/layer48.log" 2>&1
           tail -22 "$OUT/layer48.log" ;;
    layerq) timeout 120 python -m benchmarks.lora_layer --quick 2>&1 | tail -8 ;;
    layer2) timeout 200 python -m benchmarks.lora_layer --slots 8 32 --tokens 4096 8192 > "$OUT/layer2.log" 2>&1
            tail -20 "$OUT/layer2.log" ;;
  esac
  save
done
[ -f "$OUT/tests.log" ] && { echo "=== tests"; tail -3 "$OUT/tests.log"; }
echo "=== done $(date +%T)"
