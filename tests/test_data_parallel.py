"""DP shards in separate processes: the front assigns each request to the least loaded
shard, every shard decodes its own, and every rank observes every shard's retired feedback
in one order, so all shards decide the same depth and G every round.

Greedy output with DP equals one rank's (each shard runs the whole model, or its TP split),
request by request; every shard's event log replays on its own, holds its own requests and
its own allocation of the common G, and the logs agree decision by decision.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gloo_job import PROCESS_LIMIT_S, peer_environment
from rank_launch import DECODE, finish, front_tokens, kill_at_round, run_ranks, start_ranks

from adaspec.errors import ConsensusMismatch
from adaspec.policies.base import RoundFeedback
from adaspec.runtime.ranks import Delivery, ShardsView, ShardTurn

MTP = ["--speculative_algorithm=MTP", "--num_speculative_tokens=3"]
# A small calibration grid: adaptive verify calibrates at startup on every launch.
CALIBRATION = {"request_buckets": [1, 2], "warmup_steps": 1, "window_steps": 2,
               "windows_per_point": 1}


def replay(argv: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "adaspec", "replay", *argv],
                          capture_output=True, text=True, env=peer_environment(),
                          timeout=PROCESS_LIMIT_S, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


@pytest.fixture(scope="module")
def one_rank() -> list[list[int]]:
    """Target-only greedy output of one rank: what every greedy launch must give."""
    return front_tokens(run_ranks(1, [*DECODE, "--temperature=0"]), 1)


def test_dp2_adaptive_verify_decides_one_g_and_each_shard_allocates_its_own_rows(
        one_rank: list[list[int]], tmp_path: Path) -> None:
    settings = tmp_path / "calibration.json"
    settings.write_text(json.dumps(CALIBRATION))
    runs = run_ranks(2, [*DECODE, "--temperature=0", "--dp_size=2",
                         "--speculative_algorithm=DSpark", "--num_speculative_tokens=7",
                         "--enable_adaptive_target_verify=true", "--max_seqs_per_batch=4",
                         f"--adaptive_target_verify_calibration={settings}",
                         f"--event_log={tmp_path / 'run.jsonl'}"])
    assert front_tokens(runs, 1) == one_rank
    logs = [tmp_path / f"run.rank{rank}.jsonl" for rank in range(2)]
    for log in logs:  # each shard's log replays on its own: its allocation checked too
        assert "decisions match the log" in replay([str(log)])
    assert "all 2 ranks made the same" in replay([str(logs[0]), "--across", str(logs[1])])
    # A shard's log re-evaluates as the DP run it was: every shard's requests each round.
    simulated = subprocess.run([sys.executable, "-m", "adaspec", "simulate", "--json",
                                f"--workload={logs[1]}", "--policy=adaptive-verify"],
                               capture_output=True, text=True, env=peer_environment(),
                               timeout=PROCESS_LIMIT_S, check=False)
    assert simulated.returncode == 0, simulated.stderr
    fed_back = {e["round"] for e in events(logs[1]) if e["kind"] in ("round_retired",
                                                                     "shard_retired")
                and e["feedback"]["num_reqs"]}
    assert json.loads(simulated.stdout)["rounds"] == len(fed_back)
    shards = [events(log) for log in logs]
    arrived = [{e["request_id"] for e in shard if e["kind"] == "request_arrived"}
               for shard in shards]
    assert arrived == [{0, 2}, {1, 3}]  # least loaded first: the shards alternate
    rows = [[(e["round"], e["bound_rows"], e["context"]["shard_sizes"])
             for e in shard if e["kind"] == "budget_decided"] for shard in shards]
    assert rows[0] == rows[1]  # one G and one context every round, on both shards
    assert all(len(sizes) == 2 for _, _, sizes in rows[0])
    # Each shard verifies its own requests' rows of the common G.
    for shard, own in zip(shards, arrived, strict=True):
        retired = [e["feedback"] for e in shard if e["kind"] == "round_retired"]
        assert retired
        assert all(set(f["request_ids"]) <= own for f in retired)
        others = [e["feedback"] for e in shard if e["kind"] == "shard_retired"]
        assert others
        assert all(not set(f["request_ids"]) & own for f in others)


SPEC_DP2 = ("--speculative_algorithm=DSpark --num_speculative_tokens=7 "
            "--enable_adaptive_target_verify=true --enable_graph=true "
            "--python_graph_backend=eager_buckets --disable_graph_warmup=false "
            "--enable_schedule_overlap=true --enable_task_pipeline=true "
            "--enable_unified_mtp_graph=false --dp_size=2 --cp_size=1 --max_seqs_per_batch=16 "
            "--acl_graph_decode_batch_size_limit=16").split()
"""The specification's DP=2 launch line (the CPU's graph backend for aclgraph)."""


def test_the_specifications_dp2_line_runs_on_four_ranks_equal_to_tp2(
        target_only_tp2: list[list[int]], tmp_path: Path) -> None:
    """TP=2 x DP=2: each shard is a TP=2 group, so greedy output equals TP=2 target-only
    output (a row-parallel sum rounds as at TP=2, not as one rank). Calibration runs on a
    small grid in place of the default one."""
    grid = tmp_path / "calibration.json"
    grid.write_text(json.dumps(CALIBRATION))
    runs = run_ranks(4, [*DECODE, "--temperature=0", *SPEC_DP2,
                         f"--adaptive_target_verify_calibration={grid}",
                         f"--event_log={tmp_path / 'run.jsonl'}"])
    assert front_tokens(runs, 2) == target_only_tp2
    logs = [str(tmp_path / f"run.rank{rank}.jsonl") for rank in range(4)]
    across = [arg for log in logs[1:] for arg in ("--across", log)]
    assert "all 4 ranks made the same" in replay([logs[0], *across])


def test_a_request_cancelled_on_another_shard_ends_there_and_every_log_replays(
        tmp_path: Path) -> None:
    """The front cancels request 1, which shard 1 decodes, once its first tokens arrived:
    it ends cancelled, the others decode to their length, and each shard's log (the
    cancel recorded after the rounds whose tokens it kept) replays."""
    log = tmp_path / "run.jsonl"
    runs = finish(start_ranks(2, [*MTP, "--dp_size=2", f"--peer_event_log={log}"],
                              program=(str(Path(__file__).with_name("runtime_peer.py")),)))
    for run in runs:
        assert run.returncode == 0, run.stderr
    front = json.loads(runs[0].stdout)
    assert front["finish"] == ["length", "cancelled", "length"]
    logs = [str(tmp_path / f"run.rank{rank}.jsonl") for rank in range(2)]
    for path in logs:
        assert "decisions match the log" in replay([path])
    assert "all 2 ranks made the same" in replay([logs[0], "--across", logs[1]])
    ended = [e for e in events(Path(logs[1])) if e["kind"] == "request_finished"]
    assert {e["request_id"]: e["reason"] for e in ended} == {1: "cancelled"}


def test_a_killed_rank_among_four_is_named_by_every_other_rank() -> None:
    """Rank 3 (TP rank 1 of shard 1) is killed once its state trace shows round 3 under way:
    the three others exit non-zero within --collective_timeout_s, each with one line that
    names the collective it met the failure in and rank 3 as the one that stopped."""
    timeout_s = 20
    ranks = start_ranks(4, ["generate", "--max_tokens=1000", "--temperature=0", "--prompt=abc",
                            "--prompt=xyz", "--trace=-", "--dp_size=2", *MTP,
                            f"--collective_timeout_s={timeout_s}"])
    try:
        killed = kill_at_round(ranks[3], 3)
        ended = [process.communicate(timeout=PROCESS_LIMIT_S) for process in ranks[:3]]
        elapsed = time.monotonic() - killed
    finally:
        finish(ranks)
    assert elapsed < timeout_s
    for process, (_, err) in zip(ranks[:3], ended, strict=True):
        assert process.returncode != 0
        last = err.strip().splitlines()[-1]
        assert re.search(r"collective \w+ over ranks \[[0-3,.]+\] failed: "
                         r".*; rank 3 stopped$", last), last


def test_a_shard_turn_travels_as_json_and_comes_back_equal() -> None:
    feedback = RoundFeedback(round=4, num_reqs=1, num_reqs_bucket=2, width=3, depth=3,
                             num_rows=6, verify_lengths=(3,), num_accepted=(2,),
                             confidences=((0.9, 0.5, 0.25),), request_ids=(7,), shard=1)
    turn = ShardTurn(shard=1, retired=(feedback,), deliveries=(
        Delivery(id=7, tokens=(1, 2, 3), rounds=2, verified=5, accepted=4),
        Delivery(id=9, tokens=(), rounds=0, verified=0, accepted=0, end="failed",
                 message="prefill failed")), request_ids=(7, 11), max_kv_length=40,
        waiting=2, pending=True)
    assert ShardTurn.decode(turn.encode()) == turn


def test_shards_that_decided_a_round_differently_are_stopped_naming_the_values() -> None:
    alike = ShardsView((ShardTurn(shard=0, decided=(7, 3, 12)),
                        ShardTurn(shard=1, decided=(7, 3, 12))))
    alike.check_decided()
    apart = ShardsView((ShardTurn(shard=0, decided=(7, 3, 12)),
                        ShardTurn(shard=1, decided=(7, 3, 16))))
    with pytest.raises(ConsensusMismatch, match=re.escape(
            "ranks disagree on each shard's newest (round, depth, G): [7, 3, 12, 7, 3, 16]")):
        apart.check_decided()


def test_every_rank_observes_retired_feedback_by_round_then_shard() -> None:
    def feedback(round: int, shard: int) -> RoundFeedback:
        return RoundFeedback(round=round, num_reqs=0, num_reqs_bucket=1, width=3, depth=3,
                             num_rows=1, verify_lengths=(), num_accepted=(), shard=shard)

    view = ShardsView((ShardTurn(shard=0, retired=(feedback(3, 0), feedback(4, 0)),
                                 request_ids=(1,), max_kv_length=9),
                       ShardTurn(shard=1, retired=(feedback(3, 1),), request_ids=(2, 5),
                                 max_kv_length=30, waiting=1)))
    assert [(f.round, f.shard) for f in view.retired()] == [(3, 0), (3, 1), (4, 0)]
    assert (view.sizes, view.num_reqs, view.request_ids) == ((1, 2), 2, (1, 2, 5))
    assert (view.max_kv_length, view.waiting, view.pending) == (30, True, False)


def test_the_bench_runs_dp2_beside_its_dp1_twin_on_the_same_cores() -> None:
    runs = run_ranks(2, ["bench", "--json", "--dp_size=2", *MTP, "--arms=none,fixed:3",
                         "--concurrency=2", "--requests=2", "--max_tokens=8", "--passes=1"])
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert not runs[1].stdout  # the front alone reports
    report = runs[0].json()
    arms = {entry["arm"] for entry in report["arms"]}
    assert arms == {"none", "fixed:3", "none@dp1", "fixed:3@dp1"}
    assert report["greedy_outputs_identical"] is True  # DP=2 and DP=1 decode alike
    assert report["ranks_on_this_host"] == 2
