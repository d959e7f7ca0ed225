#!/usr/bin/env bash
# Issue 16's GPU runs in one call (the device tool runs it in the repository root):
#   run: LORAPLANE_COMMIT=<hash of HEAD here> bash benchmarks/gpu_issue16.sh [stages]   (nvidia-h100-x1, 600 s)
# Stages (default "tests families"):
# tests = the engine's CUDA tests, each architecture family's among them (tests/engine/test_architectures.py: bf16,
#   varlen attention with sliding windows, Liger's kernels, Gemma 2's soft caps on the rows path, against the fp32
#   CPU run), and the varlen-against-rows attention test with a window;
# families = benchmarks/engine_throughput.py on random-weight models of other families' shapes: Qwen2.5-0.5B
#   (24 trials x batch 4, seq 256), Phi-3-mini (8 trials x batch 1, seq 512: fused qkv/gate_up) and Gemma-2-2B
#   (8 trials x batch 1, seq 512: soft caps), each beside PEFT with one adapter per trial and the frozen model.
# Liger-Kernel travels as a wheel (benchmarks/gpu_setup.sh says how).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
stages="${*:-tests families}"
source benchmarks/gpu_setup.sh
touch /tmp/gpu_issue16.start
save() { find benchmarks/results -name '*gpu*.json' -newer /tmp/gpu_issue16.start -exec cp {} "$OUT/" \; ; true; }
for stage in $stages; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout 300 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q tests/engine/test_cuda.py \
             tests/engine/test_architectures.py > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"
           grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -30 ;;
    families)
      timeout 200 python -m benchmarks.engine_throughput --shape qwen2.5-0.5b --trials 24 --batch 4 --seq-len 256 \
        --mfu > "$OUT/qwen.log" 2>&1; tail -6 "$OUT/qwen.log"
      timeout 200 python -m benchmarks.engine_throughput --shape phi-3-mini --trials 8 --batch 1 --seq-len 512 \
        --mfu > "$OUT/phi3.log" 2>&1; tail -6 "$OUT/phi3.log"
      timeout 200 python -m benchmarks.engine_throughput --shape gemma-2-2b --trials 8 --batch 1 --seq-len 512 \
        --mfu > "$OUT/gemma2.log" 2>&1; tail -6 "$OUT/gemma2.log" ;;
  esac
  save
done
echo "=== done $(date +%T)"
