"""One declared-flags parser (``CommandFlags``) for every command: a flag without its value is
named itself, never the flag after it; a misspelled flag gets "did you mean"; a flag given
twice is refused unless declared repeatable; a flag a command does not know is refused, or
passed to the launch parser by a command that takes launch flags; ``--help`` anywhere prints
help generated from the same declaration."""

import pytest

from adaspec import cli
from adaspec.cli.bench import BENCH
from adaspec.cli.calibrate import CALIBRATE
from adaspec.cli.config import CONFIG
from adaspec.cli.flags import CommandFlags, Flag, Positional
from adaspec.cli.generate import GENERATE
from adaspec.cli.models import MODELS
from adaspec.cli.replay import REPLAY
from adaspec.cli.simulate import SIMULATE
from adaspec.cli.states import STATES
from adaspec.errors import ConfigError

TOY = CommandFlags(
    command="toy", usage="IN [--out FILE] [--tag NAME ...] [--json]", about="A toy command.",
    flags={"out": Flag(metavar="FILE", help="where to write"),
           "tag": Flag(metavar="NAME", repeat=True, help="a tag; repeat for several"),
           "json": Flag(help="print JSON")},
    positional=Positional(metavar="IN", what="input file"))
TOY_LAUNCH = CommandFlags(
    command="toyl", usage="[LAUNCH FLAGS] --count N", about="A toy command with launch flags.",
    flags={"count": Flag(metavar="N", required=True, help="how many"),
           "json": Flag(help="print JSON")},
    launch=True)
COMMANDS = {"bench": BENCH, "config": CONFIG, "models": MODELS, "states": STATES,
            "generate": GENERATE, "calibrate": CALIBRATE, "simulate": SIMULATE,
            "replay": REPLAY}


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a command line (exit 2, nothing on stdout), without its
    ``adaspec COMMAND: error:`` prefix."""
    assert cli.run(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    prefix = f"adaspec {argv[0]}: error: "
    assert captured.err.startswith(prefix)
    assert captured.err.count("\n") == 1
    return captured.err[len(prefix):].rstrip("\n")


# --- the parser ------------------------------------------------------------------------------


def test_values_switches_repeats_and_the_positional_keep_their_order() -> None:
    parsed = TOY.parse(["--tag", "a", "in.txt", "--out=o.json", "--tag=b", "--json"])
    assert parsed.given == (("tag", "a"), ("out", "o.json"), ("tag", "b"), ("json", ""))
    assert (parsed.positional, parsed.get("out"), parsed.values("tag")) == \
        ("in.txt", "o.json", ["a", "b"])
    assert "json" in parsed
    assert parsed.get("absent") is None
    assert not parsed.help


def test_a_value_that_starts_with_dashes_needs_an_equals_sign() -> None:
    assert TOY.parse(["in", "--out=--odd"]).get("out") == "--odd"
    with pytest.raises(ConfigError, match=r"^--out: expected a value \(--out FILE, or "
                                          r"--out=FILE for a value that starts with --\)$"):
        TOY.parse(["in", "--out", "--odd"])


@pytest.mark.parametrize(("argv", "message"), [
    (["in", "--out", "--json"], "--out: expected a value"),
    (["in", "--out"], "--out: expected a value"),
    (["in", "--out=a", "--out", "b"], "--out=b: given twice (first as a); give each flag once"),
    (["in", "--json", "--json"], "--json: given twice; give each flag once"),
    (["in", "--json=yes"], "--json=yes: takes no value"),
    (["in", "--ot=x"], "--ot=x: unknown flag; did you mean --out?"),
    (["in", "-json"], "-json: unknown flag; did you mean --json?"),
    (["in", "--zzz"], "--zzz: unknown flag; expected --out, --tag or --json"),
    (["in", "--dp_size=2"], "--dp_size=2: unknown flag; expected --out, --tag or --json"),
    ([], "IN: expected exactly one input file; usage: adaspec toy IN [--out FILE] "
         "[--tag NAME ...] [--json]"),
    (["a", "b"], "IN=a b: expected exactly one input file"),
])
def test_a_command_without_launch_flags_refuses_in_one_line_naming_the_flag(
        argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TOY.parse(argv)
    assert str(info.value).startswith(message)


def test_a_bare_word_after_a_switch_is_not_taken_as_its_value() -> None:
    without_positional = CommandFlags(command="bare", usage="[--json]", about="-",
                                      flags={"json": Flag(help="print JSON")})
    with pytest.raises(ConfigError, match=r"^argument=yes: expected a flag: --json \(--json "
                                          r"takes no value\)$"):
        without_positional.parse(["--json", "yes"])


def test_a_command_with_launch_flags_passes_every_other_token_on() -> None:
    parsed = TOY_LAUNCH.parse(["--dp_size", "2", "--count", "3", "--enable_graph=true",
                               "--json"])
    assert parsed.given == (("count", "3"), ("json", ""))
    assert parsed.launch_argv == ("--dp_size", "2", "--enable_graph=true")


@pytest.mark.parametrize(("argv", "message"), [
    (["--count", "--dp_size=2"], "--count: expected a value"),
    (["--cont=3"], "--cont=3: unknown flag; did you mean --count?"),
    (["--count=1", "--count=2"], "--count=2: given twice (first as 1)"),
    (["--json"], "--count: required; give --count N (adaspec toyl --help shows every flag)"),
])
def test_a_command_with_launch_flags_still_refuses_its_own_flags_misused(
        argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TOY_LAUNCH.parse(argv)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["in", "--zzz", "-h"],
                                  ["--out", "--help"]])
def test_help_anywhere_asks_for_the_help_before_any_check(argv: list[str]) -> None:
    assert TOY.parse(argv).help


# --- every command ----------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--max_tokens", "--temperature", "0", "--prompt", "x"],
     "--max_tokens: expected a value (--max_tokens N, or --max_tokens=N for "),
    (["simulate", "--workload", "--policy", "fixed:3"], "--workload: expected a value"),
    (["simulate", "--workload", "w.jsonl", "--cost_table", "--json", "--policy", "fixed:3"],
     "--cost_table: expected a value"),
    (["models", "--model", "--json"], "--model: expected a value"),
    (["bench", "--passes", "--quick"], "--passes: expected a value"),
    # A launch flag without its value is named by the launch parser, not taken from --json.
    (["calibrate", "--num_speculative_tokens", "--json"],
     "--num_speculative_tokens: missing value; expected an integer"),
    (["config", "--dp_size", "--rules"], "--dp_size: missing value; expected an integer"),
])
def test_a_flag_without_its_value_before_another_flag_is_named_itself(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal(argv, capsys).startswith(message)


@pytest.mark.parametrize(("argv", "flag"), [
    (["generate", "--prompt", "x", "--max_token=4", "--temperature=0"], "max_tokens"),
    (["generate", "--promt", "x", "--max_tokens=4", "--temperature=0"], "prompt"),
    (["simulate", "--workload", "w.jsonl", "--polcy", "fixed:3"], "policy"),
    (["models", "--mesure"], "measure"),
    (["replay", "--jsn", "run.jsonl"], "json"),
    (["calibrate", "--jsno"], "json"),
    (["states", "--diagam"], "diagram"),
    (["bench", "--quik"], "quick"),
    (["config", "--rule"], "rules"),
])
def test_a_misspelled_command_flag_gets_did_you_mean(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal(argv, capsys).endswith(f": unknown flag; did you mean --{flag}?")


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt", "x", "--seed=1", "--seed=2", "--max_tokens=4",
      "--temperature=0"], "--seed=2: given twice (first as 1); give each flag once"),
    (["generate", "--prompts_file", "a.txt", "--prompts_file", "b.txt"],
     "--prompts_file=b.txt: given twice (first as a.txt)"),
    (["simulate", "--workload", "a.jsonl", "--workload", "b.jsonl", "--policy", "fixed:3"],
     "--workload=b.jsonl: given twice (first as a.jsonl)"),
    (["models", "--json", "--json"], "--json: given twice; give each flag once"),
    (["replay", "--json", "run.jsonl", "--json"], "--json: given twice"),
    (["calibrate", "--json", "--json"], "--json: given twice"),
    (["states", "--diagram", "--diagram"], "--diagram: given twice"),
    (["config", "--rules", "--rules"], "--rules: given twice"),
    (["bench", "--passes=1", "--passes=2"], "--passes=2: given twice (first as 1)"),
])
def test_a_flag_given_twice_is_refused(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal(argv, capsys).startswith(message)


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--workload", "w.jsonl", "--policy", "fixed:3", "--dp_size=2"],
     "--dp_size=2: unknown flag; expected --workload, --cost_table, --policy or --json"),
    (["replay", "--yaml", "run.jsonl"], "--yaml: unknown flag; expected --json"),
    (["states", "--json"], "--json: unknown flag; expected --diagram"),
    (["models", "--zzz"], "--zzz: unknown flag; expected --json, --measure or --model"),
    (["states", "diagram"], "argument=diagram: expected a flag: --diagram"),
    # Commands that take launch flags hand them to the launch parser, which refuses them.
    (["generate", "--prompt=x", "--max_tokens=4", "--temperature=0", "--zzz=1"],
     "--zzz=1: unknown flag; see `adaspec generate --help` (its launch flags are those of "
     "`adaspec config --help`)"),
    (["calibrate", "--zzz=1"], "--zzz=1: unknown flag; see `adaspec calibrate --help` (its "
     "launch flags are those of `adaspec config --help`)"),
    (["config", "--rules", "--dp_size", "2"],
     "--rules: expected no launch flag with it, got --dp_size=2"),
])
def test_an_unknown_flag_is_refused(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal(argv, capsys).startswith(message)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_every_declared_flag(command: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: adaspec {command}")
    for name, flag in COMMANDS[command].flags.items():
        # A flag wider than the help column stands on its own line, its help below it.
        shown = f"  --{name}{'=' + flag.metavar if flag.metavar else ''}"
        assert f"{shown} " in text or f"{shown}\n" in text
    assert "  -h, --help" in text


@pytest.mark.parametrize("argv", [
    ["simulate", "--workload", "w.jsonl", "-h"], ["replay", "run.jsonl", "--help"],
    ["generate", "--prompt", "x", "--help"], ["models", "--zzz", "-h"],
    ["states", "--diagram", "--help"], ["config", "--dp_size=2", "-h"],
    ["calibrate", "--json", "--help"], ["bench", "--quick", "-h"]])
def test_help_anywhere_on_the_line_prints_the_commands_help(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(argv) == 0
    assert capsys.readouterr().out.startswith(f"usage: adaspec {argv[0]}")


def test_states_alone_prints_the_diagram(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["states"]) == 0
    alone = capsys.readouterr().out
    assert alone.startswith("stateDiagram-v2")
    assert cli.run(["states", "--diagram"]) == 0
    assert capsys.readouterr().out == alone


@pytest.mark.parametrize("argv", [["models", "--model="], ["generate", "--prompt=",
                                  "--max_tokens=2", "--temperature=0"],
                                  ["simulate", "--workload=", "--policy=fixed:1"],
                                  ["models", "--model", ""]])
def test_an_empty_value_is_refused_not_read_as_the_default(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Before, models --model= ran the default model and generate --prompt= a prompt of none.
    name = argv[1].split("=")[0]
    assert refusal(argv, capsys).startswith(f"{name}='': expected a value ({name}")
