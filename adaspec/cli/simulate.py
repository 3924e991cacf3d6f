"""``adaspec simulate``: evaluate policies offline on a workload and a saved cost bundle.

    adaspec simulate --workload FILE [--cost_table FILE] --policy NAME [--policy NAME ...]
                     [--json]

The workload is a JSON-lines file (``docs/workload.md``) or a recorded event log, so a real
run can be re-evaluated under another policy; an event log that carries its cost table needs
no ``--cost_table``. No model is loaded and torch is not imported.
"""

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from adaspec.cli.flags import CommandFlags, Flag
from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.config.files import json_fault, past_int_digits, read_json_object
from adaspec.config.paths import read_regular
from adaspec.errors import MISSING, ConfigError, EventLogError, IncompatibleCostTable
from adaspec.policies.bundles import CostBundle, load_bundle
from adaspec.policies.simulate import (
    WORKLOAD_FORMAT,
    SimulationResult,
    Workload,
    WorkloadRequest,
    WorkloadRound,
    covered_contexts,
    make_policies,
    parse_workload,
    rounds_outside_contexts,
    simulate,
)

if TYPE_CHECKING:  # the runtime's modules load only for an event log
    from adaspec.runtime.events.replay import RecordedRun
    from adaspec.runtime.events.types import Event

SIMULATE = CommandFlags(
    command="simulate",
    usage="--workload FILE [--cost_table FILE] --policy NAME\n[--policy NAME ...] [--json]",
    about="Runs each policy over the workload through the runtime's lag (decisions for round n "
          "see feedback through n-2) and tier rules, pricing every round with the saved cost "
          "bundle.",
    flags={
        "workload": Flag(metavar="FILE", required=True, help="JSON lines (see "
                         "docs/workload.md) or an event log of a recorded run"),
        "cost_table": Flag(metavar="FILE", help="a bundle saved by "
                           "--adaptive_target_verify_cost_table_output (optional for an event "
                           "log that carries its table)"),
        "policy": Flag(metavar="NAME", repeat=True, required=True, help="fixed:K (K in "
                       "1..width), adaptive-depth, adaptive-verify, oracle (best G per round), "
                       "oracle-depth (best depth per round); repeat to compare several"),
        "json": Flag(help="print one JSON object instead of a table"),
    })


def run(argv: Sequence[str]) -> int:
    args = SIMULATE.parse(argv)
    if args.help:
        print(SIMULATE.help())
        return 0
    workload, run = read_workload(args["workload"])
    policies = args.values("policy")
    _check_policy_names(policies, run)
    table = args.get("cost_table")
    costs = _costs(table, run, workload.name)
    for spec in policies:  # every name checked before any policy runs
        make_policies(spec, costs, workload.width)
    settings = None if run is None else run.depth_settings
    results = [simulate(spec, workload, costs, table or "log", settings) for spec in policies]
    report = _report(workload, costs, results)
    if run is not None:  # a policy the header records but its config does not make
        report["recorded_policies_not_the_launchs"] = list(run.not_the_launchs)
    if "adaptive-depth" in policies:  # which settings it ran with: the log's, or defaults
        report["adaptive_depth_settings"] = {
            **DraftStepPolicyConfig(**settings or {}).as_dict(),
            "from": "the defaults" if run is None or settings is None
            else run.depth_settings_from}
    if "json" in args:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0


def _check_policy_names(policies: Sequence[str], run: "RecordedRun | None") -> None:
    """Each policy once, and no draft-depth policy on a recorded run that drafts no depths."""
    for index, spec in enumerate(policies):
        if spec in policies[:index]:
            raise ConfigError("--policy", spec, "given twice; name each policy once")
        algorithm = None if run is None else run.launch.speculative_algorithm
        if algorithm not in (None, "MTP") and spec in ("adaptive-depth", "oracle-depth"):
            raise ConfigError("--policy", spec, f"chooses MTP draft depths; the event log "
                              f"records a {algorithm} run")


def read_workload(path: str) -> tuple[Workload, "RecordedRun | None"]:
    """The workload of a file, and the checked run when the file is an event log."""
    text = _read_text(path)
    if text.startswith("\ufeff"):  # json refuses it, and the header would not be named
        raise ConfigError("--workload", path, "starts with a byte-order mark; expected UTF-8 "
                          "JSON lines without one")
    if not text.strip():
        raise ConfigError("--workload", path, "empty file; expected a workload (JSON lines, "
                          "docs/workload.md) or an event log")
    if _header_format(text, path) == WORKLOAD_FORMAT:
        return parse_workload(json_lines(text), path), None
    from adaspec.runtime.events.log import read_event_log
    from adaspec.runtime.events.replay import check_recorded_run

    try:
        header, events = read_event_log(path)
        run = check_recorded_run(header, events, path)
    except EventLogError as error:  # named as a workload's faults are: the flag, file, line
        where = path if error.line is None else f"{path}:{error.line}"
        raise ConfigError("--workload", where, error.reason) from None
    return _workload_of_run(run, events, path), run


def json_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: broken at newlines only, a carriage return before one
    dropped. ``str.splitlines`` would also break at U+2028 or U+0085, which a JSON string may
    hold as they are."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _header_format(text: str, path: str) -> str:
    """The ``format`` of the first non-blank line, which must be a workload's or an event
    log's. The parsed value decides, not the text: an event log's header may well mention
    "adaspec-workload" elsewhere (a cost table's file name, say)."""
    number, line = next((n, line) for n, line in enumerate(json_lines(text), start=1)
                        if line.strip())
    try:
        header = json.loads(line)
    except ValueError as error:
        if past_int_digits(error):  # an object all the same: not a line of no format
            raise ConfigError("--workload", f"{path}:{number}",
                              f"invalid JSON: {json_fault(error)}") from None
        header = None
    except RecursionError:
        header = None
    given = header.get("format", MISSING) if isinstance(header, dict) else MISSING
    from adaspec.runtime.events.log import FORMAT as EVENT_LOG_FORMAT

    if given in (WORKLOAD_FORMAT, EVENT_LOG_FORMAT):
        return str(given)
    accepted = (f'"{WORKLOAD_FORMAT}" (a workload, docs/workload.md) or "{EVENT_LOG_FORMAT}" '
                "(an event log)")
    if given is MISSING:
        ending = "" if "\n" in text or "\r" not in line else (
            "; its lines end in a carriage return alone, where JSON Lines end each in a "
            "newline")
        raise ConfigError("--workload", f"{path}:{number}", "expected a first line that is "
                          f'a JSON object with "format": {accepted}{ending}')
    raise ConfigError("--workload", f"{path}:{number}", f"format={json.dumps(given)[:80]}: "
                      f"expected {accepted}")


MAX_WORKLOAD_BYTES = 256 << 20
"""A workload or event log is read whole: a hundred thousand synthetic rounds take about 110
MiB, and a /proc file that reads without end stops here."""


def _read_text(path: str) -> str:
    """The file's text; a FIFO or a device is refused before reading a byte (one could block
    forever), like the config readers refuse them."""
    data = read_regular("--workload", path, "workload file", MAX_WORKLOAD_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("--workload", path, "cannot be read (UnicodeDecodeError); "
                          "expected UTF-8 text") from None


def _workload_of_run(run: "RecordedRun", events: Sequence["Event"], path: str) -> Workload:
    """Where the run verified fewer drafts than the width and all of them were accepted, the
    full-width acceptance is unknown: the recorded count stands in as a lower bound and the
    request is marked censored. A DP shard's log holds every shard's feedback (its own
    rounds' and the others'): a round of the workload holds every shard's requests."""
    from adaspec.runtime.events.types import BudgetDecided, RoundRetired, ShardRetired

    width = run.launch.num_speculative_tokens
    kv = {e.round: e.context.max_kv_length for e in events if isinstance(e, BudgetDecided)}
    by_round: dict[int, list[WorkloadRequest]] = {}
    for event in events:
        if not isinstance(event, RoundRetired | ShardRetired):
            continue
        feedback = event.feedback
        if feedback.num_reqs == 0:  # every entry had finished in an earlier round
            continue
        if not feedback.confidences or not feedback.request_ids:
            raise ConfigError("--workload", path, f"round {feedback.round} records no "
                              "confidences or request ids; the run cannot be re-evaluated")
        by_round.setdefault(feedback.round, []).extend(
            WorkloadRequest(id=rid, confidences=tuple(conf), accepted=accepted,
                            censored=accepted == length < width, shard=feedback.shard)
            for rid, conf, accepted, length in zip(
                feedback.request_ids, feedback.confidences, feedback.num_accepted,
                feedback.verify_lengths, strict=True))
    rounds = [WorkloadRound(requests=tuple(sorted(requests, key=lambda r: r.shard)),
                            kv_length=kv.get(number))
              for number, requests in sorted(by_round.items())]
    if not rounds:
        raise ConfigError("--workload", path, "the event log has no retired round")
    return Workload(width=width, rounds=tuple(rounds), name=path, source=path,
                    dp_size=run.launch.dp_size)


def _costs(path: str | None, run: "RecordedRun | None", log: str) -> CostBundle:
    if path is not None:
        costs = load_bundle(path, read_json_object("cost_table", path), flag="--cost_table",
                            verify=False)
        if run is not None:
            _check_for_run(costs, run, path, log)
        return costs
    if run is not None and run.costs is not None:
        return run.costs
    raise ConfigError("--cost_table", MISSING, "required (the workload carries no cost table)")


def _check_for_run(costs: CostBundle, run: "RecordedRun", path: str, log: str) -> None:
    """Refuse a table the recorded run's launch would have refused: its prices are another
    launch's (algorithm, width, parallel layout, graphs, device, geometry or models)."""
    from adaspec.runtime.events.replay import check_table_for_run, table_difference

    try:
        check_table_for_run(costs, run, path)
    except IncompatibleCostTable as error:
        raise ConfigError("--cost_table", path, f"{table_difference(error, 'the recorded run')} "
                          f"{log}; expected a table saved by a launch like the run's") from None


def _report(workload: Workload, costs: CostBundle, results: list[SimulationResult]
            ) -> dict[str, Any]:
    fixed = [r for r in results if r.policy.startswith("fixed:")]
    best = max(fixed, key=lambda r: r.tokens_per_second) if fixed else None
    oracle = next((r for r in results if r.policy == "oracle"), None)
    oracle_depth = next((r for r in results if r.policy == "oracle-depth"), None)
    rows = []
    for result in results:
        row = result.as_dict()
        if best is not None:
            row["vs_best_fixed"] = round(result.tokens_per_second / best.tokens_per_second, 4)
        if oracle is not None:
            row["vs_oracle"] = round(result.tokens_per_second / oracle.tokens_per_second, 4)
        if oracle_depth is not None:
            row["vs_oracle_depth"] = round(result.tokens_per_second
                                           / oracle_depth.tokens_per_second, 4)
        rows.append(row)
    return {"workload": workload.name, "rounds": len(workload.rounds),
            "width": workload.width, "cost_table": costs.source,
            "kv_intervals": covered_contexts(costs),
            "rounds_outside_kv_intervals": rounds_outside_contexts(workload, costs),
            "best_fixed": best.policy if best else None, "policies": rows,
            "acceptance_length": "accepted + 1 (counts the residual or bonus token)"}


def _ratio(value: float | None) -> str:
    """A ratio column's cell: a dash where the policy it compares with was not run."""
    return "-" if value is None else f"{value:.3f}"


def _shown(text: str) -> str:
    """A name read from a file (the workload's, a path) as the table shows it: itself when
    printable, else quoted with its control characters escaped, so no escape sequence
    reaches the terminal and the header stays one line. A name of nothing but spaces (or
    with them at its ends) is quoted too, so it is seen."""
    return text if text.isprintable() and text == text.strip() and text else repr(text)


def _rounds(count: int) -> str:
    return f"{count} round" if count == 1 else f"{count} rounds"


def _table(report: dict[str, Any]) -> str:
    name = _shown(report["workload"]) if report["workload"] else "(unnamed)"
    lines = [f"workload {name}: {_rounds(report['rounds'])}, width "
             f"{report['width']}; costs from {_shown(report['cost_table'])}",
             f"{'policy':16} {'tokens/round':>12} {'AL':>6} {'ms/round':>9} {'tokens/s':>10} "
             f"{'vs best fixed':>13} {'vs oracle':>9}"]
    for row in report["policies"]:
        lines.append(f"{row['policy']:16} {row['tokens_per_round']:12.3f} "
                     f"{row['mean_acceptance_length']:6.3f} "
                     f"{row['predicted_cost_ms_per_round']:9.3f} "
                     f"{row['predicted_tokens_per_second']:10.1f} "
                     f"{_ratio(row.get('vs_best_fixed')):>13} {_ratio(row.get('vs_oracle')):>9}")
    lines.append("AL = accepted + 1 (counts the residual or bonus token); ms/round and tokens/s "
                 "are predicted from the cost table, not measured")
    outside = report["rounds_outside_kv_intervals"]
    if outside:
        lines.append(f"{outside} of {_rounds(report['rounds'])} "
                     f"{'has' if outside == 1 else 'have'} a KV length outside the cost "
                     f"table's intervals ({report['kv_intervals']}); "
                     f"{'its' if outside == 1 else 'their'} time is predicted from the "
                     "nearest interval")
    roles = report.get("recorded_policies_not_the_launchs")
    if roles:
        from adaspec.runtime.events.replay import not_the_launchs_note

        lines += map(not_the_launchs_note, roles)
    depth = report.get("adaptive_depth_settings")
    if depth is not None:
        values = ", ".join(f"{key}={value}" for key, value in depth.items() if key != "from")
        lines.append(f"adaptive-depth settings: {values} (from {depth['from']})")
    if "vs_best_fixed" not in report["policies"][0]:
        lines.append("vs best fixed: - (no fixed:K policy given)")
    if "vs_oracle" not in report["policies"][0]:
        lines.append("vs oracle: - (the oracle policy not given)")
    return "\n".join(lines)
