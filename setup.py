"""Build the optional native extensions; tiersync falls back to pure Python without them.

``tiersync.transfer._kernel``: span copier and tsum64. ``tiersync.net._wire``: the TCP
transport's receive fast path (one DATA frame received and verified per call, GIL released).
"""

import os

from setuptools import Extension, setup

_OPTIONAL = os.environ.get("TIERSYNC_REQUIRE_NATIVE") != "1"
kernel = Extension(
    "tiersync.transfer._kernel",
    sources=["src/tiersync/transfer/_kernel.c"],
    depends=["src/tiersync/transfer/tsum64.h"],
    extra_compile_args=["-O3", "-std=c11"],
    optional=_OPTIONAL,
)
wire = Extension(
    "tiersync.net._wire",
    sources=["src/tiersync/net/_wire.c"],
    depends=["src/tiersync/transfer/tsum64.h"],
    extra_compile_args=["-O3", "-std=gnu11"],
    optional=_OPTIONAL,
)
same_host = Extension(
    "tiersync.net._local",
    sources=["src/tiersync/net/_local.c"],
    depends=["src/tiersync/transfer/tsum64.h", "src/tiersync/net/tpool.h"],
    extra_compile_args=["-O3", "-std=gnu11", "-pthread"],
    extra_link_args=["-pthread"],
    optional=_OPTIONAL,
)
setup(ext_modules=[kernel, wire, same_host])
