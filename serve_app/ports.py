"""NIXL side-channel ports that no other process can take between our check and vLLM's bind.

Every engine listens for NIXL handshakes on its own TCP port, bound by vLLM inside the EngineCore
process seconds after the replica chose the number. A port picked "free" from the ephemeral range
and released again can be taken in between by any outgoing connection; vLLM's listener thread
then dies (`ZMQError: Address already in use`) and the engine waits forever for it. So:

* ports come from a range the app owns (`engine.side_channel_ports`, by default outside Linux's
  ephemeral range 32768-60999, which the kernel hands to outgoing sockets);
* a replica claims a port by holding an exclusive `flock` on a per-port lock file for as long as
  it lives (released by the kernel when the process dies, however it dies), so two replicas on
  one host never claim the same port, and
* it checks that nothing else is listening there (an orphaned engine of an earlier run may be).

Only the replica process holds the lock; vLLM's engine processes do not inherit it (Python opens
files non-inheritable), so a replica that dies frees its ports even if its engines linger.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("ray.serve")

DEFAULT_RANGE = (27000, 27999)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


class NoFreePort(RuntimeError):
    pass


@dataclass
class PortClaim:
    """A side-channel port this process holds until `release()` (or until it exits)."""

    host: str
    port: int
    _fd: int | None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


def lock_dir() -> Path:
    d = Path(os.environ.get("DISAGG_PORT_LOCK_DIR") or Path(tempfile.gettempdir()) / "disagg-ports")
    d.mkdir(parents=True, exist_ok=True)
    return d


def ephemeral_range() -> tuple[int, int] | None:
    try:
        lo, hi = Path(EPHEMERAL_RANGE_FILE).read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return None


def _listening(host: str, port: int) -> bool:
    """Is `port` unavailable to a listener on `host`? (bind without SO_REUSEADDR, as a probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def claim_port(host: str, port_range: tuple[int, int] = DEFAULT_RANGE, *,
               rng: random.Random | None = None) -> PortClaim:
    """Claim a free port of `port_range` (inclusive) on `host` for this process's lifetime.

    Ports are tried from a random start so replicas starting together rarely contend; raises
    NoFreePort naming the range when every port is claimed or in use.
    """
    lo, hi = port_range
    eph = ephemeral_range()
    if eph and lo <= eph[1] and eph[0] <= hi:
        logger.warning("side-channel ports %d-%d overlap this host's ephemeral range %d-%d: an outgoing "
                       "connection may take a port between the claim and the engine's bind", lo, hi, *eph)
    ports = list(range(lo, hi + 1))
    start = (rng or random.Random()).randrange(len(ports))
    directory = lock_dir()
    busy = 0
    for port in ports[start:] + ports[:start]:
        fd = os.open(directory / f"{host}-{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another replica of this host holds it
            os.close(fd)
            continue
        if _listening(host, port):  # e.g. an orphaned engine of an earlier run
            busy += 1
            os.close(fd)
            continue
        return PortClaim(host, port, fd)
    raise NoFreePort(f"no free NIXL side-channel port in {lo}-{hi} on {host} ({busy} in use by other "
                     f"processes, the rest claimed by other replicas): widen engine.side_channel_ports")
