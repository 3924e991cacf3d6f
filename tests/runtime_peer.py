"""One rank of a multi-rank runtime, driven through the Python API; started by
tests/test_ranks.py. Every rank runs the same launch flags with its own --node_rank and
prints one JSON line: what it saw."""

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from adaspec.config import load_config_from_argv
from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError
from adaspec.runtime.engine import Runtime, RuntimeOptions


async def front(runtime: Runtime) -> dict[str, Any]:
    """Three requests; the second is cancelled once its first tokens arrived; stop() while
    the others still decode must still finish them."""
    params = SamplingParams(temperature=0.0, max_tokens=60)
    handles = [runtime.submit(list(prompt), params)
               for prompt in (b"The king", b"Hamlet. To be", b"ROMEO: I")]
    async for _ in handles[1]:
        handles[1].cancel()
        break
    await runtime.stop()
    results = [await handle.result() for handle in handles]
    return {"finish": [r.finish_reason for r in results],
            "tokens": [list(r.token_ids) for r in results]}


async def failed_follower(runtime: Runtime) -> dict[str, Any]:
    try:
        await runtime.serve()
    except AdaspecError as error:
        return {"serve_error": f"{type(error).__name__}: {error}"}
    return {}


async def follower(runtime: Runtime) -> dict[str, Any]:
    report: dict[str, Any] = {}
    try:
        runtime.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    except AdaspecError as error:
        report["submit_error"] = f"{type(error).__name__}: {error}"
    try:
        runtime.cancel(0)
    except AdaspecError as error:
        report["cancel_error"] = f"{type(error).__name__}: {error}"
    await runtime.serve()
    return report


def calls(runtime: Runtime) -> dict[str, int]:
    return dict(getattr(runtime.collectives, "calls", {}))


FAIL_FLAG = "--peer_fail_round="
"""The peer's own flag (not a launch flag): this rank's stage hook raises in the verify
stage of that round, an injected fault on one rank only."""


def injected_fault(round_to_fail: int) -> Callable[[int, str], None]:
    def hook(round: int, stage: str) -> None:
        if round == round_to_fail and stage == "verify":
            raise RuntimeError(f"injected fault in round {round}")
    return hook


async def one_sided_fault(runtime: Runtime) -> dict[str, Any]:
    """The front's view of a round that failed on another rank: its requests end failed."""
    handles = [runtime.submit(list(prompt), SamplingParams(temperature=0.0, max_tokens=200))
               for prompt in (b"The king", b"ROMEO: I")]
    errors = []
    for handle in handles:
        try:
            await handle.result()
        except AdaspecError as error:
            errors.append(str(error))
    await runtime.stop()
    return {"errors": errors}


LOG_FLAG = "--peer_event_log="
"""The peer's own flag: the event log every rank writes (its rank in the file name)."""


async def main(argv: list[str]) -> None:
    failing = [arg for arg in argv if arg.startswith(FAIL_FLAG)]
    logs = [arg[len(LOG_FLAG):] for arg in argv if arg.startswith(LOG_FLAG)]
    argv = [arg for arg in argv if not arg.startswith((FAIL_FLAG, LOG_FLAG))]
    options = RuntimeOptions(event_log=logs[0] if logs else None)
    config = load_config_from_argv(argv)
    if failing and config.launch.node_rank != 0:
        options = RuntimeOptions(stage_hook=injected_fault(int(failing[0][len(FAIL_FLAG):])))
    runtime = Runtime(config, options=options)
    await runtime.start()
    started = calls(runtime)  # startup (calibration included) left out
    rounds = runtime.statistics().rounds_submitted
    if failing:
        report = await (one_sided_fault(runtime) if runtime.is_front
                        else failed_follower(runtime))
        report.update(rank=runtime.rank)
        print(json.dumps(report), flush=True)
        return
    report = await (front(runtime) if runtime.is_front else follower(runtime))
    served = {op: count - started.get(op, 0) for op, count in calls(runtime).items()
              if count > started.get(op, 0)}
    report.update(rank=runtime.rank, digest=runtime.commit_digest(), calls=served,
                  rounds=runtime.statistics().rounds_submitted - rounds)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
