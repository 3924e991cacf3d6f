"""What HTTP costs: the same closed-loop load through ``adaspec serve`` and in this process.

    python benchmarks/serve_overhead.py [--concurrency 16] [--passes 6] [--requests 32]
                                        [--max_tokens 64] [LAUNCH FLAGS]

A server process and a runtime in this process start with the same launch line (default:
DSpark, width 5, the built-in models). Each pass sends the same greedy requests on the shipped
prompts through both (``adaspec.bench.load.closed_loop``, one level), the order alternating
from pass to pass; the figure is the ratio of HTTP tokens/s to in-process tokens/s, per pass
and as a geometric mean, with the greedy texts of both checked equal. The client shares the
host with the server, as a load generator on the same machine does.
"""

import argparse
import asyncio
import json
import math
import subprocess
import sys
import threading

import aiohttp

from adaspec.bench.load import HttpTarget, LevelRun, RuntimeTarget, closed_loop
from adaspec.bench.run import shipped_prompts
from adaspec.config import SamplingParams, load_config_from_argv
from adaspec.runtime.engine import Runtime, RuntimeOptions

DEFAULT_LAUNCH = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5"]


def start_server(launch: list[str], port: int) -> subprocess.Popen[str]:
    """``adaspec serve`` with ``launch`` on ``port``, once its "ready" line is out."""
    server = subprocess.Popen([sys.executable, "-m", "adaspec", "serve", f"--port={port}",
                               *launch], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              text=True)
    assert server.stderr is not None
    for line in server.stderr:
        if '"event": "ready"' in line:
            break
    else:
        raise SystemExit(f"adaspec serve exited with status {server.wait()} before it was ready")
    # Keep reading its log so its pipe never fills.
    threading.Thread(target=server.stderr.read, daemon=True).start()
    return server


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def measure(args: argparse.Namespace, launch: list[str]) -> dict[str, object]:
    prompts = [p.decode("utf-8") for p in shipped_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    requests = [(prompts[i % len(prompts)], params) for i in range(args.requests)]
    runtime = Runtime(load_config_from_argv(launch), options=RuntimeOptions())
    await runtime.start()
    port = free_port()
    server = start_server(launch, port)
    ratios, texts_equal = [], True
    rows: list[dict[str, object]] = []
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
            http = HttpTarget(f"http://127.0.0.1:{port}", "builtin:target", session)
            local = RuntimeTarget(runtime)
            await closed_loop(http, requests[:args.concurrency], args.concurrency)  # warm
            await closed_loop(local, requests[:args.concurrency], args.concurrency)
            for number in range(args.passes):
                order = [("http", http), ("in-process", local)]
                runs: dict[str, LevelRun] = {}
                for name, target in order if number % 2 == 0 else order[::-1]:
                    runs[name] = await closed_loop(target, requests, args.concurrency)
                assert not runs["http"].errors, runs["http"].errors[:3]
                ratio = runs["http"].tokens_per_second / runs["in-process"].tokens_per_second
                ratios.append(ratio)
                texts_equal &= [t.text for t in runs["http"].done] == \
                    [t.text for t in runs["in-process"].done]
                rows.append({"pass": number + 1, "ratio": round(ratio, 3),
                             **{f"{name} tok/s": round(run.tokens_per_second, 1)
                                for name, run in runs.items()},
                             **{f"{name} TTFT p50 ms": run.summary()["ttft_ms"]["p50"]
                                for name, run in runs.items()}})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=120)
        await runtime.stop()
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return {"launch": launch, "concurrency": args.concurrency, "requests": args.requests,
            "max_tokens": args.max_tokens, "passes": rows,
            "http_over_in_process_geomean": round(mean, 3),
            "range": [round(min(ratios), 3), round(max(ratios), 3)],
            "greedy_texts_equal": texts_equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=64)
    args, launch = parser.parse_known_args()
    report = asyncio.run(measure(args, launch or DEFAULT_LAUNCH))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
