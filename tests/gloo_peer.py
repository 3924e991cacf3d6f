"""One rank of a real gloo job, started by tests/test_collectives.py.

A process holds one default process group, so each rank is its own process. It opens
``DistributedCollectives``, runs one scenario and prints one JSON line on stdout: what the rank
ended with, or the adaspec error it raised (type and message).
"""

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from adaspec.errors import AdaspecError
from adaspec.runtime.devices.collectives import DistributedCollectives

DIED_EXIT_CODE = 3

Scenario = Callable[[DistributedCollectives, argparse.Namespace], dict[str, Any]]


def round_collectives(comm: DistributedCollectives, args: argparse.Namespace) -> dict[str, Any]:
    """The collectives of one round, in round order: consensus on the draft confidences
    [num_reqs, width], agreement on G in pack, then the sampled target token ids [G]."""
    confidences = torch.tensor(args.confidences, dtype=torch.float32)
    token_ids = torch.tensor(args.token_ids, dtype=torch.int64)
    comm.tp_broadcast(confidences)
    report: dict[str, Any] = {"confidences": confidences.tolist()}
    report["rows"] = comm.dp_agree_rows(args.rows)
    comm.tp_broadcast(token_ids)
    report["token_ids"] = token_ids.tolist()
    return report


def die(comm: DistributedCollectives, args: argparse.Namespace) -> dict[str, Any]:
    """The dying rank leaves without a goodbye. The survivor first waits for the test's
    go-ahead on stdin, sent once the dying process has exited, so it meets a dead peer."""
    if comm.rank == args.odd_rank:
        os._exit(DIED_EXIT_CODE)
    sys.stdin.readline()
    comm.tp_broadcast(torch.arange(4, dtype=torch.int64))
    return {}


def hang(comm: DistributedCollectives, args: argparse.Namespace) -> dict[str, Any]:
    """The hung rank stays alive but never joins (it waits until the test closes its stdin),
    so only the configured timeout can end the survivor's broadcast."""
    if comm.rank == args.odd_rank:
        sys.stdin.readline()
        return {}
    comm.tp_broadcast(torch.arange(4, dtype=torch.int64))
    return {}


def share(comm: DistributedCollectives, args: argparse.Namespace) -> dict[str, Any]:
    """Startup's table agreement: each rank offers its own bytes (its own fitted table),
    every rank installs rank 0's."""
    offered = json.dumps({"fitted_by": comm.rank}).encode()
    return {"installed": json.loads(comm.share_from_first_rank(offered))}


SCENARIOS: dict[str, Scenario] = {"round": round_collectives, "die": die, "hang": hang,
                                  "share": share}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--rendezvous-timeout-s", type=float, default=60.0)
    parser.add_argument("--token-ids", type=json.loads, default=[])
    parser.add_argument("--confidences", type=json.loads, default=[])
    parser.add_argument("--rows", type=int, default=0)
    parser.add_argument("--odd-rank", type=int, default=-1, help="the rank that dies or hangs")
    parser.add_argument("--engine-group", type=json.loads, default=False,
                        help="true: create the default process group before adaspec does")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.engine_group:
        # An embedding engine that set torch.distributed up before adaspec.
        torch.distributed.init_process_group("gloo", init_method=args.init_method,
                                             rank=args.rank,
                                             world_size=args.tp_size * args.dp_size)
    comm = DistributedCollectives(rank=args.rank, world_size=args.tp_size * args.dp_size,
                                  tp_size=args.tp_size, dp_size=args.dp_size,
                                  init_method=args.init_method, device="cpu",
                                  timeout=datetime.timedelta(seconds=args.timeout_s),
                                  rendezvous_timeout=datetime.timedelta(
                                      seconds=args.rendezvous_timeout_s))
    report: dict[str, Any] = {"rank": args.rank, "tp_rank": comm.tp_rank, "dp_rank": comm.dp_rank}
    start = time.monotonic()
    try:
        report.update(SCENARIOS[args.scenario](comm, args))
    except AdaspecError as error:
        report.update(error=type(error).__name__, message=str(error))
    report["elapsed_s"] = time.monotonic() - start
    comm.close()
    report["default_group_alive"] = torch.distributed.is_initialized()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
