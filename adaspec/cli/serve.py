"""``adaspec serve``: an OpenAI-compatible HTTP server over the runtime.

    adaspec serve [LAUNCH FLAGS] [--served_model_name NAME] [--max_queued_requests N]
                  [--seed S] [--event_log FILE] [--trace FILE]

It listens on the launch's ``--host``/``--port`` (rank 0 of a multi-rank launch; the other
ranks decode its requests) and logs one JSON line per event on stderr: listening, ready, one
per completion request, draining, stopped. See ``adaspec.serve`` for the routes.
"""

import sys
from collections.abc import Sequence

from adaspec.cli import interrupts
from adaspec.cli.calibrate import progress_reporter
from adaspec.cli.flags import (
    RUN_FLAGS,
    CommandFlags,
    Flag,
    check_runnable_here,
    launch_settings,
    output_named_by_flag,
)
from adaspec.cli.generate import check_outputs
from adaspec.config import load_config
from adaspec.config.builtin import uses_builtin_models
from adaspec.config.launch import LaunchConfig, integer_text
from adaspec.config.requests import MAX_SEED
from adaspec.errors import ConfigError, OutputWriteError
from adaspec.models.launch import checkpoint_models, command_tokenizer
from adaspec.runtime.engine import Runtime, RuntimeOptions, rank_device

MAX_QUEUED_REQUESTS = 1 << 16

SERVE = CommandFlags(
    command="serve",
    usage="[LAUNCH FLAGS] [--served_model_name NAME] [--max_queued_requests N] [--seed S] "
          "[--event_log FILE] [--trace FILE]",
    about="Serves the OpenAI completions API (POST /v1/completions, streamed or whole; GET "
          "/v1/models, /health, /metrics) over the runtime, on the launch's --host and --port "
          "(default 127.0.0.1:8000), with the built-in reference models (byte-level: a "
          "prompt's token ids are its UTF-8 bytes) or the Hugging Face checkpoint directories "
          "of --model=DIR and --draft_model=DIR (their tokenizer reads prompts and stop "
          "strings). /health answers 503 until the models are "
          "loaded, the graphs prepared and the costs calibrated. SIGTERM or Ctrl-C drains: "
          "requests in flight end, new ones get 503; a second signal cancels them. Launch "
          "flags are those of `adaspec config --help`.",
    flags={
        "served_model_name": Flag(metavar="NAME", help="the model name requests give "
                                  "(default: the --model value)"),
        "max_queued_requests": Flag(metavar="N", help="most requests in flight, waiting "
                                    "or decoding; beyond, a request gets 429 (default 1024)"),
        **RUN_FLAGS,
    },
    launch=True)


def _integer(name: str, raw: str | None, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    value = integer_text(raw)
    if value is None or not low <= value <= high:
        raise ConfigError(f"--{name}", raw, f"expected an integer in {low}..{high}")
    return value


def _model_name(raw: str | None, model: str) -> str:
    if raw is None:
        return model
    if not raw.strip() or not raw.isprintable() or len(raw) > 256:
        raise ConfigError("--served_model_name", raw, "expected a printable name of 1..256 "
                          "characters")
    return raw


def temperature_rule(launch: LaunchConfig) -> str | None:
    """Why this launch needs each request's temperature given (the runtime's own rules)."""
    if launch.enable_adaptive_target_verify:
        return ("this server verifies a budget chosen each round (adaptive target verify) and "
                "needs every request's temperature: 0 for greedy decoding, above 0 to sample")
    if launch.enable_unified_mtp_graph:
        return ("this server captures greedy rounds only (unified MTP graphs); expected "
                "temperature 0")
    return None


def _check_own_ports(launch: LaunchConfig) -> None:
    """Rank 0 of several listens twice, for HTTP and for the rendezvous: on one port, the
    rendezvous would find it taken by this very server."""
    if launch.world_size > 1 and launch.node_rank == 0 and \
            launch.master_node_addr.rpartition(":")[2] == str(launch.port):
        raise ConfigError("--port", launch.port, "expected a port other than the one of "
                          f"--master_node_addr={launch.master_node_addr}, where rank 0 "
                          "listens for the rendezvous")


def run(argv: Sequence[str]) -> int:
    from adaspec.serve.app import ServeSettings
    from adaspec.serve.server import check_listenable, follow_front, json_logger, serve_http

    parsed = SERVE.parse(argv)
    if parsed.help:
        print(SERVE.help())
        return 0
    config = load_config(launch_settings(parsed.launch_argv, "serve"))
    launch = config.launch
    tokenizer, _ = command_tokenizer(launch)
    serve = ServeSettings(
        model_name=_model_name(parsed.get("served_model_name"), launch.model),
        max_queued_requests=_integer("max_queued_requests", parsed.get("max_queued_requests"),
                                     1024, 1, MAX_QUEUED_REQUESTS),
        temperature_rule=temperature_rule(launch))
    seed = _integer("seed", parsed.get("seed"), 0, 0, MAX_SEED - 1)
    outputs = {name: value for name, value in parsed.given if name in ("event_log", "trace")}
    check_outputs(outputs, launch)
    check_runnable_here(launch)
    _check_own_ports(launch)
    options = RuntimeOptions(seed=seed, event_log=outputs.get("event_log"),
                             trace=outputs.get("trace"),
                             calibration_progress=progress_reporter(sys.stderr),
                             command_flags=parsed.given)
    if launch.node_rank == 0 and not uses_builtin_models(launch):  # they load before it listens
        check_listenable(launch.host, launch.port)
    models = checkpoint_models(launch, rank_device(launch))
    runtime = Runtime(config, models=models, options=options)
    log = json_logger(sys.stderr)
    try:
        if launch.node_rank != 0:  # the same launch line on every rank: rank 0 serves HTTP
            interrupts.run(follow_front(runtime, log))
            return 0
        interrupts.run(serve_http(runtime, tokenizer, serve, host=launch.host,
                               port=launch.port, log=log))
    except OutputWriteError as error:  # the trace or event log, said when the runtime stops
        raise output_named_by_flag(error) from None
    return 0
