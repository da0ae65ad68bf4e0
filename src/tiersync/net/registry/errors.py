"""Registry errors (RemoteError subclasses)."""

from __future__ import annotations

from tiersync.errors import RemoteError


class RegistryUnavailableError(RemoteError):
    """The registry backend or service could not be reached (``peer`` names it)."""
