"""LoRA ops for many adapters at once, routed by token segments. Imports only torch.

- ``build_segments`` (host, once per step) -> ``SegmentMeta``, read by every layer of that forward;
- ``lora_delta`` — the grouped shrink/expand of one layer (its docstring is the forward/backward contract);
- ``DropoutKeys`` / ``LayerDropout`` / ``mix32`` / ``keep_threshold`` — counter-based dropout masks, no RNG state;
- ``reference.lora_delta_loop`` — the per-segment loop the tests compare against.
"""

from kernels.dropout import DropoutKeys, LayerDropout, keep_threshold, mix32
from kernels.lora_delta import lora_delta
from kernels.segments import SegmentMeta, build_segments

__all__ = [
    "DropoutKeys",
    "LayerDropout",
    "SegmentMeta",
    "build_segments",
    "keep_threshold",
    "lora_delta",
    "mix32",
]
