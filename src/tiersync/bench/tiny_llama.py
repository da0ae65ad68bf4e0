"""A small Llama checkpoint with random (seeded) weights, written to a directory vLLM loads.

``load_format="dummy"`` weights are near zero, so a model's output hardly depends on its
KV cache and a test comparing outputs could not catch wrong KV. These weights are drawn
normally with std 0.05: enough that greedy outputs do not collapse into a loop, so
every token's KV changes the output.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from tiersync.errors import check_positive_int

__all__ = ["TinyLlama", "write_tiny_llama"]

INIT_STD = 0.05


@dataclass(frozen=True, slots=True)
class TinyLlama:
    """Shape of the model. The defaults are the 512-hidden, 6-layer Llama of issue 5."""

    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1024
    vocab_size: int = 4096
    max_position_embeddings: int = 16384

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check_positive_int(value, f"TinyLlama.{name}")

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """K and V of all layers, ``itemsize`` bytes per element (float32 by default)."""
        return 2 * itemsize * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


def write_tiny_llama(directory: str, shape: TinyLlama = TinyLlama(), seed: int = 0) -> str:
    """Write ``config.json``, ``model.safetensors`` (bf16) and a tokenizer (:func:`_tokenizer`)
    into ``directory``; reuse them when the same shape and seed are already there. Returns
    ``directory``."""
    stamp = json.dumps({"shape": asdict(shape), "seed": seed, "std": INIT_STD, "tokenizer": 1}, sort_keys=True)
    marker = os.path.join(directory, "tiersync-model.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if f.read() == stamp:
                return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(directory, exist_ok=True)
    cfg = LlamaConfig(
        **asdict(shape),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        initializer_range=INIT_STD,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    _tokenizer(directory, shape.vocab_size)
    with open(marker, "w") as f:
        f.write(stamp)
    return directory


def _tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer: token ``i`` is the text ``w<i>`` (0, 1, 2: unk, bos, eos), so a
    server that detokenizes answers ASCII text, every token whole characters."""
    special = [
        {"id": i, "content": f"w{i}", "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for i in range(3)
    ]
    model = {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(vocab_size)}, "unk_token": "w0"}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special, "normalizer": None}
    spec |= {"pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": {"type": "Fuse"}}
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump({**spec, "model": model}, f)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0", "bos_token": "w1", "eos_token": "w2"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "model_max_length": 1 << 20}, f)
