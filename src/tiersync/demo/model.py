"""The demo's model: a tiny random-weight Llama built on the CPU from a bundled config.

Nothing is downloaded: the config ships with the package and the weights are
drawn from a fixed seed. This module also hides the two spellings of the KV
cache argument across transformers releases (``past_key_values`` up to 5.x,
``cache`` in later 5.x) and converts between a ``DynamicCache`` and plain
per-layer ``(k, v)`` tensors of shape ``(batch, kv_heads, seq, head_dim)``.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

CONFIG_FILE = "tiny_llama.json"


def load_config(overrides: dict[str, Any] | None = None) -> LlamaConfig:
    """The bundled tiny Llama config (float32, SDPA attention), with ``overrides`` applied."""
    raw = json.loads(resources.files("tiersync.demo").joinpath(CONFIG_FILE).read_text())
    raw.pop("model_type", None)
    raw.update(overrides or {})
    cfg = LlamaConfig(**raw)
    cfg._attn_implementation = "sdpa"
    return cfg


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the model's KV cache: what a paged pool must hold per token."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: LlamaConfig) -> KVGeometry:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32)

    @property
    def token_nbytes(self) -> int:
        """KV bytes of one token over all layers (k and v)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class TinyModel:
    """A random-weight ``LlamaForCausalLM`` in eval mode that returns last-token logits and KV."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.config = cfg
        self.model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        self.geometry = KVGeometry.of(cfg)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def forward(self, ids: torch.Tensor, cache: Any | None = None) -> tuple[torch.Tensor, Any]:
        """Run ``ids`` (1-d token ids) after ``cache``; return (next-token logits, grown cache)."""
        cache = cache if cache is not None else DynamicCache(config=self.config)
        kwargs = {self._cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        with torch.inference_mode():
            out = self.model(input_ids=ids.view(1, -1), **kwargs)
        grown = getattr(out, "cache", None)
        if grown is None:
            grown = getattr(out, "past_key_values", cache)
        return out.logits[0, -1].clone(), grown

    def cache_from_layers(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """A ``DynamicCache`` holding ``layers[l] = (k, v)``, each (1, kv_heads, seq, head_dim)."""
        cache = DynamicCache(config=self.config)
        for layer, (k, v) in enumerate(layers):
            cache.update(k, v, layer)
        return cache


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of a DynamicCache, (batch, kv_heads, seq, head_dim) each."""
    if hasattr(cache, "layers"):  # transformers >= 4.56: a list of DynamicLayer
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[layer], cache.value_cache[layer]) for layer in range(len(cache.key_cache))]
