#!/usr/bin/env bash
# Issue 34's GPU measurement (benchmarks/co_location.py) on one GPU: a big task (a random ~0.4B model of
# Qwen2.5-0.5B's shape, built on the machine) and a small one (SmolLM2-135M-Instruct) of two tenants through
# `loraplane up`, co-located (LORAPLANE_WORKER_MAX_PACKS=2), one after the other (=1) and each alone, in a process of
# its own (setsid) that outlives each call while the machine stays warm. ~13-15 minutes of an H100 (the docstring).
#   here:    bash benchmarks/gpu_issue6.sh prepare; bash benchmarks/gpu_issue6.sh prepare-service
#            .venv/bin/pip download liger-kernel==0.8.5 --no-deps -d .whl
#   device:  bash benchmarks/gpu_issue6.sh store                                   # carry [".gguf1"]
#            bash benchmarks/gpu_issue6.sh store-service                           # carry [".whlsvc"]
#            LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue34.sh start          # carry [".gguf2", ".whl"]
#            bash benchmarks/gpu_issue34.sh wait 540                              # again until "all done"
# CO_LOCATION_ARGS are co_location.py's own (`--runs co-located one-after-other`, `--small-steps 300`, ...); a later
# `start` on the same warm machine reuses the built model and the de-quantised SmolLM2 under /root/lp/co_location/work.
# Each `wait` leaves $OUT/co_location.tar.gz: the benchmark's log, each run's service log and the result file
# (benchmarks/results/co_location-gpu-<date>.json, written again after each run: `"complete": false` until the last)
# to commit here.
set -uo pipefail
stage="${1:-start}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT="${OUT:-/tmp/out}"
RUN=/root/lp/co_location
source "$(dirname "$0")/gpu_smollm2.sh"

case $stage in
  start)
    test -d /root/lp/svcsite || { echo "the service's wheels are gone: run gpu_issue6.sh store-service again"; exit 3; }
    join_model
    # $RUN/work is kept (the built model, the shared model cache); each start's services get fresh homes in it.
    rm -rf "$RUN/repo" "$RUN/results" "$RUN/logs" "$RUN/work/homes" "$RUN/co_location.log"
    mkdir -p "$RUN/results" "$RUN/work" && cp -r . "$RUN/repo"  # the call's tree goes with the call
    nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu --format=csv
    (cd "$RUN/repo" && LORAPLANE_BENCH_RESULTS="$RUN/results" PYTHONPATH=/root/lp/pkg:/root/lp/svcsite:/root/lp/site:. \
      setsid nohup timeout "${CO_LOCATION_LIMIT_S:-1800}" python -m benchmarks.co_location --work "$RUN/work" \
      ${CO_LOCATION_ARGS:-} > "$RUN/co_location.log" 2>&1 < /dev/null &)
    sleep 5
    exec bash "$0" wait "${2:-300}" ;;  # joining the model and starting take ~1-2 min of the call
  wait)
    running() { pgrep -f "[b]enchmarks.co_location" >/dev/null; }
    deadline=$(( $(date +%s) + ${2:-540} ))
    while running && [ "$(date +%s)" -lt "$deadline" ]; do sleep 15; done
    tail -40 "$RUN/co_location.log"
    running && echo "still running" || echo "all done"
    mkdir -p "$RUN/logs"
    for home in "$RUN"/work/homes/*/; do
      [ -f "$home/service.log" ] && cp "$home/service.log" "$RUN/logs/$(basename "$home").log"
    done
    tar czf "$OUT/co_location.tar.gz" -C "$RUN" results logs co_location.log ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
