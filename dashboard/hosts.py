"""Who counts as this machine: the addresses the dashboard may serve without a token. Kept apart from the access
rules (dashboard.access, which need FastAPI) so that `agoq dashboard --help`, and every other `agoq` command, reads
its arguments without importing the web stack."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or address to listen on) only accepts connections from this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["LOOPBACK_NAMES", "is_loopback"]
