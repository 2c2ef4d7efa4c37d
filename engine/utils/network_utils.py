"""Addresses and ports for the processes of one engine.

vLLM twin: ``vllm/utils/network_utils.py`` (``get_ip``, ``get_open_port``,
``get_distributed_init_method``, ``get_loopback_ip``). Read it for where the
ranks meet: ``torch.distributed`` rendezvous at ``tcp://ip:port`` on the
driver's machine. Sessions: 07.

``remove_ipc_socket_file`` has no twin: libzmq leaves the file of a socket
bound to an ``ipc://`` path behind when the socket closes, so whoever binds
one removes it (vLLM leaves them in its RPC folder).

Simpler than vLLM: IPv4 only, no ``VLLM_HOST_IP`` / ``VLLM_PORT`` ranges
(``GLASSBOX_HOST_IP`` overrides the detected address).
"""

from __future__ import annotations

import contextlib
import os
import socket


def get_loopback_ip() -> str:
    return "127.0.0.1"


def get_ip() -> str:
    """This machine's address as other machines see it: ``GLASSBOX_HOST_IP``,
    else the interface a UDP socket would route outward through (nothing is
    sent), else loopback."""
    host_ip = os.environ.get("GLASSBOX_HOST_IP")
    if host_ip:
        return host_ip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
            return s.getsockname()[0]
        except OSError:
            return get_loopback_ip()


def get_open_port() -> int:
    """A TCP port free right now (the OS picks it; a race with another
    process binding it first is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def get_distributed_init_method(ip: str, port: int) -> str:
    return f"tcp://{ip}:{port}"


def remove_ipc_socket_file(address: str | None) -> None:
    """Remove the file behind an ``ipc://`` address this process bound (no-op
    for other transports and for a file already gone). Connected peers keep
    their connections; only new connects would fail."""
    if address is None or not address.startswith("ipc://"):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address.removeprefix("ipc://"))
