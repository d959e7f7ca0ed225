"""Registers, spills and shared memory of the Triton LoRA kernels on Hopper, without a GPU.

    python -m benchmarks.triton_resources

Compiles ``kernels.triton_lora``'s LoRA-term kernel for every autotuning configuration (forward, backward,
with and without dropout) and the outer-product kernel for sm_90a on this machine, with the specialisations a
real launch gets (16-aligned pointers and sizes, unit strides), and reads ``ptxas -v``. A configuration that
spills or makes ptxas serialise its wgmma instructions (C7512) is slow on the GPU: check here before spending
device time.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even where the tests set the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.triton_lora as T  # noqa: E402
from benchmarks.common import print_table  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
UNALIGNED = ("Z",)  # slots are any number; the rest is 16-aligned in practice


def ptxas() -> Path:
    """A ptxas from Triton's wheel that reads the PTX version this Triton writes (the newest one there)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    found = sorted(bin_dir.glob("ptxas*"), key=lambda p: len(p.name), reverse=True)
    if not found:
        raise SystemExit(f"no ptxas under {bin_dir}")
    return found[0]


def resources(jit: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int) -> list[Any]:
    names = jit.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in constexprs and n not in UNALIGNED}
    src = ASTSource(
        fn=jit, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    kernel = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        report = subprocess.run(
            [str(ptxas()), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return [
        int(regs.group(1)) if regs else "?",
        int(spills.group(1)) if spills else "?",
        kernel.metadata.shared,
        "yes" if "C7512" in report else "no",
    ]


def main() -> None:
    dtype = "bf16"
    ptrs = ("x_ptr", "w1_ptr", "w2_ptr", "s_ptr", "c_ptr", "bias_ptr")
    term_types = dict.fromkeys(ptrs, f"*{dtype}") | {
        "scale_ptr": "*fp32", "blk_slot_ptr": "*i32", "blk_start_ptr": "*i32", "blk_end_ptr": "*i32",
        "tok_key_ptr": "*i64", "thr_ptr": "*i64", "inv_ptr": "*fp32", "feat_in_ptr": "*i64", "feat_out_ptr": "*i64"}
    directions = {  # unit strides of a real launch (store rank-major: A contiguous along d_in, B along d_out)
        "forward": dict(stride_xk=1, stride_1k=1, stride_2n=1, stride_sr=1, stride_cn=1),
        "backward": dict(stride_xk=1, stride_1k=1, stride_2n=1, stride_sr=1, stride_cn=1),
    }
    rows = []
    for config in T._TERM_CONFIGS[:-1]:  # the last one is the interpreter's
        for direction, strides in directions.items():
            for dropout in (False, True):
                constexprs = dict(strides, DROPOUT_IN=dropout and direction == "forward",
                                  DROPOUT_OUT=dropout and direction == "backward", HAS_BIAS=False, PRECISION="tf32",
                                  BLOCK_M=T.BLOCK_TOKENS, BLOCK_R=64, **config.kwargs)  # fmt: skip
                tile = f"{T.BLOCK_TOKENS}x{config.kwargs['BLOCK_N']}x{config.kwargs['BLOCK_K']}"
                rows.append(["_lora_term_kernel", tile, config.num_warps, config.num_stages,
                             direction + (" + dropout" if dropout else ""),
                             *resources(T._lora_term_kernel.fn, term_types, constexprs, config.num_warps,
                                        config.num_stages)])  # fmt: skip
    outer_types = {"u_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "g_ptr": f"*{dtype}", "part_ptr": "*fp32",
                   "scale_ptr": "*fp32", "slot_blocks_ptr": "*i32", "blk_start_ptr": "*i32", "blk_end_ptr": "*i32",
                   "tok_key_ptr": "*i64", "thr_ptr": "*i64", "inv_ptr": "*fp32", "feat_ptr": "*i64"}  # fmt: skip
    for block_i, block_j in ((128, 64), (64, 128)):  # dA (d_in x r) and dB (r x d_out) tiles at r_max 64
        for dropout in (False, True):
            constexprs = dict(stride_ui=1, stride_vj=1, HAS_DROPOUT=dropout, PRECISION="tf32", SPLIT=1,
                              BLOCK_M=T.BLOCK_TOKENS, BLOCK_I=block_i, BLOCK_J=block_j)  # fmt: skip
            rows.append(["_outer_kernel", f"{T.BLOCK_TOKENS}x{block_i}x{block_j}", 8, 3,
                         "dropout" if dropout else "-",
                         *resources(T._outer_kernel, outer_types, constexprs, 8, 3)])  # fmt: skip
    print(f"sm_90a, {dtype}, r_max 64, ptxas {ptxas().name}")
    print_table(["kernel", "tile MxNxK", "warps", "stages", "variant", "registers", "spill bytes", "shared bytes",
                 "wgmma serialised"], rows)  # fmt: skip


if __name__ == "__main__":
    main()
