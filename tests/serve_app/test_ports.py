"""Side-channel ports: claimed from the app's range, never twice on one host, never one in use."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest

from serve_app.ports import NoFreePort, claim_port


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_PORT_LOCK_DIR", str(tmp_path))
    return tmp_path


def _free_range(n: int) -> tuple[int, int]:
    """n consecutive ports below the ephemeral range that nothing listens on right now."""
    for lo in range(28000, 31000, n):
        ok = True
        for p in range(lo, lo + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return lo, lo + n - 1
    pytest.fail("no free port range on this host")


def test_claims_are_distinct_and_inside_the_range():
    lo, hi = _free_range(3)
    claims = [claim_port("127.0.0.1", (lo, hi), rng=random.Random(0)) for _ in range(3)]
    assert sorted(c.port for c in claims) == [lo, lo + 1, lo + 2]
    with pytest.raises(NoFreePort, match=f"{lo}-{hi}"):
        claim_port("127.0.0.1", (lo, hi))
    next(c for c in claims if c.port == lo + 1).release()
    assert claim_port("127.0.0.1", (lo, hi)).port == lo + 1


def test_a_port_another_process_listens_on_is_skipped():
    lo, hi = _free_range(2)
    with socket.socket() as other:
        other.bind(("127.0.0.1", lo))
        other.listen()
        assert claim_port("127.0.0.1", (lo, hi), rng=random.Random(0)).port == hi
        with pytest.raises(NoFreePort, match="1 in use by other processes"):
            claim_port("127.0.0.1", (lo, hi))


def test_another_process_cannot_claim_a_held_port_and_can_once_the_holder_exits(lock_dir):
    lo, _ = _free_range(1)
    claim = claim_port("127.0.0.1", (lo, lo))
    probe = (f"from serve_app.ports import claim_port, NoFreePort\n"
             f"try:\n    print(claim_port('127.0.0.1', ({lo}, {lo})).port)\n"
             f"except NoFreePort:\n    print('refused')\n")
    env = {"DISAGG_PORT_LOCK_DIR": str(lock_dir), "PATH": ""}
    run = lambda: subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                 timeout=60).stdout.strip()
    assert run() == "refused"
    claim.release()
    assert run() == str(lo)
