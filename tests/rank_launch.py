"""Start every rank of one launch line as its own ``adaspec`` process on this host, the way
the specification launches them (each with its own --node_rank, one rendezvous on the
loopback), and collect what each printed. A hang fails the test at a hard limit."""

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from gloo_job import PROCESS_LIMIT_S, REPO, peer_environment

from adaspec.bench.run import shipped_prompts

# Four domains, each prompt cut short: the prompts' ends differ in how well they draft.
PROMPTS = [prompt[:90].decode("utf-8", "ignore") for prompt in shipped_prompts()[:4]]
DECODE = ["generate", "--json", "--max_tokens=24", *(f"--prompt={p}" for p in PROMPTS)]
"""The rank tests' generate command (one rank's output is the reference for each layout)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class RankRun:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.stdout)
        return data

    def digest(self) -> str:
        """The commit digest the rank printed on stderr."""
        line = next(line for line in self.stderr.splitlines()
                    if line.startswith(f"rank {self.rank}: commit digest "))
        return line.rsplit(" ", 1)[1]


def start_ranks(nnodes: int, argv: list[str], program: tuple[str, ...] = ("-m", "adaspec")
                ) -> list[subprocess.Popen[str]]:
    """Every rank's process: ``program`` (the adaspec command unless given) with ``argv``
    and this rank's launch flags."""
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, *program, *argv, f"--nnodes={nnodes}", f"--node_rank={rank}",
         f"--master_node_addr=127.0.0.1:{port}"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=peer_environment(), cwd=REPO)
        for rank in range(nnodes)]


def finish(ranks: list[subprocess.Popen[str]]) -> list[RankRun]:
    """Every rank's output once it has exited. Ranks still running at the limit are killed,
    and the failure shows what every rank had said: the rank that hung is often waiting for
    one that exited early, whose output is the reason."""
    deadline = time.monotonic() + PROCESS_LIMIT_S
    runs, hung = [], []
    try:
        for rank, process in enumerate(ranks):
            # One that exited already has only its pipes to give: a few seconds do.
            left = max(5.0 if process.poll() is not None else 0.0, deadline - time.monotonic())
            try:
                out, err = process.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                out, err = stack_and_kill(process)
                hung.append(rank)
            runs.append(RankRun(rank, process.returncode, out, err))
    finally:  # whatever went wrong here, no rank outlives the test
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.communicate()
    if hung:
        said = "\n".join(f"--- rank {run.rank} exited {run.returncode}:\n"
                          + "\n".join(run.stderr.splitlines()[-40:]) for run in runs)
        raise AssertionError(f"rank {', '.join(map(str, hung))} still ran after "
                             f"{PROCESS_LIMIT_S} s (killed):\n{said}")
    return runs


def stack_and_kill(process: subprocess.Popen[str]) -> tuple[str, str]:
    """End a rank that hung, its threads' Python stacks on its stderr first (SIGABRT makes
    the fault handler that peer_environment turns on print them)."""
    process.send_signal(signal.SIGABRT)
    try:
        return process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()


def kill_at_round(victim: subprocess.Popen[str], number: int) -> float:
    """Kill ``victim`` once its state trace (``--trace=-``, on its stderr) shows round
    ``number`` under way; the monotonic time of the kill."""
    assert victim.stderr is not None
    seen = []
    for line in victim.stderr:  # blocks on the pipe: no sleeping
        if f'"round": {number}' in line or f'"round":{number}' in line:
            break
        seen.append(line)
    else:  # the victim ended first: what it said is the reason, so keep it in the failure
        victim.wait()
        raise AssertionError(f"the rank to kill exited {victim.returncode} before round "
                             f"{number}:\n{''.join(seen[-20:])}")
    victim.kill()
    return time.monotonic()


def run_ranks(nnodes: int, argv: list[str]) -> list[RankRun]:
    return finish(start_ranks(nnodes, argv))


def front_tokens(runs: list[RankRun], tp_size: int) -> list[list[int]]:
    """The front's tokens per request, once every rank exited cleanly and the TP ranks of
    each DP shard committed the same tokens (shards decode different requests)."""
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert all(not run.stdout for run in runs[1:])  # the front alone prints results
    if tp_size > 1:
        for first in range(0, len(runs), tp_size):
            assert len({run.digest() for run in runs[first:first + tp_size]}) == 1
    return [r["token_ids"] for r in runs[0].json()["results"]]
