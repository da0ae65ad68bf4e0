"""What besides its prompt's token ids decides the KV of a vLLM request: its cache salt, its
LoRA adapter and the identifiers of its multimodal inputs. Offloaded blocks are keyed by them
(:mod:`~tiersync.integrations.vllm.scheduler`), and a prefill -> decode handoff loads a prefill's
KV only when both requests agree on them (:mod:`~tiersync.integrations.vllm.pd_scheduler`)."""

from __future__ import annotations

from typing import Any

__all__ = ["request_extras"]


def request_extras(request: Any) -> list[str]:
    """The cache salt, the LoRA adapter's name and each multimodal input's identifier of
    ``request`` (those it has, in that order)."""
    extras = [
        x
        for x in (
            getattr(request, "cache_salt", None),
            getattr(getattr(request, "lora_request", None), "lora_name", None),
        )
        if x
    ]
    return extras + [str(f.identifier) for f in (getattr(request, "mm_features", None) or ())]
