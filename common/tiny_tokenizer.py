"""The tiny random model's tokenizer: its one definition, for the worker that trains with it and the API that counts
its tokens (common/token_lengths.py). `tokenizers` only: the API may build it without transformers.

Byte level: token id ``b`` is byte ``b`` (0..255), then the pad, im_start and im_end (eos) tokens. No merges, so
every byte is one token and any text round-trips exactly. The worker's shell hands it to the engine
(worker/engine/base_model.py `TokenizerRecipe`), which wraps it as a transformers tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TINY_PAD, TINY_IM_START, TINY_IM_END = "<|pad|>", "<|im_start|>", "<|im_end|>"
# ChatML, as SmolLM2-Instruct uses, minus its default system prompt.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyTokenizer:
    """What the engine needs to build the tiny model's tokenizer (its `TokenizerRecipe`): the special tokens, the
    chat template and the backend. Frozen and compared by value, so a model source that carries it stays a key."""

    pad_token: str = TINY_PAD
    eos_token: str = TINY_IM_END
    chat_template: str = TINY_CHAT_TEMPLATE

    def build(self) -> Tokenizer:
        byte_chars = bytes_to_unicode()
        tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        # use_regex=False: no word splitting is needed when there are no merges to apply within words.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([TINY_PAD, TINY_IM_START, TINY_IM_END])
        return tok


TINY_TOKENIZER = TinyTokenizer()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map, the alphabet of ``ByteLevel``."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
