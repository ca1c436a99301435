"""What the command lines share (``kvcm`` and ``kvcm router``): the error a person fixes
from its message, binding a TCP port with such an error, and plain-text tables.

Below both ``kvcm.cli`` and ``kvcm.router.cli`` (which ``kvcm.cli`` composes), so neither
imports the other's internals.
"""

from __future__ import annotations

import errno
import socket


class CommandError(Exception):
    """A failure a person fixes from its message alone (a busy port, a missing folder): ``main``
    prints it as one line, ``kvcm: <message>``, exit status 2, without a traceback. The message
    names what failed (the flag, the address or path) and, where there is one, the way out."""


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen_error(host: str, port: int, exc: OSError, port_flag: str, host_flag: str) -> str:
    """Why ``host:port`` cannot be bound, for people: the OS says only "Address already in
    use", not which address, nor which flag picks another."""
    if exc.errno == errno.EADDRINUSE:
        why = f"address already in use (another kvcm? choose another {port_flag})"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine (check {host_flag})"
    elif exc.errno == errno.EACCES and 0 < port < 1024:
        why = f"permission denied: ports below 1024 need privileges (choose another {port_flag})"
    elif isinstance(exc, socket.gaierror):
        why = f"cannot resolve {host}: {exc.strerror} (check {host_flag})"
    else:
        why = (exc.strerror or str(exc)).lower()
    return f"cannot listen on {_where(host, port)}: {why}"


def bind_tcp(
    host: str, port: int, port_flag: str = "--port", host_flag: str = "--host"
) -> tuple[socket.socket, str]:
    """A TCP socket bound to ``host:port`` and its URL; a ``CommandError`` naming the address
    and the flags (``port_flag``, ``host_flag``) where it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CommandError(_listen_error(host, port, exc, port_flag, host_flag)) from None
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    return sock, f"http://{shown}:{bound_port}"


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
