"""The all-gather a sharded pack makes per layer and pass (issue 37), timed alone: what the GPUs' link gives.

    NCCL_DEBUG=INFO torchrun --nproc_per_node=2 -m benchmarks.collectives --shape llama-3.1-8b

A decoder layer of `--shape` in bf16 is gathered from its N shards (`all_gather_into_tensor`, what FSDP2 calls),
`--repeat` times after a warm-up, and the mean time, the algorithm bandwidth (bytes gathered / time) and NCCL's bus
bandwidth ((N-1)/N of that) are printed, with what a step of the pack then spends on gathers at the least: every
layer twice (forward, and again for the backward). With NCCL_DEBUG=INFO, NCCL's log says which transport it chose
(P2P/NVLink, or shared host memory when the GPUs cannot reach each other). Results:
benchmarks/results/collectives-<shape>-<N>gpu-<device>-<date>.json (rank 0 writes).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from benchmarks.base_models import SHAPES, shape_config
from benchmarks.common import write_result


def layer_elements(shape: str) -> int:
    """The number of weights in one decoder layer of ``shape`` (its projections and its two norms)."""
    config = shape_config(shape, None)
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    return hidden * hidden * 2 + hidden * kv * 2 + hidden * inter * 3 + hidden * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    per_rank = -(-layer_elements(args.shape) // world)
    shard = torch.randn(per_rank, dtype=torch.bfloat16, device=device)
    whole = torch.empty(per_rank * world, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        dist.all_gather_into_tensor(whole, shard)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(args.repeat):
        dist.all_gather_into_tensor(whole, shard)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / args.repeat
    if dist.get_rank() == 0:
        nbytes = whole.numel() * whole.element_size()
        algbw = nbytes / seconds / 1e9
        layers = shape_config(args.shape, None).num_hidden_layers
        write_result(f"collectives-{args.shape}-{world}gpu",
                     ["collective", "MB gathered", "ms", "algbw GB/s", "busbw GB/s", "ms a step (2 per layer)"],
                     [["all_gather_into_tensor", round(nbytes / 1e6), round(seconds * 1e3, 2), round(algbw, 1),
                       round(algbw * (world - 1) / world, 1), round(2 * layers * seconds * 1e3, 1)]],
                     {"shape": args.shape, "repeat": args.repeat, "world": world})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
