"""The training engine: a pack of LoRA trials on one frozen base model.

Imports only the standard library, torch, transformers, tokenizers and safetensors, so it runs as it is on
the GPU image (torch 2.11, transformers 5.17), which has none of the service's stack.

Typical use by a worker::

    model, tokenizer = load_base_model(source, cache_dir=cache, device=torch.device("cuda"))
    outcomes = train_pack(model, tokenizer, trials, base_model_name=source.name,
                          export_dir=out, on_point=publish, should_stop=poll_evictions)
"""

from worker.engine.export import adapter_logits, export_peft_adapter, read_peft_adapter
from worker.engine.lora import restore_base_model
from worker.engine.models import ModelSource, load_base_model
from worker.engine.schedule import lr_at
from worker.engine.spec import TrialOutcome, TrialSpec
from worker.engine.trainer import train_pack

__all__ = [
    "ModelSource",
    "TrialOutcome",
    "TrialSpec",
    "adapter_logits",
    "export_peft_adapter",
    "load_base_model",
    "lr_at",
    "read_peft_adapter",
    "restore_base_model",
    "train_pack",
]
