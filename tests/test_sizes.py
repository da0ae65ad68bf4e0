"""parse_size: the one size parser (flags, extra configs, config files)."""

from __future__ import annotations

import pytest

from tiersync.errors import UsageError
from tiersync.sizes import parse_size


def test_units_decimal_and_binary():
    assert parse_size("8GiB") == 8 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("4096") == 4096
    assert parse_size(" 2 kb ") == 2000 and parse_size("1TB") == 10**12


@pytest.mark.parametrize("bad", ["lots", "0", "-1GiB", "1.5GiB", "8 parsecs", ""])
def test_malformed_names_the_argument(bad):
    with pytest.raises(UsageError) as ei:
        parse_size(bad, argument="--capacity")
    assert ei.value.argument == "--capacity"
