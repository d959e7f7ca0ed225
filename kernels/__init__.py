"""LoRA ops for many adapters at once, routed by token segments. Imports only torch (and Triton, lazily).

- ``build_segments`` (host, once per step) -> ``SegmentMeta``, read by every layer of that forward
  (``build_slot_segments``: one segment per slot, the same shapes whichever slots have tokens);
- ``lora_delta`` — the grouped shrink/expand of one layer (its docstring is the forward/backward contract);
- ``lora_linear`` — the frozen layer plus ``lora_delta`` as one op: Triton kernels on CUDA
  (``kernels.triton_lora``, the expand inside the base GEMM), the torch path elsewhere; ``set_backend``;
- ``DropoutKeys`` / ``LayerDropout`` / ``mix32`` / ``keep_threshold`` — counter-based dropout masks, no RNG state;
- ``reference.lora_delta_loop`` — the per-segment loop the tests compare against.
"""

from kernels.dropout import DropoutKeys, LayerDropout, keep_threshold, mix32
from kernels.lora_delta import lora_delta
from kernels.lora_linear import get_backend, lora_linear, set_backend
from kernels.segments import SegmentMeta, build_segments, build_slot_segments

__all__ = [
    "DropoutKeys",
    "LayerDropout",
    "SegmentMeta",
    "build_segments",
    "build_slot_segments",
    "keep_threshold",
    "get_backend",
    "lora_delta",
    "lora_linear",
    "mix32",
    "set_backend",
]
