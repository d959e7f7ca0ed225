#!/usr/bin/env bash
# Issue 36's DPO benchmark (benchmarks/dpo.py) on one GPU, in a background run: the engine's pack of 16 DPO trials
# against TRL's DPOTrainer + PEFT one configuration at a time. TRL and what it needs beyond the image travel as wheels:
#   here:    P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#              --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64"
#            .venv/bin/pip download $P -d .whl liger-kernel==0.8.5 torchao==0.18.0 gguf==0.19.0
#            .venv/bin/pip download $P -d .whltrl trl==1.16.0 datasets==5.2.0 accelerate==1.15.0 dill multiprocess \
#              xxhash fsspec pandas
#            .venv/bin/pip download $P -d /tmp pyarrow==26.0.1   # 53 MB: in two halves, a call each (64 MiB a call)
#            split -b 30000000 /tmp/pyarrow-*.whl /tmp/pa.part; mkdir -p .whlpa .whlpb
#            mv /tmp/pa.partaa .whlpa/; mv /tmp/pa.partab .whlpb/
#   device:  bash benchmarks/gpu_issue36.sh half                         # carry [".whlpa"]
#            LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue36.sh start  # carry [".whl", ".whltrl", ".whlpb"]
#            bash benchmarks/gpu_issue36.sh wait 500                       # until it says "=== done"
# Results and the log come back in $OUT/i36.tar.gz. DPO_ARGS overrides benchmarks/dpo.py's arguments.
set -uo pipefail
stage="${1:-start}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=0
OUT="${OUT:-/tmp/out}"
LOGS=/root/lp/i36
SITE=/root/lp/i36site
mkdir -p "$OUT" "$LOGS" "$SITE"

collect() {
  tar -czf "$OUT/i36.tar.gz" -C /root/lp i36 2>/dev/null
}

case $stage in
  half)  # the first half of pyarrow's wheel, kept for `start`
    python -c "import pyarrow" 2>/dev/null && echo "the image has pyarrow"
    cp .whlpa/pa.partaa /root/lp/ && ls -la /root/lp/pa.partaa ;;
  start)
    rm -f "$LOGS"/*.log
    setsid nohup bash "$0" run > "$LOGS/driver.log" 2>&1 < /dev/null &
    sleep 5
    exec bash "$0" wait "${2:-500}" ;;
  wait)
    deadline=$(( $(date +%s) + ${2:-500} ))
    while ! grep -q "^=== done" "$LOGS/driver.log" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 10
    done
    tail -40 "$LOGS/driver.log"
    collect ;;
  run)
    source benchmarks/gpu_setup.sh
    if ! python -c "import pyarrow" 2>/dev/null; then
      cat /root/lp/pa.partaa .whlpb/pa.partab > /root/lp/pyarrow-26.0.1-cp312-cp312-manylinux_2_28_x86_64.whl
      python -m pip install -q --no-index --no-deps --no-compile --target "$SITE" /root/lp/pyarrow-*.whl
    fi
    for w in .whl/torchao-*.whl .whl/gguf-*.whl .whltrl/*.whl; do
      name=$(basename "$w" | cut -d- -f1)
      [ "$name" = pandas ] && python -c "import pandas" 2>/dev/null && continue  # the image's own build, where it has one
      python -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w"
    done
    export PYTHONPATH="$SITE:${PYTHONPATH:-}"
    python -c "import trl, datasets, pyarrow, pandas, accelerate; print('trl', trl.__version__, 'datasets',
datasets.__version__, 'pyarrow', pyarrow.__version__)" || { echo "=== done (missing a dependency)"; exit 1; }
    mkdir -p "$LOGS/results"
    LORAPLANE_BENCH_RESULTS="$LOGS/results" timeout 1500 python -u -m benchmarks.dpo \
      ${DPO_ARGS:---shape llama-3.2-1b --steps 20} > "$LOGS/dpo.log" 2>&1
    echo "dpo exit $?"; grep -v "examples/s\]" "$LOGS/dpo.log" | tail -15
    echo "=== done" ;;
esac
