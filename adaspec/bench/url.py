"""``adaspec bench --url URL``: the closed-loop bench against a running OpenAI-compatible
server (``adaspec serve`` or another), on the shipped prompts, so servers can be compared on
the same requests. It reports, per concurrency level, tokens/s and the TTFT, TPOT and
end-to-end latency percentiles; the exit status is 1 when any request failed."""

import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from adaspec.bench.load import (
    HttpTarget,
    LevelRun,
    LoadError,
    client_session,
    closed_loop,
    served_model,
)
from adaspec.bench.run import shipped_prompts
from adaspec.config import SamplingParams
from adaspec.config.launch import TORCHRUN_ENV
from adaspec.errors import ConfigError, printable

URL_FLAGS = ("url", "served_model_name", "quick", "concurrency", "requests", "max_tokens",
             "temperature", "top_k", "top_p", "min_p", "json")
"""The bench flags that mean something against a server; the others are refused with it:
they configure the runtime this process would run, which a server has already, or concern
its arms (``NOT_RUNTIME_FLAGS``)."""


def check_url(raw: str) -> str:
    """A server's base URL (``http://host:port``; a trailing ``/v1``, as OpenAI clients take
    it, is dropped)."""
    try:
        parts = urlsplit(raw.strip())
    except ValueError as error:  # an unclosed IPv6 bracket
        raise ConfigError("--url", raw, f"expected a server's base URL ({error})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or \
            parts.fragment:
        raise ConfigError("--url", raw, "expected a server's base URL such as "
                          "http://127.0.0.1:8000")
    try:
        port = parts.port  # a port out of range raises here
    except ValueError:
        port = 0
    if port == 0:  # no server listens on port 0: it only asks the system for a free one
        raise ConfigError("--url", raw, "expected a port in 1..65535")
    path = parts.path.rstrip("/")
    if path.endswith(ENDPOINTS):  # bench adds the endpoints: this one would be doubled
        raise ConfigError("--url", raw, f"expected a server's base URL ({parts.scheme}://"
                          f"{parts.netloc} or {parts.scheme}://{parts.netloc}/v1), not an "
                          f"endpoint's path ({path})")
    return f"{parts.scheme}://{parts.netloc}{path.removesuffix('/v1')}"


ENDPOINTS = ("/completions", "/models", "/health", "/metrics")
"""The last parts of a path that name a server's endpoint, not its base."""


NOT_RUNTIME_FLAGS = {
    "plot": "plots the tokens/s and per-position acceptance of the arms this bench would "
            "run; with --url there are no arms, and a server reports no acceptance: expected "
            "no --plot (--json gives the figures)",
    "passes": "repeats every arm this bench would run; with --url each level is one closed "
              "loop against the server: expected no --passes",
}
"""Why a bench flag that configures no runtime is refused with --url (the other flags that
do not apply configure the runtime the bench would start)."""


def refuse_runtime_flags(given: Sequence[tuple[str, str]], launch_argv: Sequence[str],
                         environ: Mapping[str, str]) -> None:
    """Refuse, in one line naming it, the first flag given that does not apply with --url,
    with the reason it does not; and a start by torchrun, whose every rank would send a
    whole load of its own."""
    launcher = next((name for name in TORCHRUN_ENV if name in environ), None)
    if launcher is not None:
        raise ConfigError(launcher, environ[launcher], "set by a launcher such as torchrun; "
                          "bench --url is one client process (each rank would send its own "
                          "load and print its own report): run it once, without the launcher")
    for name, value in given:
        if name not in URL_FLAGS:
            raise ConfigError(f"--{name}", value or True, NOT_RUNTIME_FLAGS.get(
                name, "configures the runtime this bench would start; with --url the server "
                "runs its own"))
    if launch_argv:
        name, equals, value = launch_argv[0].partition("=")
        if not equals:
            value = launch_argv[1] if len(launch_argv) > 1 else ""
        raise ConfigError(name, value, "a launch flag; with --url the server's launch is its "
                          "own")


def level_requests(count: int, temperatures: Sequence[float], params: SamplingParams
                   ) -> list[tuple[str, SamplingParams]]:
    """Request i sends prompt i // m at the (i mod m)-th of the m temperatures."""
    prompts = [p.decode("utf-8") for p in shipped_prompts()]
    m = len(temperatures)
    return [(prompts[(i // m) % len(prompts)],
             _at(params, temperatures[i % m])) for i in range(count)]


def _at(params: SamplingParams, temperature: float) -> SamplingParams:
    if temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=params.max_tokens)
    return SamplingParams(temperature=temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, max_tokens=params.max_tokens)


async def bench_url(url: str, model: str | None, levels: dict[int, int],
                    temperatures: Sequence[float], params: SamplingParams
                    ) -> tuple[str, list[LevelRun]]:
    async with client_session(max(levels)) as session:
        name = model or await served_model(url, session)
        target = HttpTarget(url, name, session)
        runs = [await closed_loop(target, level_requests(count, temperatures, params), level)
                for level, count in levels.items()]
    return name, runs


def report_text(url: str, model: str, runs: Sequence[LevelRun], header: str) -> str:
    # The model's name and the errors come from the server: escaped, so none can draw on
    # the terminal or forge a line of the report.
    lines = [f"bench of {url} (model {printable(model)}): {header}",
             f"{'C':>4} {'requests':>8} {'errors':>6} {'tok/s':>9}   "
             f"{'TTFT ms p50':>11} {'p90':>7} {'p99':>7}   {'TPOT ms p50':>11} {'p90':>7} "
             f"{'p99':>7}   {'E2E ms p50':>10} {'p90':>8} {'p99':>8}"]
    for run in runs:
        s = run.summary()
        cells = [_ms(s[k][p]) for k in ("ttft_ms", "tpot_ms", "e2e_ms")
                 for p in ("p50", "p90", "p99")]
        lines.append(f"{run.concurrency:>4} {s['requests']:>8} {s['errors']:>6} "
                     f"{s['tokens_per_second']:>9.1f}   {cells[0]:>11} {cells[1]:>7} "
                     f"{cells[2]:>7}   {cells[3]:>11} {cells[4]:>7} {cells[5]:>7}   "
                     f"{cells[6]:>10} {cells[7]:>8} {cells[8]:>8}")
        for error in s["first_errors"]:
            lines.append(f"     failed: {printable(error)}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_url(raw_url: str, model: str | None, levels: dict[int, int],
            temperatures: Sequence[float], params: SamplingParams, as_json: bool) -> int:
    url = check_url(raw_url)
    started = time.perf_counter()
    try:
        name, runs = asyncio.run(bench_url(url, model, levels, temperatures, params))
    except LoadError as error:
        raise ConfigError("--url", raw_url, str(error)) from None
    kinds = ", ".join("greedy" if t == 0 else f"temperature {t:g}" for t in temperatures)
    header = (f"{params.max_tokens} tokens per request, {kinds}, "
              f"{time.perf_counter() - started:.1f} s")
    if as_json:
        report: dict[str, Any] = {"url": url, "model": name, "max_tokens": params.max_tokens,
                                  "temperatures": list(temperatures),
                                  "levels": [run.summary() for run in runs]}
        print(json.dumps(report, indent=2))
    else:
        print(report_text(url, name, runs, header))
    sys.stdout.flush()
    return 1 if any(run.errors for run in runs) else 0
