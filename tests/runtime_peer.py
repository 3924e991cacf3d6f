"""One rank of a multi-rank runtime, driven through the Python API; started by
tests/test_ranks.py. Every rank runs the same launch flags with its own --node_rank and
prints one JSON line: what it saw."""

import asyncio
import json
import sys
from typing import Any

from adaspec.config import load_config_from_argv
from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError
from adaspec.runtime.engine import Runtime


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


async def follower(runtime: Runtime) -> dict[str, Any]:
    report: dict[str, Any] = {}
    try:
        runtime.submit([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    except AdaspecError as error:
        report["submit_error"] = f"{type(error).__name__}: {error}"
    await runtime.serve()
    return report


def calls(runtime: Runtime) -> dict[str, int]:
    return dict(getattr(runtime.collectives, "calls", {}))


async def main(argv: list[str]) -> None:
    runtime = Runtime(load_config_from_argv(argv))
    await runtime.start()
    started = calls(runtime)  # startup (calibration included) left out
    rounds = runtime.statistics().rounds_submitted
    report = await (front(runtime) if runtime.is_front else follower(runtime))
    served = {op: count - started.get(op, 0) for op, count in calls(runtime).items()
              if count > started.get(op, 0)}
    report.update(rank=runtime.rank, digest=runtime.commit_digest(), calls=served,
                  rounds=runtime.statistics().rounds_submitted - rounds)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
