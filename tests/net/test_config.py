"""tiersync.net.config.parse_address: the one "host:port" parser of every link's config."""

from __future__ import annotations

import pytest

from tiersync.errors import UsageError
from tiersync.net.config import parse_address
from tiersync.weights.config import PublisherConfig, ReceiverConfig


def test_parse_address_takes_host_port_and_refuses_the_rest_naming_the_argument():
    assert parse_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert parse_address("[::1]:0") == ("::1", 0)
    for bad in ("host", ":80", "host:", "host:x", "host:65536", "host:\u00b2", "host:\uff18\uff10", 80):
        with pytest.raises(UsageError) as info:  # "\u00b2" passes str.isdigit, not int()
            parse_address(bad, "publishers")
        assert info.value.argument == "publishers", bad


def test_the_weights_configs_parse_their_addresses_with_it():
    with pytest.raises(UsageError) as info:
        ReceiverConfig(("trainer:\u00b2",))
    assert info.value.argument == "publishers"
    with pytest.raises(UsageError) as info:
        PublisherConfig(listen="0.0.0.0:\u00b2")
    assert info.value.argument == "listen"
