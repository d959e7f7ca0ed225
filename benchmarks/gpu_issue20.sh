#!/usr/bin/env bash
# Issue 20's measurements on the device (benchmarks/multi_gpu.py). The device image has torch, transformers and
# triton; the benchmark needs nothing else of the service (the engine imports common/ from the repository copy).
#
#   device (one GPU):   LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue20.sh one     # the sharding machinery on one GPU, N = 1
#   device (2 GPUs):    LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue20.sh two     # nvidia-h200-x2: 8B x 16 trials on 2 GPUs vs 1,
#                                                              # and a 70B shape one GPU cannot hold
#   device (2 GPUs):    LORAPLANE_COMMIT=<HEAD> bash benchmarks/gpu_issue20.sh pool    # the worker's own path (worker/rank_pool.py,
#                                                              # benchmarks/rank_pool.py): carry [".whl", ".whlsvc"]
# The pool stage imports the service (Celery, Redis's client, pydantic-settings, ...), which the image lacks: its
# wheels travel as .whlsvc (`bash benchmarks/gpu_issue6.sh prepare-service` here).
# Carry .whl with Liger-Kernel's wheel (benchmarks/gpu_setup.sh) so that both sides run the base fused, as the
# service does on CUDA; the one-GPU run of 2026-11-24 had none (both sides unfused).
# Results come back in $OUT (the JSON files written to benchmarks/results/); copy them there here and commit.
set -uo pipefail
stage="${1:-one}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LORAPLANE_BENCH_DIR=/root/lp/models
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /root/lp/models
source benchmarks/gpu_setup.sh
run() {
    python -m torch.distributed.run --standalone --nproc_per_node="$1" -m benchmarks.multi_gpu "${@:2}"
    cp benchmarks/results/multi_gpu-* "$OUT"/ 2>/dev/null
}
case $stage in
  one)
    run 1 --shape llama-3.2-1b --trials 16 --seq-len 512 --warmup 5 --steps 10
    run 1 --shape llama-3.1-8b --trials 8 --seq-len 512 --warmup 3 --steps 6 ;;
  two)
    run 2 --shape llama-3.1-8b --trials 16 --seq-len 512 --steps 10
    # Llama-3.1-70B's layer shape (hidden 8192, 80 layers); 48 layers are ~84 GB of bf16 weights: more than an
    # H200 holds beside a pack's activations, half of it per GPU when sharded.
    run 2 --shape llama-3.1-70b --layers 48 --trials 8 --seq-len 512 --steps 4 --no-single ;;
  pool)
    test -d /root/lp/svcsite || python -m pip install -q --no-index --no-deps --no-compile --target /root/lp/svcsite \
      .whlsvc/*.whl || exit 5
    export PYTHONPATH=/root/lp/svcsite:${PYTHONPATH:-}
    # DEVICES=cuda:0 SHAPE=llama-3.2-1b: the one-device path alone, on one GPU (a check of the set-up);
    # POOL_ARGS=--engine: the engine alone beside it (what the worker's loop adds).
    python -m benchmarks.rank_pool --devices "${DEVICES:-cuda:0,cuda:1}" --shape "${SHAPE:-llama-3.1-8b}" \
      --trials 16 --seq-len 512 --steps 30 ${POOL_ARGS:-}
    cp benchmarks/results/rank_pool-* "$OUT"/ 2>/dev/null ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
echo "all done"
