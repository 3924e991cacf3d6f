"""Several ranks, one process each, started with the specification's launch flags: the front
(rank 0) takes the requests and prints the results, the others decode them in lockstep.

Greedy output at TP=2 equals the same launch's target-only output at TP=2 (a row-parallel
sum rounds differently from the whole model, so TP=1 is not the reference), every rank
commits the same tokens (their commit digests agree), and each rank writes its own event
log, in which every rank made the same decisions.
"""

import asyncio
import contextlib
import datetime
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_job import PROCESS_LIMIT_S, peer_environment
from rank_launch import (
    DECODE,
    PROMPTS,
    RankRun,
    finish,
    free_port,
    kill_at_round,
    run_ranks,
    start_ranks,
)
from scipy.stats import chisquare

from adaspec.config import load_config
from adaspec.config.launch import torchrun_settings
from adaspec.config.requests import SamplingParams
from adaspec.errors import ConfigError
from adaspec.models import load_reference_models
from adaspec.runtime.devices.collectives import LocalCollectives
from adaspec.runtime.devices.rendezvous import arrived_key
from adaspec.runtime.devices.sampling import target_probs
from adaspec.runtime.devices.streams import CPU_THREADS_ENV, share_cores
from adaspec.runtime.engine import (
    Runtime,
    heartbeat_s,
    local_rank,
    rank_device,
    ranks_on_this_host,
)
from adaspec.runtime.events.ranks import Decision, first_difference
from adaspec.runtime.ranks import Arrival, Plan


def decoded(runs: list[RankRun]) -> list[list[int]]:
    """The front's tokens per request, once every rank exited cleanly and all ranks
    committed the same tokens."""
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert len({run.digest() for run in runs}) == 1
    assert all(not run.stdout for run in runs[1:])  # the front alone prints results
    return [r["token_ids"] for r in runs[0].json()["results"]]


@pytest.mark.parametrize("algorithm", [
    ["--speculative_algorithm=MTP", "--num_speculative_tokens=3"],
    ["--speculative_algorithm=DSpark", "--num_speculative_tokens=7"],
])
def test_tp2_greedy_speculation_equals_tp2_target_only(
        target_only_tp2: list[list[int]], algorithm: list[str]) -> None:
    assert decoded(run_ranks(2, [*DECODE, "--temperature=0", *algorithm])) == target_only_tp2


def test_tp2_random_sampling_commits_the_same_tokens_on_every_rank(
        tmp_path: Path) -> None:
    runs = run_ranks(2, [*DECODE, "--temperature=0.9", "--top_p=0.95",
                         "--speculative_algorithm=DSpark", "--num_speculative_tokens=7",
                         f"--event_log={tmp_path / 'run.jsonl'}"])
    tokens = decoded(runs)
    assert [len(t) for t in tokens] == [24] * len(PROMPTS)
    assert not (tmp_path / "run.jsonl").exists()
    logs = [str(tmp_path / f"run.rank{rank}.jsonl") for rank in range(2)]
    for rank in range(2):  # each rank's own log replays on its own
        assert "decisions match the log" in replay([logs[rank]]).stdout
    across = replay([logs[0], "--across", logs[1]])
    decisions = sum(1 for line in Path(logs[0]).read_text().splitlines()
                    if '"kind":"depth_decided"' in line or '"kind":"budget_decided"' in line)
    assert f"all 2 ranks made the same {decisions} decisions" in across.stdout
    # Logs that are not of distinct ranks of this run are refused, naming the log.
    again = tmp_path / "again.jsonl"
    again.write_text(Path(logs[0]).read_text())
    other = tmp_path / "other.jsonl"
    lines = Path(logs[1]).read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["seeds"]["run"] += 1
    other.write_text(json.dumps(header, separators=(",", ":")) + "\n" + "".join(lines[1:]))
    for log, error in ((again, "a log of rank 0 again"), (other, "another run's log: its "
                                                           "header's launch, models or seed")):
        refused = subprocess.run([sys.executable, "-m", "adaspec", "replay", logs[0],
                                  "--across", str(log)], capture_output=True, text=True,
                                 env=peer_environment(), timeout=PROCESS_LIMIT_S, check=False)
        assert refused.returncode == 2
        assert error in refused.stderr


def exact_first_pairs(prompt: bytes, top_k: int) -> dict[tuple[int, int], float]:
    """P(token 1, token 2) of a request at temperature 1 with ``top_k``: the filtered target
    distribution after the prompt, then after the prompt and each possible token 1 (the
    whole model in this process)."""
    target = load_reference_models().target

    def filtered(logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        return target_probs(logits, torch.ones(rows), torch.full((rows,), top_k),
                            torch.ones(rows), torch.zeros(rows))

    ids = torch.tensor(list(prompt))
    with torch.no_grad():
        first = filtered(target.forward(ids[None])[0][:, -1])[0]
        tokens = torch.nonzero(first).flatten()
        extended = torch.cat([ids.expand(len(tokens), -1), tokens[:, None]], dim=1)
        second = filtered(target.forward(extended)[0][:, -1])
    return {(int(t1), t2): float(first[t1] * p) for t1, row in zip(tokens, second, strict=True)
            for t2, p in enumerate(row.tolist()) if p > 0}


def test_tp2_random_sampling_keeps_the_target_distribution(tmp_path: Path) -> None:
    """Tokens 1 and 2 of 600 seeded requests of one prompt at TP=2 (token 1 from the prefill,
    token 2 from the first speculative round, DSpark width 7), against the exact filtered
    target probabilities: a one-sample chi-square over the cells with an expected count of
    at least 5 (the rest pooled) must give p > 1e-3, and no pair of probability zero may
    occur. A TP split rounds differently from the whole model by about 1e-7, far below what
    600 samples resolve."""
    prompt = b"ROMEO. But soft, what light through yonder window breaks? It is the"
    count, top_k = 600, 40
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes((prompt + b"\n") * count)
    runs = run_ranks(2, ["generate", "--json", f"--prompts_file={prompts}", "--max_tokens=2",
                         "--temperature=1", f"--top_k={top_k}", "--max_seqs_per_batch=16",
                         "--speculative_algorithm=DSpark", "--num_speculative_tokens=7"])
    observed = Counter(tuple(tokens) for tokens in decoded(runs))  # every rank committed alike
    exact = exact_first_pairs(prompt, top_k)
    assert set(observed) <= set(exact)  # nothing the filters remove ever came out
    cells = sorted(exact, key=exact.__getitem__, reverse=True)
    kept = [cell for cell in cells if exact[cell] * count >= 5]
    assert len(kept) >= 5  # the test has cells to compare
    rest = [cell for cell in cells if exact[cell] * count < 5]
    seen = [observed[cell] for cell in kept] + [sum(observed[cell] for cell in rest)]
    expected = [exact[cell] * count for cell in kept] + [sum(exact[c] for c in rest) * count]
    assert chisquare(seen, [e * sum(seen) / sum(expected) for e in expected]).pvalue > 1e-3


def replay(argv: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "adaspec", "replay", *argv],
                          capture_output=True, text=True, env=peer_environment(),
                          timeout=PROCESS_LIMIT_S, check=False)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize(("other", "difference"), [
    ([("depth", 0, 3), ("G", 0, 9)], None),
    ([("depth", 0, 3), ("G", 0, 12)],
     "decision 2: a has G=9 in round 0, b has G=12 in round 0"),
    ([("depth", 0, 3)],
     "a records 2 decisions, b 1: the ranks did not run the same rounds"),
])
def test_the_first_decision_two_ranks_disagree_on_is_named(
        other: list[Decision], difference: str | None) -> None:
    assert first_difference([("depth", 0, 3), ("G", 0, 9)], other, "a", "b") == difference


def test_a_plan_travels_as_json_and_comes_back_equal() -> None:
    plan = Plan(arrivals=(Arrival(id=3, prompt=(1, 2, 255), params=SamplingParams(
        temperature=0.5, top_k=4, top_p=0.9, min_p=0.1, max_tokens=7, stop=(10, 13))),),
        cancels=(1, 2), stop=True)
    assert Plan.decode(plan.encode()) == plan
    assert Plan.decode(Plan().encode()) == Plan()


@pytest.mark.parametrize(("addr", "env", "local"), [
    ("127.0.0.1:29500", {}, 4), ("localhost:29500", {}, 4), ("[::1]:29500", {}, 4),
    ("10.0.0.7:29500", {}, 1), ("10.0.0.7:29500", {"LOCAL_WORLD_SIZE": "2"}, 2),
    ("10.0.0.7:29500", {"LOCAL_WORLD_SIZE": "x"}, 1),
])
def test_ranks_on_this_host(monkeypatch: pytest.MonkeyPatch, addr: str, env: dict[str, str],
                            local: int) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = load_config({"nnodes": 4, "master_node_addr": addr}).launch
    assert ranks_on_this_host(launch) == local


def test_ranks_on_one_host_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    try:
        assert share_cores(1) is None
        assert share_cores(10_000) == 1  # never below one thread
        assert torch.get_num_threads() == 1
        monkeypatch.setenv(CPU_THREADS_ENV, "2")
        torch.set_num_threads(before)
        assert share_cores(4) is None  # the environment's count wins
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("path", "expected"), [
    ("run.jsonl", "run.rank1.jsonl"), ("/tmp/a.b/run", "/tmp/a.b/run.rank1"), ("-", "-")])
def test_every_rank_writes_its_own_files(path: str, expected: str) -> None:
    runtime = Runtime(load_config({"nnodes": 2, "node_rank": 1}))
    assert runtime.rank == 1
    assert not runtime.is_front
    assert runtime._rank_file(path) == expected
    assert Runtime(load_config({})).is_front
    assert Runtime(load_config({}))._rank_file(path) == path


@pytest.mark.parametrize(("layout", "collectives"), [
    ([], r"tp_\w+|plan"),  # TP=2: met in a round's broadcast or the next plan
    (["--dp_size=2", "--prompt=xyz"], r"plan|shard_turn"),  # DP=2: met between rounds
])
def test_a_killed_rank_makes_the_front_fail_within_the_timeout_naming_the_collective(
        layout: list[str], collectives: str) -> None:
    """Rank 1 is killed once its own state trace (on its stderr) shows round 3 under way;
    the front must then end every request with the collective's one-line error and exit
    non-zero, well within --collective_timeout_s, instead of hanging."""
    timeout_s = 20
    ranks = start_ranks(2, ["generate", "--max_tokens=1000", "--temperature=0",
                            "--prompt=abc", "--trace=-", f"--collective_timeout_s={timeout_s}",
                            "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                            *layout])
    front, victim = ranks
    try:
        killed = kill_at_round(victim, 3)
        out, err = front.communicate(timeout=PROCESS_LIMIT_S)
        elapsed = time.monotonic() - killed
    finally:
        finish(ranks)
    assert front.returncode == 2
    assert out == ""
    last = err.strip().splitlines()[-1]
    # The front meets the dead rank in a round's collective or in the next plan.
    assert re.match(r"adaspec generate: error: request \d failed: (round \d+ failed in "
                    rf"\w+|runtime fault): CollectiveError: collective ({collectives}) over "
                    r"ranks \[0,1\] failed: ", last), last
    assert elapsed < timeout_s


def _follower(address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "adaspec", "generate", "--nnodes=2", "--node_rank=1",
         f"--master_node_addr={address}", "--collective_timeout_s=2", "--prompt=abc",
         "--max_tokens=4", "--temperature=0"], capture_output=True, text=True,
        env=peer_environment(), timeout=PROCESS_LIMIT_S, check=False)


def test_a_rank_whose_rendezvous_is_not_there_says_so_in_one_line() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = _follower(address)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"adaspec generate: error: collective init_process_group over ranks [0,1] failed: "
        f"nothing listens at {address} after 2 s; is rank 0 started, with this "
        "--master_node_addr?"], done.stderr


def _answer_everything(listening: socket.socket) -> None:
    """Another service on the port (a fake, the point of the test): it answers whatever it
    reads with an HTTP error, which c10d's client reads as a wrong ping."""
    def answer(connection: socket.socket) -> None:
        with contextlib.suppress(OSError), connection:
            while connection.recv(4096):
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    with contextlib.suppress(OSError):
        while True:
            connection, _ = listening.accept()
            threading.Thread(target=answer, args=(connection,), daemon=True).start()


@pytest.mark.parametrize("answers", [False, True], ids=["silent", "answering"])
def test_a_rank_whose_rendezvous_port_holds_another_service_says_so_instead_of_waiting(
        answers: bool) -> None:
    with socket.socket() as other:  # accepts connections; answers nothing, or junk
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        if answers:
            threading.Thread(target=_answer_everything, args=(other,), daemon=True).start()
        done = _follower(f"127.0.0.1:{port}")
        other.shutdown(socket.SHUT_RDWR)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"adaspec generate: error: collective init_process_group over ranks [0,1] failed: "
        f"127.0.0.1:{port} accepts connections but no rendezvous store answered there within "
        "2 s; is another service on that port?"], done.stderr


def test_rank_0_on_a_rendezvous_port_in_use_names_the_flag_in_one_line() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, "-m", "adaspec", "generate", "--nnodes=2", "--node_rank=0",
             f"--master_node_addr={address}", "--collective_timeout_s=2", "--prompt=abc",
             "--max_tokens=4", "--temperature=0"], capture_output=True, text=True,
            env=peer_environment(), timeout=PROCESS_LIMIT_S, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"adaspec generate: error: --master_node_addr={address}: rank 0 cannot listen there "
        "for the rendezvous: the port is in use; expected a free port"], done.stderr


def _rank(command: str, nnodes: int, rank: int, port: int, *flags: str
          ) -> subprocess.Popen[str]:
    """One rank of an MTP launch at 127.0.0.1:``port``, waiting for the ranks far longer than
    the test's limit, so only a wait that ends early ends before the limit."""
    request = ["--prompt=abc", "--max_tokens=4", "--temperature=0"] if command == "generate" \
        else [f"--port={free_port()}"]
    return subprocess.Popen(
        [sys.executable, "-m", "adaspec", command, f"--nnodes={nnodes}", f"--node_rank={rank}",
         f"--master_node_addr=127.0.0.1:{port}", "--speculative_algorithm=MTP",
         "--num_speculative_tokens=3", f"--collective_timeout_s={3 * PROCESS_LIMIT_S}",
         *flags, *request], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=peer_environment())


def _arrived(port: int, rank: int) -> None:
    """Block until ``rank`` has arrived in the rendezvous store rank 0 hosts at ``port``."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=PROCESS_LIMIT_S))
    store.wait([arrived_key(rank)])


def _last_lines(ranks: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    try:
        ended = [process.communicate(timeout=PROCESS_LIMIT_S) for process in ranks]
    finally:
        _end_all(ranks)
    return [(process.returncode, err.splitlines()[-1] if err else "")
            for process, (_, err) in zip(ranks, ended, strict=True)]


ERROR = "adaspec generate: error: "
START = f"{ERROR}collective init_process_group over ranks "


@pytest.mark.parametrize(("front", "other", "flag", "group"), [
    ((2, []), (4, ["--dp_size=2"]), ("--nnodes", 4, 2), "[0,1]"),
    # The same world in other groups: new_group would wait for the timeout, before the
    # launch lines are ever compared.
    ((4, ["--dp_size=2"]), (4, []), ("--dp_size", 1, 2), "[0..3]"),
])
def test_ranks_started_with_another_layout_say_so_at_once(
        front: tuple[int, list[str]], other: tuple[int, list[str]], flag: tuple[str, int, int],
        group: str) -> None:
    port = free_port()
    ranks = [_rank("generate", front[0], 0, port, *front[1]),
             _rank("generate", other[0], 1, port, *other[1])]
    name, mine, theirs = flag
    assert _last_lines(ranks) == [
        (2, f"{START}{group} failed: rank 1 was started with {name}={mine}, rank 0 with "
            f"{name}={theirs}"),
        (2, f"{ERROR}{name}={mine}: expected {theirs}, as rank 0 was started with: every "
            "rank of a launch gives the same")]


def test_two_ranks_started_with_one_node_rank_are_named_at_once() -> None:
    port = free_port()
    ranks = [_rank("generate", 4, rank, port, "--dp_size=2") for rank in (0, 1, 1)]
    lines = _last_lines(ranks)
    again = "(a rank that stopped cannot be started again"
    told = (2, f"{START}[0..3] failed: two ranks were started with --node_rank=1 {again}: the "
               "launch starts over)")
    refused = (2, f"{ERROR}--node_rank=1: expected a rank no other rank of this launch was "
                  f"started with {again}: start the launch over)")
    assert lines[0] == told
    assert sorted(lines[1:]) == sorted([told, refused])


def test_a_rank_that_arrived_and_died_is_named_before_the_others_arrive() -> None:
    port = free_port()
    front, victim = _rank("generate", 4, 0, port, "--dp_size=2"), \
        _rank("generate", 4, 1, port, "--dp_size=2")
    try:
        _arrived(port, 1)
        victim.kill()
        (code, line), = _last_lines([front])
    finally:
        _end_all([front, victim])
    assert code == 2
    assert re.fullmatch(re.escape(f"{START}[0..3] failed: rank 1 arrived, then stopped: ")
                        + r"no heartbeat for \d+ s", line), line


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_rank_0_lost_while_the_ranks_gather_is_named_in_one_line(fault: str) -> None:
    """Frozen (SIGSTOP: a hung machine), rank 0's store answers nothing, and a store client
    has no timeout of its own; killed, c10d would print pages of C++ frames."""
    import signal

    port = free_port()
    front, follower = (_rank("generate", 4, rank, port, "--dp_size=2") for rank in (0, 1))
    try:
        _arrived(port, 1)
        front.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        _, errors = follower.communicate(timeout=PROCESS_LIMIT_S)
    finally:
        front.send_signal(signal.SIGCONT)
        _end_all([front, follower])
    gone = "is gone" if fault == "killed" else "gave no answer for 5 s"
    assert (follower.returncode, errors.splitlines()) == (
        2, [f"{START}[0..3] failed: rank 0 stopped: its rendezvous store {gone}"]), errors


def test_a_server_on_the_rendezvous_port_is_refused_naming_both() -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "adaspec", "serve", "--nnodes=2", "--node_rank=0",
         f"--master_node_addr=127.0.0.1:{port}", f"--port={port}"], capture_output=True,
        text=True, env=peer_environment(), timeout=PROCESS_LIMIT_S, check=False)
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"adaspec serve: error: --port={port}: expected a port other than the one of "
        f"--master_node_addr=127.0.0.1:{port}, where rank 0 listens for the rendezvous"])


def test_a_rank_signalled_while_the_ranks_gather_is_named_so_by_the_others() -> None:
    import signal

    port = free_port()
    front, follower = (_rank("generate", 4, rank, port, "--dp_size=2") for rank in (0, 1))
    try:
        _arrived(port, 1)
        follower.send_signal(signal.SIGINT)
        lines = _last_lines([front, follower])
    finally:
        _end_all([front, follower])
    assert lines == [(2, f"{START}[0..3] failed: rank 1 failed to start: it was stopped (a "
                         "signal, or stop()) while the ranks gathered"),
                     (130, "adaspec generate: interrupted")]


@pytest.mark.parametrize(("command", "rank", "signal_number", "said"), [
    ("serve", 0, "SIGTERM", '"stopped"'),
    ("generate", 0, "SIGINT", "adaspec generate: interrupted"),
    ("serve", 1, "SIGTERM", '"reason": "signalled during the start, which is abandoned"'),
])
def test_a_signal_while_the_ranks_gather_ends_the_start_at_once(
        command: str, rank: int, signal_number: str, said: str) -> None:
    """The launch's other ranks never come: the wait for them would outlast the test's
    limit."""
    import signal

    port = free_port()
    ranks = [_rank(command, 4, each, port, "--dp_size=2") for each in range(rank + 1)]
    waiting = ranks[rank]
    try:
        _arrived(port, rank)
        waiting.send_signal(getattr(signal, signal_number))
        _, errors = waiting.communicate(timeout=PROCESS_LIMIT_S)
    finally:
        _end_all(ranks)
    assert waiting.returncode == (130 if signal_number == "SIGINT" else 0), errors
    assert said in errors, errors
    last = said if command == "generate" else '"stopped"'  # every serve rank ends so
    assert last in errors.splitlines()[-1], errors
    assert "Traceback" not in errors


def _end_all(ranks: list[subprocess.Popen[str]]) -> None:
    for process in ranks:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def test_the_front_takes_requests_cancels_and_stops_for_every_rank() -> None:
    runs = finish(start_ranks(2, ["--speculative_algorithm=MTP", "--num_speculative_tokens=3"],
                              program=(str(Path(__file__).with_name("runtime_peer.py")),)))
    for run in runs:
        assert run.returncode == 0, run.stderr
    front, follower = (json.loads(run.stdout) for run in runs)
    assert follower["submit_error"] == ("FollowerRefused: submit: rank 1 decodes the requests "
                                        "of rank 0, the front; submit there")
    assert follower["cancel_error"] == ("FollowerRefused: cancel: rank 1 decodes the requests "
                                        "of rank 0, the front; cancel there")
    assert front["finish"] == ["length", "cancelled", "length"]
    assert [len(t) for t in front["tokens"]][::2] == [60, 60]
    assert front["digest"] == follower["digest"]  # the cancel ended it after the same round


def test_torchrun_starts_the_ranks_of_the_same_launch(target_only_tp2: list[list[int]]) -> None:
    """torchrun's environment stands for --nnodes, --node_rank and --master_node_addr."""
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={free_port()}", "-m", "adaspec", *DECODE, "--temperature=0",
         "--speculative_algorithm=MTP", "--num_speculative_tokens=3"],
        capture_output=True, text=True, env=peer_environment(), timeout=PROCESS_LIMIT_S,
        check=False, cwd=Path(__file__).parents[1])
    assert process.returncode == 0, process.stderr
    # Not anchored to a line's start: torchrun's workers share its stderr, unbuffered, so
    # another process's line may run into one of theirs.
    digests = re.findall(r"rank ([01]): commit digest ([0-9a-f]{64})", process.stderr)
    assert sorted(rank for rank, _ in digests) == ["0", "1"], process.stderr[-3000:]
    assert len({digest for _, digest in digests}) == 1
    results = json.loads(process.stdout)["results"]
    assert [r["token_ids"] for r in results] == target_only_tp2


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("settings", "environ", "expected"), [
    ({"max_seqs_per_batch": "4"}, {}, {"max_seqs_per_batch": "4"}),
    ({}, {**TORCHRUN, "MASTER_PORT": "1"}, {
        "node_rank": "1", "nnodes": "2", "master_node_addr": "10.1.2.3:1"}),
    ({"nnodes": "02"}, TORCHRUN, {"node_rank": "1", "nnodes": "2",
                                  "master_node_addr": "10.1.2.3:29500"}),
    ({}, {**TORCHRUN, "MASTER_ADDR": "::1"}, {"node_rank": "1", "nnodes": "2",
                                              "master_node_addr": "[::1]:29500"}),
    # torchrun reads the port as the number it spells.
    ({}, {**TORCHRUN, "MASTER_PORT": "029500"}, {"node_rank": "1", "nnodes": "2",
                                                 "master_node_addr": "10.1.2.3:29500"}),
])
def test_torchrun_environment_becomes_the_rank_flags(
        settings: dict[str, str], environ: dict[str, str], expected: dict[str, str]) -> None:
    assert torchrun_settings(settings, environ) == {**settings, **expected}


def test_a_rank_flag_that_contradicts_torchrun_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"^--node_rank=0: expected 1, what torchrun set in "
                                          r"RANK, or leave the flag out under torchrun$"):
        torchrun_settings({"node_rank": "0"}, TORCHRUN)
    with pytest.raises(ConfigError, match=r"^--node_rank=²: expected 1"):  # no int() of it
        torchrun_settings({"node_rank": "²"}, TORCHRUN)


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("WORLD_SIZE", "abc", "1..65536"), ("WORLD_SIZE", "0", "1..65536"),
    ("RANK", "x", "0..1"), ("RANK", "2", "0..1"), ("MASTER_PORT", "abc", "1..65535"),
    ("LOCAL_RANK", "x", "0..1"), ("LOCAL_RANK", "2", "0..1"),
    ("LOCAL_WORLD_SIZE", "3", "1..2"), ("LOCAL_WORLD_SIZE", "0", "1..2"),
])
def test_a_torchrun_number_that_is_none_is_named_by_its_variable(
        variable: str, value: str, expected: str) -> None:
    """Not by the flag it stands for, which the user never gave."""
    with pytest.raises(ConfigError) as raised:
        torchrun_settings({}, {**TORCHRUN, variable: value})
    assert str(raised.value) == (f"{variable}={value}: expected an integer in {expected} "
                                 "(torchrun sets it; a launch by flags sets none of its "
                                 "variables)")


def test_a_local_rank_past_its_hosts_ranks_is_named_by_its_variable() -> None:
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK=1: expected an integer in 0\.\.0 "):
        torchrun_settings({}, {**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1"})


@pytest.mark.parametrize("host", ["", " ", "10.1.2.3 ", "a\tb"])
def test_a_rank_0_host_that_names_nothing_is_named_by_its_variable(host: str) -> None:
    with pytest.raises(ConfigError) as raised:
        torchrun_settings({}, {**TORCHRUN, "MASTER_ADDR": host})
    assert str(raised.value).startswith(f"MASTER_ADDR={host!r}: expected the host name or "
                                        "address of rank 0 (torchrun sets it;"), raised.value


def test_a_torchrun_environment_set_in_part_is_refused_naming_what_is_missing() -> None:
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR: expected it beside RANK, WORLD_SIZE "
                                          r"\(torchrun sets all four\), or none of them"):
        torchrun_settings({}, {"RANK": "1", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(("sizes", "message"), [
    ({"tp_size": 2.0}, r"^Runtime\(collectives\)\.tp_size=2\.0: expected a non-negative int$"),
    ({"tp_size": "2"}, r"^Runtime\(collectives\)\.tp_size=2: expected a non-negative int$"),
    ({"tp_size": 1, "dp_size": 2},
     r"^Runtime\(collectives\)\.tp_size=1: expected 2, the launch's --tp_size \(--nnodes=2\)"),
])
def test_an_engines_collectives_must_hold_the_launchs_layout(
        sizes: dict[str, object], message: str) -> None:
    class EngineCollectives(LocalCollectives):  # only the layout matters: refused at start
        pass

    collectives = EngineCollectives()
    for name, value in sizes.items():
        setattr(collectives, name, value)
    runtime = Runtime(load_config({"nnodes": 2}), collectives=collectives)
    with pytest.raises(ConfigError, match=message):
        asyncio.run(runtime.start())


def test_adaptive_draft_steps_at_tp2_calibrate_in_lockstep_and_add_no_collective(
        tmp_path: Path) -> None:
    """Both ranks run the front's calibration windows, install its table and pick the same
    depth every round from the same feedback: serving issues no collective beyond the
    round's three broadcasts (confidences, drafts, sampled tokens), one per prefill, the
    model's all-reduces and the plans."""
    settings = tmp_path / "draft-steps.json"
    settings.write_text(json.dumps({
        "version": 1, "policy": {"window_size": 4, "update_interval": 2,
                                 "switch_min_gain": 0.0},
        "calibration": {"request_buckets": [1, 2, 4], "warmup_steps": 2, "window_steps": 3,
                        "windows_per_point": 2}}))
    runs = finish(start_ranks(2, [
        "--speculative_algorithm=MTP", "--num_speculative_tokens=3", "--max_seqs_per_batch=4",
        "--enable_adaptive_draft_step=true", f"--adaptive_draft_step_config={settings}"],
        program=(str(Path(__file__).with_name("runtime_peer.py")),)))
    for run in runs:
        assert run.returncode == 0, run.stderr
    front, follower = (json.loads(run.stdout) for run in runs)
    assert front["digest"] == follower["digest"]
    assert front["calls"] == follower["calls"]
    assert front["rounds"] == follower["rounds"] > 0
    calls = front["calls"]
    assert set(calls) == {"tp_broadcast", "tp_all_reduce", "plan"}
    # Confidences, drafts and sampled tokens each round; the three arrive in one prefill.
    assert calls["tp_broadcast"] == 3 * front["rounds"] + 1


@pytest.mark.parametrize(("flags", "env", "local"), [
    ({"nnodes": 4, "node_rank": 3}, {}, 3),  # all four on the loopback: this host
    ({"nnodes": 4, "node_rank": 3, "master_node_addr": "10.0.0.7:29500"}, {}, 0),
    ({"nnodes": 4, "node_rank": 3, "master_node_addr": "10.0.0.7:29500"},
     {"LOCAL_RANK": "1"}, 1),
])
def test_each_rank_on_a_host_takes_its_own_local_index(
        monkeypatch: pytest.MonkeyPatch, flags: dict[str, Any], env: dict[str, str],
        local: int) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = load_config(flags).launch
    assert local_rank(launch) == local
    assert rank_device(launch) == torch.device("cpu")  # the cpu is shared, never indexed


def test_the_heartbeat_is_a_quarter_of_the_shortest_timeout_in_force() -> None:
    launch = load_config({"nnodes": 2, "collective_timeout_s": 40}).launch
    assert heartbeat_s(launch, LocalCollectives()) == 10.0

    class EngineCollectives(LocalCollectives):  # an engine's own, telling a shorter timeout
        timeout = datetime.timedelta(seconds=8)

    assert heartbeat_s(launch, EngineCollectives()) == 2.0


def test_a_round_that_fails_on_one_rank_stops_every_rank() -> None:
    """A fault injected on rank 1 alone (its stage hook raises in round 3's verify): rank 1
    stops serving naming the round, and the front's requests end failed with one line each,
    instead of the front committing rounds the other rank never ran."""
    runs = finish(start_ranks(2, ["--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                                  "--collective_timeout_s=10", "--peer_fail_round=3"],
                              program=(str(Path(__file__).with_name("runtime_peer.py")),)))
    for run in runs:
        assert run.returncode == 0, run.stderr
    front, follower = (json.loads(run.stdout) for run in runs)
    assert follower["serve_error"].startswith(
        "RankFault: rank 1: round 3 failed in verify (RuntimeError: injected fault in round 3); "
        "the ranks can no longer commit alike")
    assert len(front["errors"]) == 2
    for error in front["errors"]:
        assert "\n" not in error
        assert "CollectiveError: collective " in error


@pytest.mark.parametrize(("first", "second", "named"), [
    (["--num_speculative_tokens=3"], ["--num_speculative_tokens=2"],
     "--num_speculative_tokens=2: expected 3"),
    (["--prompt=ab"], ["--prompt=cd", "--prompt=ef"], "--prompt=['cd', 'ef']: expected ab"),
    ([], ["--seed=5"], "--seed=5: expected (not given)"),
    (["--seed=5"], ["--seed=+5"], "--seed=+5: expected 5"),
])
def test_a_rank_started_with_another_command_line_says_which_flag_differs(
        first: list[str], second: list[str], named: str) -> None:
    """Rank 0 alone reads the prompts and the sampling flags: a rank given others would
    silently decode rank 0's, so it is refused like a launch flag that differs."""
    port = free_port()
    line = ["generate", "--nnodes=2", f"--master_node_addr=127.0.0.1:{port}",
            "--speculative_algorithm=MTP", "--max_tokens=4", "--temperature=0"]
    own = [["--num_speculative_tokens=3", "--prompt=ab"], ["--num_speculative_tokens=3",
                                                         "--prompt=ab"]]
    for rank, flags in enumerate((first, second)):
        names = {flag.split("=", 1)[0] for flag in flags}
        own[rank] = [f for f in own[rank] if f.split("=", 1)[0] not in names] + flags
    ranks = [subprocess.Popen([sys.executable, "-m", "adaspec", *line, f"--node_rank={rank}",
                               *own[rank]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=peer_environment())
             for rank in (0, 1)]
    front, odd = finish(ranks)
    assert odd.returncode == 2
    assert odd.stderr.strip().splitlines()[-1] == (
        f"adaspec generate: error: {named}, rank 0's: every rank starts with the same "
        "command line, each flag written alike (its own --node_rank, --host and --port aside)")
    # Rank 0 names the rank and the flag too, instead of meeting its exit in a collective.
    assert front.returncode == 2
    assert front.stderr.strip().splitlines()[-1] == (
        f"adaspec generate: error: {named.replace(': expected', ': on rank 1; expected')}, "
        "rank 0's: every rank starts with the same command line, each flag written alike (its "
        "own --node_rank, --host and --port aside)")
