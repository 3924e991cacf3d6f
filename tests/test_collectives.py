"""TP ranks leave a broadcast with TP rank 0's values, DP shards agree on G or all raise
ConsensusMismatch, and a dead or hung peer surfaces as CollectiveError within the timeout.

Multi-rank tests run real gloo ranks (tests/gloo_peer.py), one process each, started together
and waited on with a hard limit, so a hang fails the test instead of stalling the suite.
"""

import contextlib
import datetime
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_job import PROCESS_LIMIT_S, TIMEOUT_MARGIN_S, GlooJob
from gloo_peer import DIED_EXIT_CODE
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, unstubbed

from adaspec.errors import CollectiveError, ConfigError, DeviceUnavailable
from adaspec.runtime.devices.collectives import (
    Collectives,
    DistributedCollectives,
    LocalCollectives,
    backend_reason,
    dp_ranks,
    open_collectives,
    shard_ranks,
)
from adaspec.runtime.devices.rendezvous import Gathering, host_store, join_store


def run_round(tmp_path: Path, tp_size: int, dp_size: int,
              options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank runs one round's collectives with its own inputs; their reports by rank."""
    with GlooJob(tmp_path, tp_size=tp_size, dp_size=dp_size) as job:
        peers = [job.start("round", rank, **rank_options)
                 for rank, rank_options in enumerate(options)]
        return [job.report(peer) for peer in peers]


CONFIDENCES_RANK_0 = [[0.875, 0.5, 0.25], [0.75, 0.125, 0.0625]]  # [num_reqs, width]
CONFIDENCES_RANK_1 = [[0.1, 0.2, 0.3], [0.4, 0.6, 0.9]]


def test_tp_broadcast_leaves_every_tp_rank_with_tp_rank_0_values(tmp_path: Path) -> None:
    reports = run_round(tmp_path, tp_size=2, dp_size=1, options=[
        {"token_ids": [1, 2, 3], "confidences": CONFIDENCES_RANK_0, "rows": 16},
        {"token_ids": [7, 8, 9], "confidences": CONFIDENCES_RANK_1, "rows": 16},
    ])
    assert [(r["tp_rank"], r["dp_rank"]) for r in reports] == [(0, 0), (1, 0)]
    for report in reports:
        assert "error" not in report
        assert report["token_ids"] == [1, 2, 3]
        assert report["confidences"] == CONFIDENCES_RANK_0
        assert report["rows"] == 16


def test_an_engines_existing_process_group_is_joined_and_left_alive(tmp_path: Path) -> None:
    reports = run_round(tmp_path, tp_size=2, dp_size=1, options=[
        {"token_ids": [1, 2], "rows": 8, "engine_group": True},
        {"token_ids": [3, 4], "rows": 8, "engine_group": True},
    ])
    assert [r["token_ids"] for r in reports] == [[1, 2], [1, 2]]
    assert [r["default_group_alive"] for r in reports] == [True, True]


def test_every_rank_installs_rank_0s_cost_table(tmp_path: Path) -> None:
    with GlooJob(tmp_path, tp_size=1, dp_size=2) as job:
        peers = [job.start("share", rank) for rank in range(2)]
        reports = [job.report(peer) for peer in peers]
    assert [r["installed"] for r in reports] == [{"fitted_by": 0}, {"fitted_by": 0}]


def test_dp_shards_that_chose_the_same_g_both_get_it(tmp_path: Path) -> None:
    reports = run_round(tmp_path, tp_size=1, dp_size=2, options=[
        {"token_ids": [1, 2], "rows": 16}, {"token_ids": [5, 6], "rows": 16}])
    assert [(r["tp_rank"], r["dp_rank"]) for r in reports] == [(0, 0), (0, 1)]
    assert [r["rows"] for r in reports] == [16, 16]
    # Shards share G but not tokens: with one TP rank each, nobody overwrites them.
    assert [r["token_ids"] for r in reports] == [[1, 2], [5, 6]]


def test_dp_shards_that_chose_different_g_all_raise_consensus_mismatch(tmp_path: Path) -> None:
    reports = run_round(tmp_path, tp_size=1, dp_size=2, options=[{"rows": 16}, {"rows": 32}])
    for report in reports:
        assert report["error"] == "ConsensusMismatch"
        assert report["message"] == "ranks disagree on target graph rows G: [16, 32]"
        assert "rows" not in report


def test_four_ranks_broadcast_within_their_dp_shard_and_agree_across_shards(
        tmp_path: Path) -> None:
    reports = run_round(tmp_path, tp_size=2, dp_size=2, options=[
        {"token_ids": [10 * rank, 10 * rank + 1], "rows": 32} for rank in range(4)])
    assert [(r["tp_rank"], r["dp_rank"]) for r in reports] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["token_ids"] for r in reports] == [[0, 1], [0, 1], [20, 21], [20, 21]]
    assert [r["rows"] for r in reports] == [32] * 4


def test_dead_peer_fails_tp_broadcast_with_collective_error_within_timeout(
        tmp_path: Path) -> None:
    timeout_s = 10.0
    with GlooJob(tmp_path, tp_size=2, timeout_s=timeout_s) as job:
        survivor = job.start("die", 0, odd_rank=1)
        dying = job.start("die", 1, odd_rank=1)
        assert dying.wait(timeout=PROCESS_LIMIT_S) == DIED_EXIT_CODE
        report = job.report(survivor, stdin="go\n")
    assert report["error"] == "CollectiveError"
    assert report["message"].startswith("collective tp_broadcast over ranks [0,1] failed: ")
    assert report["elapsed_s"] < timeout_s + TIMEOUT_MARGIN_S


def test_hung_peer_fails_tp_broadcast_at_the_configured_timeout(tmp_path: Path) -> None:
    """TP rank 0 never sends; only the (short, real) gloo timeout can end rank 1's wait,
    and it is the collectives' timeout, not the much longer rendezvous timeout."""
    timeout_s = 2.0
    with GlooJob(tmp_path, tp_size=2, timeout_s=timeout_s) as job:
        hung = job.start("hang", 0, odd_rank=0)
        waiting = job.start("hang", 1, odd_rank=0)
        report = job.report(waiting)
        assert "error" not in job.report(hung)  # released by closing its stdin
    assert report["error"] == "CollectiveError"
    assert report["message"].startswith("collective tp_broadcast over ranks [0,1] failed: ")
    assert "timed out" in report["message"].lower()
    assert timeout_s * 0.9 <= report["elapsed_s"] < timeout_s + TIMEOUT_MARGIN_S


def test_local_collectives_are_one_tp_rank_in_one_dp_shard() -> None:
    comm: Collectives = LocalCollectives()
    assert (comm.tp_rank, comm.tp_size, comm.dp_rank, comm.dp_size) == (0, 1, 0, 1)
    token_ids = torch.tensor([4, 5, 6])
    comm.tp_broadcast(token_ids)
    comm.tp_all_reduce(token_ids)
    assert token_ids.tolist() == [4, 5, 6]
    assert comm.dp_agree_rows(48) == 48
    comm.close()
    comm.close()


def test_open_collectives_needs_no_rendezvous_for_one_rank() -> None:
    assert isinstance(open_collectives(), LocalCollectives)
    assert not dist.is_initialized()


def test_open_collectives_refuses_several_ranks_without_init_method() -> None:
    with pytest.raises(ConfigError, match=r"^init_method=null: expected a rendezvous URL"):
        open_collectives(rank=0, world_size=2, tp_size=2)


def test_layout_puts_tp_ranks_of_a_dp_shard_side_by_side() -> None:
    assert shard_ranks(tp_size=2, dp_size=3) == [[0, 1], [2, 3], [4, 5]]
    assert dp_ranks(tp_size=2, dp_size=3) == [[0, 2, 4], [1, 3, 5]]


VALID: dict[str, Any] = {"rank": 0, "world_size": 4, "tp_size": 2, "dp_size": 2,
                         "init_method": "nonsense://", "device": "cpu",
                         "timeout": datetime.timedelta(seconds=5)}


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"world_size": 3}, ConfigError,
     r"^world_size=3: expected tp_size\*dp_size=4 \(tp_size=2, dp_size=2\)$"),
    ({"rank": 4}, ConfigError, r"^rank=4: expected 0 <= rank < world_size=4$"),
    ({"rank": -1}, ConfigError, r"^rank=-1: expected 0 <= rank < world_size=4$"),
    ({"tp_size": 0, "world_size": 0}, ConfigError, r"^tp_size=0: expected a positive number"),
    ({"timeout": datetime.timedelta(0)}, ConfigError, r"^timeout=0s: expected a positive"),
    ({"rendezvous_timeout": datetime.timedelta(seconds=-1)}, ConfigError,
     r"^rendezvous_timeout=-1s: expected a positive duration$"),
    ({"device": "tpu"}, DeviceUnavailable, r"^--device=tpu: expected one of cpu\|cuda\|npu$"),
])
def test_invalid_arguments_are_refused_before_any_rendezvous(
        change: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DistributedCollectives(**{**VALID, **change})
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_cuda_without_a_gpu_is_refused_before_any_rendezvous() -> None:
    with pytest.raises(DeviceUnavailable, match=r"^--device=cuda: no CUDA device"):
        DistributedCollectives(**{**VALID, "device": "cuda"})


def test_unknown_init_method_is_a_collective_error_of_init_process_group() -> None:
    with pytest.raises(CollectiveError) as info:
        DistributedCollectives(**VALID)
    assert (info.value.op, info.value.group) == ("init_process_group", (0, 1, 2, 3))
    assert info.value.reason == "No rendezvous handler for nonsense://"
    assert not dist.is_initialized()


def test_rendezvous_timeout_is_a_collective_error_of_init_process_group(tmp_path: Path) -> None:
    with pytest.raises(CollectiveError, match=r"^collective init_process_group over ranks \[0,1"):
        DistributedCollectives(rank=0, world_size=2, tp_size=2, dp_size=1,
                               init_method=f"file://{tmp_path / 'store'}", device="cpu",
                               timeout=datetime.timedelta(seconds=0.2))
    assert not dist.is_initialized()


def test_a_collective_over_a_large_world_is_named_by_runs_of_ranks() -> None:
    # Nothing listens on port 1, and a zero timeout gives up at the first refusal.
    with pytest.raises(CollectiveError) as info:
        join_store("tcp://127.0.0.1:1", 65536, Gathering(0.0, 0.0, lambda: False))
    assert str(info.value).startswith("collective init_process_group over ranks [0..65535] "
                                      "failed: nothing listens at 127.0.0.1:1")
    assert str(CollectiveError("tp_broadcast", (0, 1, 4, 5, 6, 9), "lost")) == (
        "collective tp_broadcast over ranks [0,1,4..6,9] failed: lost")


@pytest.mark.parametrize(("backend_message", "reason"), [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
     "[127.0.0.1]:4242\nException raised from ...", "Connection closed by peer [127.0.0.1]:4242"),
    ("[pair.cc:589] Read error [127.0.0.1]:4242: Connection reset by peer. This is typically "
     "caused by a remote worker crashing. Check the logs of the remote worker before "
     "reporting an error. GLHF! \U0001f3d6\ufe0f", "Read error [127.0.0.1]:4242: Connection "
     "reset by peer."),
    ("\n  Wait timeout  \n", "Wait timeout"),
    ("", "RuntimeError"),
    ("x" * 300, "x" * 197 + "..."),
])
def test_backend_reason_is_one_trimmed_line(backend_message: str, reason: str) -> None:
    assert backend_reason(RuntimeError(backend_message)) == reason


@pytest.fixture
def no_host_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lookup fails as it would for a name no resolver knows (a fake: CI has no DNS)."""
    import socket

    def unknown(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)


@pytest.mark.usefixtures("no_host_resolves")
def test_rank_0_refuses_a_rendezvous_host_that_names_nothing() -> None:
    with pytest.raises(ConfigError) as info:
        host_store("tcp://rank0.example:29500", datetime.timedelta(seconds=1))
    assert str(info.value) == (
        "--master_node_addr=rank0.example:29500: rank 0's host cannot be resolved (Name or "
        "service not known); expected a name or address of rank 0's machine")


@pytest.mark.usefixtures("no_host_resolves")
def test_a_rank_whose_rendezvous_host_never_resolves_is_told_so_not_that_nothing_listens(
        ) -> None:
    with pytest.raises(CollectiveError) as info:
        join_store("tcp://rank0.example:29500", 2, Gathering(0.0, 0.0, lambda: False))
    assert info.value.reason == (
        "rank 0's host rank0.example could not be resolved (Name or service not known) within "
        "0 s; expected a name or address of rank 0's machine in --master_node_addr")


def test_a_rank_told_that_torchruns_agent_hosts_the_store_is_pointed_at_the_agent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(CollectiveError, match=r"nothing listens at 127\.0\.0\.1:1 after 0 s; "
                                              r"is the torchrun agent, which TORCHELASTIC_USE_"
                                              r"AGENT_STORE=True says hosts it, started there\?"):
        join_store("tcp://127.0.0.1:1", 2, Gathering(0.0, 0.0, lambda: False))


HOST_A_STORE = """
import datetime, signal, sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=60))
print("up", flush=True)
signal.pause()
"""


@contextlib.contextmanager
def _rank_0_store() -> Iterator[tuple[subprocess.Popen[str], TCPStore]]:
    """A store hosted by another process, as rank 0 hosts it, and a follower's client of it
    with the layout published; the process is ended (thawed first) however the test left it."""
    from rank_launch import free_port

    from adaspec.runtime.devices.rendezvous import client, publish_layout

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST_A_STORE, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        assert host.stdout.readline() == "up\n"
        store = client("127.0.0.1", port, datetime.timedelta(seconds=PROCESS_LIMIT_S))
        publish_layout(store, LAYOUT, Gathering(time.monotonic() + 60, 60, lambda: False))
        yield host, store
    finally:
        host.send_signal(signal.SIGCONT)
        _kill(host)
        assert host.stdout is not None
        host.stdout.close()


LAYOUT = {"--nnodes": 2, "--dp_size": 1, "--tp_size": 1}


def _kill(host: subprocess.Popen[str]) -> None:
    host.kill()
    host.wait()


def test_a_store_call_on_a_frozen_rank_0_ends_at_the_answer_limit_not_the_deadline() -> None:
    """Rank 0 frozen (SIGSTOP) between two of a follower's store calls, its arrival counted
    and the arrivals not yet: before, the follower waited for the rendezvous deadline."""
    from adaspec.runtime.devices.rendezvous import arrive

    with _rank_0_store() as (host, store):
        host.send_signal(signal.SIGSTOP)
        gathering = Gathering(time.monotonic() + 3600, 3600, lambda: False, answer_s=0.5)
        with pytest.raises(CollectiveError) as info:
            arrive(store, 1, LAYOUT, gathering)
        assert info.value.reason == "rank 0 stopped: its rendezvous store gave no answer for 0.5 s"
        host.send_signal(signal.SIGCONT)
        store.check(["unfrozen"])  # after the call left waiting (one at a time): c10d would
        # print pages of C++ frames for one cut off by the kill below


def test_a_store_call_on_a_killed_rank_0_is_named_as_the_heartbeat_watch_names_it() -> None:
    """Rank 0 killed between two of a follower's store calls: before, c10d's socket error
    ("Connection reset by peer") was the start's reason."""
    from adaspec.runtime.devices.rendezvous import arrive

    with _rank_0_store() as (host, store):
        _kill(host)
        with pytest.raises(CollectiveError) as info:
            arrive(store, 1, LAYOUT, Gathering(time.monotonic() + 3600, 3600, lambda: False))
    assert info.value.reason == "rank 0 stopped: its rendezvous store is gone"


def test_a_store_that_accepts_then_goes_away_is_named_gone_at_once() -> None:
    """Rank 0 killed between a follower's first contact and its store client's connect:
    c10d's client retries a refused connect until its timeout, and the wait used to end
    there naming another service on the port."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_once_then_go() -> None:
        contact, _ = listener.accept()
        contact.close()
        listener.close()

    gone = threading.Thread(target=answer_once_then_go, daemon=True)
    gone.start()
    with pytest.raises(CollectiveError) as info:
        join_store(f"tcp://127.0.0.1:{port}", 2,
                   Gathering(time.monotonic() + 30, 30, lambda: False))
    gone.join()
    assert info.value.reason == "rank 0 stopped: its rendezvous store is gone"


def test_a_backend_connect_cut_by_a_killed_rank_0_is_named_as_the_watch_names_it() -> None:
    """The backend's connect waits on rank 0's store; a kill then failed the start with
    c10d's socket message ("Failed to recv, got 0 bytes ...") whenever the backend's error
    came before the heartbeat watch's next look."""
    from adaspec.runtime.devices.rendezvous import Connecting, client, watch

    with _rank_0_store() as (host, watcher):
        backend = client("127.0.0.1", watcher.port,
                         datetime.timedelta(seconds=PROCESS_LIMIT_S))
        _kill(host)
        # The backend's own wait on the store, as gloo's full-mesh connect makes it.
        connecting = Connecting(lambda: backend.wait(["backend/rank_0"]))
        with pytest.raises(CollectiveError) as info:
            watch(connecting, watcher, 1, 2, 1.0, lambda: False)
    assert info.value.reason == "rank 0 stopped: its rendezvous store is gone"
