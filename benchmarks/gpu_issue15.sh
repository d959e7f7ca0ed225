#!/usr/bin/env bash
# Issue 15's measurements on the device, in one call (the device tool runs it in the repository root):
#   run: LORAPLANE_COMMIT=<hash of HEAD here> bash benchmarks/gpu_issue15.sh [stages]   (nvidia-h100-x1, 600 s)
# Every result carries the `summary` rows issue 15 asks for (engine, frozen HF-eager, the strong PEFT baseline:
# one adapter per trial, bf16, SDPA, fused AdamW), measured side by side in one run.
# Stages (default "b1 small"): b1 = Llama-3.2-1B shape, 32 trials (ranks 16/32/64), batch 1, seq 512, torch and
# Triton backends, profile and MFU; small = SmolLM2-135M shape, 24 trials, batch 4, seq 96, the same columns;
# host = where the host's time goes in a SmolLM2-shaped step (cProfile, torch.profiler; logs in $OUT);
# tests = the kernel tests and the engine's CUDA tests on the GPU (enginetests: the latter only); auto = what `auto` picks, beside the backend
# it should equal, on both shapes; b24 = the 1B shape at batches 2 and 4, without recompute (Triton, no PEFT);
# b8 = the Llama-3.1-8B shape, 8 trials, batch 1, seq 512 (Triton, no PEFT: MFU);
# fusedshare = the 1B shape with each fused base op alone (LORAPLANE_FUSED_OPS), beside all and none;
# capture = the eager step against its forward+backward replayed from a CUDA graph, one fixed batch, on the
# SmolLM2, 1B and 8B shapes (benchmarks/step_capture.py: the ceiling of docs/step-capture.md);
# graphs = the SmolLM2 shape with its steps replayed from CUDA graphs (worker/engine/capture.py: the torch path),
# beside the same with LORAPLANE_STEP_CAPTURE=off and the Triton path, the frozen model and PEFT.
# Liger-Kernel travels as a wheel (benchmarks/gpu_setup.sh says how).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
stages="${*:-b1 small}"
source benchmarks/gpu_setup.sh
python - <<'PY'
import importlib.util
import torch
from worker.engine.attention import attention_path
from worker.engine.fused import chosen_ops
q = torch.zeros(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
print("packed attention:", attention_path(q), "| fused ops:", chosen_ops(),
      "| liger:", importlib.util.find_spec("liger_kernel") is not None)
PY
touch /tmp/gpu_issue15.start
save() { find benchmarks/results -name '*gpu*.json' -newer /tmp/gpu_issue15.start -exec cp {} "$OUT/" \; ; true; }
for stage in $stages; do
  echo "=== $stage $(date +%T)"
  case $stage in
    b1) timeout 330 python -m benchmarks.engine_throughput --shape llama-3.2-1b --trials 32 --batch 1 \
          --seq-len 512 --backends torch triton --profile --mfu --variants LORAPLANE_FUSED_OPS=none > "$OUT/b1.log" 2>&1
        tail -36 "$OUT/b1.log" ;;
    small) timeout 300 python -m benchmarks.engine_throughput --shape smollm2-135m --trials 24 --batch 4 \
             --seq-len 96 --backends triton torch --profile --mfu --variants LORAPLANE_FUSED_OPS=none \
             LORAPLANE_GROUPED_MM=0 LORAPLANE_GROUPED_MM=0,LORAPLANE_FUSED_OPS=none > "$OUT/small.log" 2>&1
           tail -36 "$OUT/small.log" ;;
    fusedshare) timeout 300 python -m benchmarks.engine_throughput --shape llama-3.2-1b --trials 32 --batch 1 \
             --seq-len 512 --backends triton --skip-peft --variants LORAPLANE_FUSED_OPS=none \
             LORAPLANE_FUSED_OPS=rmsnorm LORAPLANE_FUSED_OPS=swiglu LORAPLANE_FUSED_OPS=rope \
             > "$OUT/fusedshare.log" 2>&1; tail -12 "$OUT/fusedshare.log" ;;
    host) for backend in torch triton; do
            timeout 150 python -m benchmarks.step_host_profile --shape smollm2-135m --trials 24 --batch 4 \
              --seq-len 96 --backend $backend > "$OUT/host-$backend.log" 2>&1; head -1 "$OUT/host-$backend.log"
          done ;;
    enginetests) timeout 240 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q tests/engine/test_cuda.py \
             > "$OUT/enginetests.log" 2>&1; tail -3 "$OUT/enginetests.log"
           grep -E "^(FAILED|E  )" "$OUT/enginetests.log" | head -20 ;;
    tests) timeout 240 python -m pytest --confcutdir=tests/kernels -p no:cacheprovider -q tests/kernels \
             > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"; grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
           timeout 240 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q tests/engine/test_cuda.py \
             tests/engine/test_engine.py > "$OUT/enginetests.log" 2>&1; tail -3 "$OUT/enginetests.log"
           grep -E "^(FAILED|E  )" "$OUT/enginetests.log" | head -20 ;;
    auto) timeout 150 python -m benchmarks.engine_throughput --shape smollm2-135m --trials 24 --batch 4 --seq-len 96 \
            --backends torch auto --skip-peft 2>&1 | grep -A3 "^batch"
          timeout 250 python -m benchmarks.engine_throughput --shape llama-3.2-1b --trials 32 --batch 1 --seq-len 512 \
            --backends triton auto --skip-peft 2>&1 | grep -A3 "^batch" ;;
    b8) timeout 300 python -m benchmarks.engine_throughput --shape llama-3.1-8b --trials 8 --batch 1 \
          --seq-len 512 --backends torch triton --skip-peft --mfu --profile --variants LORAPLANE_FUSED_OPS=none \
          > "$OUT/b8.log" 2>&1; tail -28 "$OUT/b8.log" ;;
    graphs) timeout 420 python -m benchmarks.engine_throughput --shape smollm2-135m --trials 24 --batch 4 \
              --seq-len 96 --backends triton torch --profile --mfu --warmup 60 --steps 20 \
              --variants LORAPLANE_STEP_CAPTURE=off > "$OUT/graphs.log" 2>&1; tail -40 "$OUT/graphs.log" ;;
    capture) timeout 150 python -m benchmarks.step_capture --shape smollm2-135m --trials 24 --batch 4 --seq-len 96 \
               --backends torch triton > "$OUT/capture-small.log" 2>&1; tail -8 "$OUT/capture-small.log"
             timeout 150 python -m benchmarks.step_capture --shape llama-3.2-1b --trials 32 --batch 1 --seq-len 512 \
               --backends triton > "$OUT/capture-1b.log" 2>&1; tail -8 "$OUT/capture-1b.log"
             timeout 280 python -m benchmarks.step_capture --shape llama-3.1-8b --trials 8 --batch 1 --seq-len 512 \
               --backends torch triton > "$OUT/capture-8b.log" 2>&1; tail -8 "$OUT/capture-8b.log" ;;
    b24) timeout 400 python -m benchmarks.engine_throughput --shape llama-3.2-1b --trials 32 --batch 2 4 \
           --seq-len 512 --backends triton --skip-peft --mfu > "$OUT/b24.log" 2>&1
         tail -14 "$OUT/b24.log" ;;
  esac
  save
done
echo "=== done $(date +%T)"
