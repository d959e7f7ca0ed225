#!/usr/bin/env bash
# Issue 37's checks and measurements on a host of two GPUs (nvidia-h200-x2 or nvidia-h100-x2), in one background run.
#   here:    .venv/bin/pip download liger-kernel==0.8.5 --no-deps -d .whl
#            bash benchmarks/gpu_issue6.sh prepare-service                     # .whlsvc: the service's wheels
#   device:  LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue37.sh start      # carry [".whl", ".whlsvc"]; returns
#            bash benchmarks/gpu_issue37.sh wait 560                           # after ~560 s; call again until done
# `start` runs the steps below in a process of its own (setsid), each under its own time limit, logging to
# /root/lp/i37/<step>.log; `wait` follows it and leaves $OUT/i37.tar.gz (logs and result files) after each call.
# Steps, in order of what matters if time runs out (STEPS="..." picks some):
#   nccl     benchmarks/collectives.py: one 8B layer's all-gather timed alone, NCCL's chosen transport from its log
#   quick    a sharded pack of the 1B shape on both GPUs, Liger's fused ops on (what crashed); if it fails, `diag`
#            runs it again per fused op with CUDA_LAUNCH_BLOCKING=1, to name the culprit
#   tests    tests/engine/test_distributed.py on two GPUs (NCCL: the scenario of back-fill, export, pause and resume
#            over each LoRA and attention path, against one GPU) and the engine's one-GPU CUDA tests
#   8b       benchmarks/multi_gpu.py: 8B shape, 16 trials, one GPU against two, side by side in one run, each
#            profiled (their Chrome traces come back beside i37.tar.gz)
#   8b-replicate, 8b-keep   the same with the base whole on each rank (no gathers: the ceiling of the rank's
#            own step), and sharded but kept whole from forward to backward (half the gathers)
#   8b-b4    the same at batch 4: four times the rows a step, for what is fixed per step against what is per row
#   70b      the 70B shape, 48 layers, built sharded in place (no disk), over two GPUs only
#   service  benchmarks/multi_gpu_service.py: `loraplane up --no-worker` + `loraplane worker --gpus 0,1`, a task on a
#            registered 8B-shape directory, its adapter loaded in PEFT
#   pool     benchmarks/rank_pool.py: the worker's rank pool (worker/rank_pool.py) on the 8B shape, one GPU vs two
#   paths    the 1B shape over two GPUs with the Triton LoRA path and with the rows attention path
set -uo pipefail
stage="${1:-start}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_BENCH_DIR=/root/lp/models
OUT="${OUT:-/tmp/out}"
LOGS=/root/lp/i37
mkdir -p "$OUT" "$LOGS" /root/lp/models

collect() {
  cp benchmarks/results/multi_gpu-* benchmarks/results/rank_pool-* benchmarks/results/multi_gpu_service-* \
    benchmarks/results/collectives-* "$LOGS"/ 2>/dev/null
  cp "$LOGS"/trace/*.json.gz "$OUT"/ 2>/dev/null  # already compressed, each a file of its own
  tar -czf "$OUT/i37.tar.gz" --exclude='*.json.gz' -C /root/lp i37 2>/dev/null
}

case $stage in
  start)
    [ -z "${KEEP:-}" ] && rm -rf "$LOGS"/*  # KEEP=1: a later run beside an earlier one's logs
    while pgrep -f "gpu_issue37.sh all" >/dev/null; do sleep 5; done  # one driver at a time
    setsid nohup bash "$0" all > "$LOGS/driver.log" 2>&1 < /dev/null &
    sleep 5
    exec bash "$0" wait "${2:-540}" ;;
  wait)
    deadline=$(( $(date +%s) + ${2:-540} ))
    while ! grep -q "^=== all done" "$LOGS/driver.log" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 10
    done
    cat "$LOGS/driver.log"
    current=$(ls -t "$LOGS"/*.log 2>/dev/null | grep -v driver.log | head -1)
    [ -n "$current" ] && { echo "--- tail of $current"; tail -25 "$current"; }
    collect ;;
  all)
    source benchmarks/gpu_setup.sh
    python -m pip install -q --no-index --no-deps --no-compile --target /root/lp/svcsite .whlsvc/*.whl \
      && export PYTHONPATH=/root/lp/svcsite:${PYTHONPATH:-}
    nvidia-smi topo -m
    memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    # The 70B shape's adapters: 8 trials of rank up to 64 on every projection fit beside a 48-layer half on an
    # H200 (141 GB), 4 on an H100 (80 GB).
    big_trials=$([ "$memory" -gt 100000 ] && echo 8 || echo 4)
    eight_trials=$([ "$memory" -gt 100000 ] && echo 16 || echo 8)  # the 8B shape's one-GPU baseline must fit too
    mg=(python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.multi_gpu)
    step() {  # step NAME LIMIT_S COMMAND...: one step, its log, its exit status and time in the driver's log
      local name=$1 limit=$2; shift 2
      local started; started=$(date +%s)
      echo "=== $name started $(date +%T)"
      timeout --kill-after=20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
      local rc=$?
      echo "=== $name rc=$rc in $(( $(date +%s) - started )) s"
      grep -E "^(FAILED|ERROR)|Error|passed|failed|x one GPU|GPUs, base|one GPU|succeeded|written to" "$LOGS/$name.log" \
        | grep -v Warning | tail -12
      collect
      return $rc
    }
    for s in ${STEPS:-nccl quick tests 8b 8b-replicate 8b-keep 8b-b4 70b service pool paths}; do
      case $s in
        quick)
          if ! step quick 300 "${mg[@]}" --shape llama-3.2-1b --trials 4 --seq-len 256 --warmup 1 --steps 2; then
            for ops in none rmsnorm swiglu rope; do
              CUDA_LAUNCH_BLOCKING=1 LORAPLANE_FUSED_OPS=$ops step "diag-$ops" 150 "${mg[@]}" --shape llama-3.2-1b --trials 2 \
                --seq-len 128 --warmup 0 --steps 1 --no-single
            done
          fi ;;
        tests)
          step tests 600 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q -rs \
            tests/engine/test_distributed.py tests/engine/test_fused.py tests/engine/test_cuda.py ;;
        nccl) NCCL_DEBUG=INFO step nccl 120 python -m torch.distributed.run --standalone --nproc_per_node=2 \
                -m benchmarks.collectives --shape llama-3.1-8b
              grep -E "via |Channel 00|NVLS|P2P" "$LOGS/nccl.log" | head -8 ;;
        8b) step 8b 600 "${mg[@]}" --shape llama-3.1-8b --trials "$eight_trials" --seq-len 512 --warmup 3 \
              --steps 10 --profile --trace "$LOGS/trace" ;;
        8b-replicate|8b-keep)
          step "$s" 600 "${mg[@]}" --shape llama-3.1-8b --trials "$eight_trials" --seq-len 512 --warmup 3 --steps 10 \
            --profile --layout "$([ "$s" = 8b-keep ] && echo shard-keep || echo replicate)" ;;
        8b-b4) step 8b-b4 600 "${mg[@]}" --shape llama-3.1-8b --trials "$eight_trials" --batch 4 --seq-len 512 \
                 --warmup 2 --steps 6 --profile ;;
        70b) step 70b 600 "${mg[@]}" --shape llama-3.1-70b --layers 48 --trials "$big_trials" --seq-len 512 --warmup 2 \
               --steps 4 --no-single ;;
        service) step service 600 python -m benchmarks.multi_gpu_service --gpus 0,1 --shape llama-3.1-8b \
                   --model-dir /root/lp/models/rank_pool-llama-3.1-8b-None ;;
        pool) step pool 600 python -m benchmarks.rank_pool --devices cuda:0,cuda:1 --shape llama-3.1-8b \
                --trials "$eight_trials" --seq-len 512 --steps 30 ;;
        paths)
          LORAPLANE_LORA_BACKEND=triton step paths-triton 240 "${mg[@]}" --shape llama-3.2-1b --trials 8 --seq-len 512 \
            --warmup 3 --steps 10
          LORAPLANE_ATTENTION=rows step paths-rows 240 "${mg[@]}" --shape llama-3.2-1b --trials 8 --seq-len 512 --warmup 3 \
            --steps 10 --profile ;;
      esac
    done
    echo "=== all done $(date +%T)" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
