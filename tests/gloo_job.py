"""Real gloo jobs for the multi-rank tests: one process per rank (tests/gloo_peer.py), started
together and waited on with a hard limit, so a hang fails the test instead of stalling the
suite."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEER = Path(__file__).with_name("gloo_peer.py")
PROCESS_LIMIT_S = 120  # generous for importing torch on a loaded CI host; only a hang reaches it
TIMEOUT_MARGIN_S = 3.0


def peer_environment() -> dict[str, str]:
    """This checkout first on the path; loopback for gloo, which otherwise resolves the host
    name (unreliable in containers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank killed for hanging shows its stacks
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


class GlooJob:
    """The rank processes of one job; leaving the ``with`` block kills any still running.

    Rendezvous gets a long timeout of its own: on a busy host one rank may import torch
    seconds after the other, which must not count against the collectives' ``timeout_s``.
    """

    def __init__(self, tmp_path: Path, *, tp_size: int = 1, dp_size: int = 1,
                 timeout_s: float = 30.0) -> None:
        self.common = [f"--tp-size={tp_size}", f"--dp-size={dp_size}",
                       f"--init-method=file://{tmp_path / 'store'}", f"--timeout-s={timeout_s}",
                       f"--rendezvous-timeout-s={PROCESS_LIMIT_S / 2}"]
        self.peers: list[subprocess.Popen[str]] = []

    def start(self, scenario: str, rank: int, **options: Any) -> subprocess.Popen[str]:
        flags = [f"--{name.replace('_', '-')}={json.dumps(value)}"
                 for name, value in options.items()]
        peer = subprocess.Popen([sys.executable, str(PEER), scenario, f"--rank={rank}",
                                 *self.common, *flags], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=peer_environment(), cwd=REPO)
        self.peers.append(peer)
        return peer

    def report(self, peer: subprocess.Popen[str], stdin: str = "") -> dict[str, Any]:
        """The JSON line a rank printed, once it has exited cleanly."""
        out, err = peer.communicate(input=stdin, timeout=PROCESS_LIMIT_S)
        assert peer.returncode == 0, err
        report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return report

    def __enter__(self) -> "GlooJob":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for peer in self.peers:
            if peer.poll() is None:
                peer.kill()
            peer.communicate()  # reap it and close its pipes
