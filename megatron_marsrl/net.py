"""Local networking shared by the trainer (process-group rendezvous) and the rollout (SGLang
servers). Standard library only, so either side may import it."""
from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (the OS picks it; another process may still take
    it before the caller binds, which a local rendezvous or server start accepts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Only connections from this machine can reach ``host`` (a name other than localhost counts as open)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """``host`` binds every interface (0.0.0.0, ::): reached locally, announced to others under
    the address they route to."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def route_address(toward: str) -> str:
    """This machine's address on the route to ``toward`` (a host name or IP), as the other side
    sees it; 127.0.0.1 toward a loopback address. No packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(toward), 9))
        return s.getsockname()[0]
