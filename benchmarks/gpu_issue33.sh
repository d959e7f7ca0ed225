#!/usr/bin/env bash
# Issue 33's quality benchmark (benchmarks/quality/run.py) on one GPU: SmolLM2-135M-Instruct through `loraplane up`,
# in a process of its own (setsid) that outlives each call while the machine stays warm.
#   here:    bash benchmarks/gpu_issue6.sh prepare; bash benchmarks/gpu_issue6.sh prepare-service
#            .venv/bin/pip download liger-kernel==0.8.5 --no-deps -d .whl
#   device:  bash benchmarks/gpu_issue6.sh store                                   # carry [".gguf1"]
#            bash benchmarks/gpu_issue6.sh store-service                           # carry [".whlsvc"]
#            LORAPLANE_COMMIT=<HEAD> QUALITY_ARGS="--tasks topics extract --sizes small --seeds 0 1 2" \
#              bash benchmarks/gpu_issue33.sh start                               # carry [".gguf2", ".whl"]
#            bash benchmarks/gpu_issue33.sh wait 540                              # again until "all done"
# or, to pick the benchmark's variant of each kind of task first (benchmarks/quality/calibrate.py) and then run it:
#            LORAPLANE_COMMIT=<HEAD> GRID_ARGS="--grid-rank 4 16" QUALITY_ARGS="--sizes small --seeds 0 1 2" \
#              bash benchmarks/gpu_issue33.sh calibrate                           # carry [".gguf2", ".whl"]
# QUALITY_ARGS are run.py's own (tasks, sizes, seeds, arms); the whole matrix (5 tasks x 2 sizes x 3 seeds x 8 arms)
# is hours, so a session runs a part. Each `wait` leaves $OUT/quality.tar.gz: the log, the service's log and, once
# the run ends, its result file (benchmarks/results/quality-smollm2-135m-instruct-gpu-<date>.json) to commit here.
set -uo pipefail
stage="${1:-start}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT="${OUT:-/tmp/out}"
RUN=/root/lp/quality
source "$(dirname "$0")/gpu_smollm2.sh"

case $stage in
  start)
    test -d /root/lp/svcsite || { echo "the service's wheels are gone: run gpu_issue6.sh store-service again"; exit 3; }
    join_model
    rm -rf "$RUN" && mkdir -p "$RUN/results" && cp -r . "$RUN/repo"  # the call's tree goes with the call
    (cd "$RUN/repo" && LORAPLANE_BENCH_RESULTS="$RUN/results" PYTHONPATH=/root/lp/pkg:/root/lp/svcsite:/root/lp/site:. \
      setsid nohup timeout "${QUALITY_LIMIT_S:-6000}" python -m benchmarks.quality.run --model smollm2-135m-instruct \
      ${QUALITY_ARGS:-} > "$RUN/quality.log" 2>&1 < /dev/null &)
    sleep 5
    exec bash "$0" wait "${2:-300}" ;;  # joining the model and starting take ~2 min of the call
  calibrate)
    test -d /root/lp/svcsite || { echo "the service's wheels are gone: run gpu_issue6.sh store-service again"; exit 3; }
    join_model
    rm -rf "$RUN" && mkdir -p "$RUN/results" "$RUN/calibration" && cp -r . "$RUN/repo"
    (cd "$RUN/repo" && PYTHONPATH=/root/lp/pkg:/root/lp/svcsite:/root/lp/site:. setsid nohup timeout \
      "${QUALITY_LIMIT_S:-6000}" bash benchmarks/gpu_issue33.sh chain > "$RUN/quality.log" 2>&1 < /dev/null &)
    sleep 5
    exec bash "$0" wait "${2:-300}" ;;
  chain)  # calibrate's background part: the candidates at seed 100 (no reported cell's seed), then the picked tasks
    candidates=$(python -c "from benchmarks.quality.tasks import CANDIDATES as C
print(' '.join(n for names in C.values() if len(names) > 1 for n in names))")
    LORAPLANE_BENCH_RESULTS="$RUN/calibration" python -m benchmarks.quality.run --model smollm2-135m-instruct \
      --tasks $candidates --sizes small --seeds 100 --arms default grid-none oracle --test-rows 128 ${GRID_ARGS:-} \
      || exit 6
    picked=$(python -m benchmarks.quality.calibrate "$RUN"/calibration/quality-*.json | tee /dev/stderr | tail -1)
    LORAPLANE_BENCH_RESULTS="$RUN/results" python -m benchmarks.quality.run --model smollm2-135m-instruct \
      --tasks $picked ${GRID_ARGS:-} ${QUALITY_ARGS:-} ;;
  wait)
    running() { pgrep -f "[b]enchmarks.quality.run|[g]pu_issue33.sh chain" >/dev/null; }
    deadline=$(( $(date +%s) + ${2:-540} ))
    while running && [ "$(date +%s)" -lt "$deadline" ]; do sleep 15; done
    tail -30 "$RUN/quality.log"
    running && echo "still running" || echo "all done"
    cp /tmp/loraplane-quality-*/service.log "$RUN/" 2>/dev/null
    tar czf "$OUT/quality.tar.gz" -C "$RUN" results quality.log \
      $(cd "$RUN" && ls -d calibration service.log 2>/dev/null) ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
