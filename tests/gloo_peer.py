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
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.models.layers import Block
from adaspec.models.parallel import split_blocks
from adaspec.models.protocols import ContextRows, VerifyRows
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


def _serve(models: ReferenceModels, prompts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every serving entry point of the reference models once: prefill, a packed verify, an
    MTP step after publishing the prompts, a DSpark block."""
    kv_slots = torch.arange(len(prompts))
    for model in (models.target, models.mtp):
        model.allocate(len(prompts))
    out = models.target.prefill(prompts, kv_slots)
    anchor = out.last.logits.argmax(-1)
    rows = VerifyRows.from_requests(
        [(int(slot), int(length), [int(token)] * 3)
         for slot, length, token in zip(kv_slots, out.lengths, anchor, strict=True)],
        num_rows=8, num_reqs=len(prompts), rows_per_req=3, scratch_kv_slot=len(prompts))
    verified = models.target.verify(rows)
    models.mtp.publish(ContextRows.of_prompts(out, prompts, kv_slots, anchor))
    step = models.mtp.step(out.last.hidden, anchor, out.lengths - 1, kv_slots)
    block = models.dspark.draft(out.last.hidden, anchor, out.lengths - 1, kv_slots, 7)
    return {"prefill": out.last.logits, "verify": verified.logits, "mtp": step.logits,
            "dspark": block.confidences, "dspark_tokens": block.token_ids}


def _block_parameters(model: torch.nn.Module) -> int:
    """The projection weights of a model's transformer blocks (what TP splits; the norms
    stay whole)."""
    return sum(p.numel() for m in model.modules() if isinstance(m, Block)
               for p in m.parameters() if p.dim() == 2)


def tp_models(comm: DistributedCollectives, args: argparse.Namespace) -> dict[str, Any]:
    """The reference models split across the TP group against a whole copy in this process:
    the largest difference of each output, and the parameters each rank keeps."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (length,), generator=generator) for length in (40, 17)]
    whole = _serve(load_reference_models(), prompts)
    models = load_reference_models()
    sizes = {}
    for name in ("target", "mtp", "dspark"):
        model = getattr(models, name)
        before = _block_parameters(model)
        split_blocks(model, comm.tp_rank, comm.tp_size, comm.tp_all_reduce)
        sizes[name] = [before, _block_parameters(model)]
    split = _serve(models, prompts)
    return {"sizes": sizes, "cache_heads": models.target.cache.keys[0].shape[2],
            "max_diff": {k: (split[k] - whole[k]).abs().max().item() for k in whole},
            "tokens": split["dspark_tokens"].tolist()}


SCENARIOS: dict[str, Scenario] = {"round": round_collectives, "die": die, "hang": hang,
                                  "share": share, "tp_models": tp_models}


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
