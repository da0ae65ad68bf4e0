"""Shared helpers for the networking tests (loopback only)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
