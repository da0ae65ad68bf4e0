"""Prefix keys: chaining, identity namespacing, stability across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tiersync.errors import UsageError
from tiersync.store.keys import CacheIdentity, block_keys

ID = CacheIdentity("llama-3-8b", "step-100", "bf16", 16, b"\x01" * 16, rank=0)


def test_full_blocks_only_and_prefix_sharing():
    a = block_keys(list(range(40)), ID)
    assert len(a) == 2 and all(len(k) == 16 for k in a)
    b = block_keys(list(range(32)) + [999] * 16, ID)
    assert b[0] == a[0] and b[1] == a[1] and len(b) == 3
    c = block_keys([7] + list(range(1, 32)), ID)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key


def test_parent_continues_the_chain():
    whole = block_keys(list(range(64)), ID)
    tail = block_keys(list(range(32, 64)), ID, parent=whole[1])
    assert tail == whole[2:]


def test_identity_fields_give_disjoint_keys():
    toks = list(range(64))
    base = set(block_keys(toks, ID))
    for other in (
        CacheIdentity("llama-3-8b", "step-101", "bf16", 16, b"\x01" * 16),
        CacheIdentity("llama-3-8b", "step-100", "fp8", 16, b"\x01" * 16),
        CacheIdentity("llama-3-8b", "step-100", "bf16", 16, b"\x02" * 16),
        CacheIdentity("llama-3-8b", "step-100", "bf16", 16, b"\x01" * 16, rank=1),
        CacheIdentity("llama-3-70b", "step-100", "bf16", 16, b"\x01" * 16),
    ):
        assert base.isdisjoint(block_keys(toks, other)), other
    assert (
        len(ID.digest()) == 16
        and ID.digest() == CacheIdentity(*["llama-3-8b", "step-100", "bf16"], 16, b"\x01" * 16).digest()
    )


def test_extra_keys_and_wide_token_ids():
    toks = list(range(16))
    plain = block_keys(toks, ID)
    assert block_keys(toks, ID, extra_keys=("lora-7",)) != plain
    assert block_keys(toks, ID, extra_keys=(b"mm-hash",)) != block_keys(toks, ID, extra_keys=("mm-hash",))
    assert block_keys(toks, ID, extra_keys=(1, 2)) != block_keys(toks, ID, extra_keys=(12,))
    wide = block_keys([2**40] + toks[1:], ID)
    assert wide != plain and len(wide) == 1
    assert block_keys(np.arange(16, dtype=np.int64), ID) == block_keys(np.arange(16, dtype=np.int32), ID) == plain


@pytest.mark.parametrize(
    "bad, arg",
    [
        (dict(token_ids=[[1, 2]]), "token_ids"),
        (dict(token_ids=["a"]), "token_ids"),
        (dict(token_ids=[1], extra_keys="lora"), "extra_keys"),
        (dict(token_ids=[1], extra_keys=(1.5,)), "extra_keys[0]"),
        (dict(token_ids=[1], parent=b"short"), "parent"),
    ],
)
def test_bad_arguments_are_named(bad, arg):
    with pytest.raises(UsageError) as ei:
        block_keys(identity=ID, **bad)
    assert ei.value.argument == arg


def test_identity_validation():
    with pytest.raises(UsageError, match=r"CacheIdentity.block_size"):
        CacheIdentity("m", "v", "bf16", 0)
    with pytest.raises(UsageError, match=r"CacheIdentity.weights_version"):
        CacheIdentity("m", "", "bf16", 16)
    for bad in ("fp16x", "auto/torch.float33", "bf16/"):
        with pytest.raises(UsageError, match=r"CacheIdentity.kv_dtype") as ei:
            CacheIdentity("m", "v", bad, 16)
        assert ei.value.argument == "CacheIdentity.kv_dtype"
    for good in ("auto/torch.float32", "fp8_e4m3/torch.bfloat16", "float16", "uint8"):
        assert CacheIdentity("m", "v", good, 16).kv_dtype == good


def test_stable_across_processes_and_hash_seeds():
    code = (
        "from tiersync.store.keys import CacheIdentity, block_keys;"
        "i=CacheIdentity('m','v1','bf16',4,b'\\x07'*16);"
        "print(','.join(k.hex() for k in block_keys(list(range(37)), i, extra_keys=('lora', 3))))"
    )
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60
            ).stdout.strip()
        )
    local = ",".join(
        k.hex()
        for k in block_keys(list(range(37)), CacheIdentity("m", "v1", "bf16", 4, b"\x07" * 16), extra_keys=("lora", 3))
    )
    assert outs[0] == outs[1] == local and len(local.split(",")) == 9
