"""Build the optional native copy kernel; tiersync falls back to pure Python without it."""
import os
from setuptools import Extension, setup

ext = Extension(
    "tiersync.transfer._kernel",
    sources=["src/tiersync/transfer/_kernel.c"],
    extra_compile_args=["-O3", "-std=c11"],
    optional=os.environ.get("TIERSYNC_REQUIRE_NATIVE") != "1",
)
setup(ext_modules=[ext])
