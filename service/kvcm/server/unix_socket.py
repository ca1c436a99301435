"""The Unix sockets the service listens on (``--uds``, ``--step-socket``).

A socket file is a name in a folder that outlives its process: a service that died leaves
one behind, and two services given the same path would fight over it. So: a socket file
nobody accepts on is stale and replaced; a live one, or a path that is not a socket, is
refused (not ours to take over or delete); and at exit a service removes only the file it
made, checked by identity (device, inode), since another service may have replaced it.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class OwnSocket:
    """A Unix socket file this process created: its path and identity (device, inode)."""

    path: Path
    ident: tuple[int, int]

    @classmethod
    def of(cls, path: Path) -> OwnSocket:
        st = path.lstat()
        return cls(path, (st.st_dev, st.st_ino))

    def remove(self) -> None:
        """Remove the socket file if the file at the path is still the one this process
        created: one that replaced it (ours removed, another service bound the path, or
        something else put there) is not ours to delete."""
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self.ident:
            self.path.unlink(missing_ok=True)


def clear_stale(path: Path, flag: str) -> None:
    """Remove a socket file at ``path`` that nobody accepts on; ``FileExistsError`` naming
    ``flag`` for a live one (a listener that does not answer in time is still a listener)
    or a path that is not a socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(
            f"{flag} {path}: exists and is not a socket (remove it, or choose another path)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # stale: left behind by a process that is gone
        return
    except PermissionError:
        raise FileExistsError(
            f"{flag} {path}: a socket this user may not open (another user's? choose another path)"
        ) from None
    except OSError:
        pass  # a listener that does not answer in time (stopped? busy?) is still a listener
    finally:
        probe.close()
    raise FileExistsError(
        f"{flag} {path}: another process serves on it (another kvcm? stop it, or choose "
        "another path)"
    )


def bind(path: Path, flag: str) -> tuple[socket.socket, OwnSocket]:
    """A Unix socket bound at ``path`` (a stale file replaced first), mode 0660, not yet
    listening, and the file it made."""
    clear_stale(path, flag)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # rw for owner and group only
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock, OwnSocket.of(path)
