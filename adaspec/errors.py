"""The exceptions adaspec raises on purpose, in one place.

This module imports nothing of ours, so every layer (config, policies, runtime) may use it
without creating an import cycle. User errors carry structured attributes so an embedding
engine can map them to its own responses without parsing the message; ``str(error)`` is always
one line that names the setting, the value given and what is expected.
"""

import functools
from collections.abc import Callable
from typing import Any


class AdaspecError(Exception):
    """Base class of every error adaspec raises on purpose.

    ``str()`` of every one, subclasses included, is one line: control characters that reach
    a message (a newline in a model's own error text, an escape sequence in a name read from
    a file) are shown escaped, as ``repr`` writes them, never written raw.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__str__")
        if own is not None and not getattr(own, "_one_line", False):
            cls.__str__ = _one_line(own)  # type: ignore[method-assign]

    def __str__(self) -> str:
        return printable(super().__str__())


def _one_line(method: Callable[[Any], str]) -> Callable[[Any], str]:
    """A subclass's own ``__str__``, its control characters escaped."""
    @functools.wraps(method)
    def __str__(self: Any) -> str:
        return printable(method(self))

    __str__._one_line = True  # type: ignore[attr-defined]
    return __str__


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: object = _Missing()
"""The value of a setting that was required but not given."""

_MAX_SHOWN = 120


def show_value(value: object) -> str:
    """Render a user-supplied value the way it would be typed on a launch line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    text = str(value)
    # Keep every message on one line and short, whatever the user typed.
    if not text.isprintable() or text != text.strip() or text == "":
        text = repr(text)
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return text


def printable(text: str) -> str:
    """Escape control characters (a newline in a JSON key, say) so a message stays one line."""
    return text if text.isprintable() else repr(text)[1:-1]


def _describe(setting: str, value: object, expected: str) -> str:
    if value is MISSING:
        return f"{setting}: {expected}"
    return f"{setting}={show_value(value)}: {expected}"


class ConfigError(AdaspecError):
    """A launch flag, a JSON key or a combination of settings that adaspec rejects.

    ``setting`` is the flag (``--name``) or the key path (``file: section.key``) at fault,
    ``value`` what was given, ``expected`` what would be accepted. ``rule`` names the
    combination rule that failed, when one did.
    """

    def __init__(
        self, setting: str, value: object, expected: str, *, rule: str | None = None
    ) -> None:
        super().__init__(setting, value, expected)
        self.setting = setting
        self.value = value
        self.expected = expected
        self.rule = rule

    def __str__(self) -> str:
        return _describe(self.setting, self.value, self.expected)


class DeviceUnavailable(ConfigError):
    """The launch asks for a device this process cannot use (no GPU, no torch_npu, ...)."""


class RequestError(AdaspecError):
    """A request the runtime refuses before execution; nothing of it has run."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        super().__init__(field, value, expected)
        self.field = field
        self.value = value
        self.expected = expected

    def __str__(self) -> str:
        return _describe(f"request field {self.field}", self.value, self.expected)


class InvalidRequest(RequestError):
    """A sampling parameter outside its meaning (negative temperature, top_p above 1, ...)."""


class UnsupportedRequest(RequestError):
    """A request feature the configured runtime cannot honour exactly.

    Raised before execution, never replaced by a silent fallback (for example a positive
    temperature decoded greedily, or a penalty dropped).
    """


class DeviceLayerError(AdaspecError):
    """A failure of device work, a collective or a graph binding while the runtime runs."""


class ModelOutputError(DeviceLayerError):
    """A model method returned a tensor of another shape (or dtype) than its protocol states:
    decoding from it would give garbage, so the prefill or round it belongs to fails instead.
    ``method`` names the call (``target.verify``), ``field`` the output (``logits``)."""

    def __init__(self, method: str, field: str, expected: str, got: str) -> None:
        super().__init__(method, field, expected, got)
        self.method = method
        self.field = field
        self.expected = expected
        self.got = got

    def __str__(self) -> str:
        return (f"{self.method} returned {self.field} {self.got}: expected {self.expected}")


class CollectiveError(DeviceLayerError):
    """A collective failed or timed out: a peer died, hung, or the transport broke.

    ``op`` names the collective (``tp_broadcast``, ``dp_agree_rows``), ``group`` the ranks it
    spanned and ``reason`` what the backend reported, on one line.
    """

    def __init__(self, op: str, group: tuple[int, ...], reason: str) -> None:
        super().__init__(op, group, reason)
        self.op = op
        self.group = group
        self.reason = reason

    def __str__(self) -> str:
        return f"collective {self.op} over ranks [{rank_runs(self.group)}] failed: {self.reason}"


def rank_runs(ranks: tuple[int, ...]) -> str:
    """Ranks as comma-separated runs, ``0..1023`` for three or more consecutive ones, so a
    message about a large world stays a short line."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}..{run[-1]}" if len(run) > 2 else ",".join(map(str, run))
                    for run in runs)


class ConsensusMismatch(DeviceLayerError):
    """Ranks that must decide identically did not (a bug, never a user error): continuing
    would make the ranks issue different collectives and hang."""

    def __init__(self, what: str, values: tuple[int, ...]) -> None:
        super().__init__(what, values)
        self.what = what
        self.values = values

    def __str__(self) -> str:
        return f"ranks disagree on {self.what}: {list(self.values)}"


class GraphBindingMissing(DeviceLayerError):
    """No prepared binding serves a shape, not even the full-width fallback; serving never
    captures one, so this means startup did not prepare what the runtime uses."""

    def __init__(self, key: tuple[int, int, int, int], prepared: int, last: str = "G") -> None:
        super().__init__(key, prepared, last)
        self.key = key
        self.prepared = prepared
        self.last = last  # what the key's last entry is: G, or a draft binding's depth

    def __str__(self) -> str:
        slot, width, num_reqs, value = self.key
        if self.last == "depth":
            return (f"no prepared draft binding for slot={slot} width={width} Bcap={num_reqs} "
                    f"depth={value} ({self.prepared} depths prepared at startup for this "
                    "bucket)")
        return (f"no prepared graph binding for slot={slot} width={width} Bcap={num_reqs} "
                f"G={value} nor its full-width binding ({self.prepared} bindings prepared "
                "at startup for this slot)")


class HostReadError(DeviceLayerError):
    """Device-stage code read a tensor value back to the host while reads were forbidden."""


class StreamClosed(DeviceLayerError):
    """Work was enqueued on a device stream after ``close()``: a bug of the caller, which must
    stop submitting rounds before it closes the stream."""

    def __init__(self, device: object) -> None:
        super().__init__(device)
        self.device = device

    def __str__(self) -> str:
        return f"the {self.device} stream is closed; no work can be enqueued after close()"


class EventLogError(AdaspecError):
    """An event log that cannot be written, or read back as one.

    ``path`` is the file, ``line`` the 1-based line at fault (``None`` when the fault is the
    file as a whole: missing, empty, already existing) and ``reason`` what is wrong there.
    """

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        super().__init__(path, line, reason)
        self.path = path
        self.line = line
        self.reason = reason

    def __str__(self) -> str:
        where = f"event log {self.path}"
        if self.line is not None:
            where += f", line {self.line}"
        return (f"{where}: {self.reason}")


class OutputWriteError(AdaspecError):
    """An output the run was asked to write (the state trace, an event log) could not be
    written to the end: the run itself went on, and this is raised when the output closes.

    ``setting`` names where the output was asked for (``--trace``, ``ADASPEC_TRACE``,
    ``RuntimeOptions.event_log``), ``path`` the file and ``reason`` what the system said.
    """

    def __init__(self, setting: str, path: str, what: str, reason: str) -> None:
        super().__init__(setting, path, what, reason)
        self.setting = setting
        self.path = path
        self.what = what
        self.reason = reason

    def __str__(self) -> str:
        return _describe(self.setting, self.path, f"cannot write the {self.what} "
                         f"({self.reason}); what it holds is incomplete, the run went on "
                         "without it")


class ReplayMismatch(AdaspecError):
    """Replaying an event log did not reproduce it: a policy decided otherwise than recorded,
    or a recorded decision saw feedback newer than the lag allows.

    ``round`` and ``decision`` (``depth`` or ``budget``) locate the first such finding;
    ``reason`` says what differs.
    """

    def __init__(self, round: int, decision: str, reason: str) -> None:
        super().__init__(round, decision, reason)
        self.round = round
        self.decision = decision
        self.reason = reason

    def __str__(self) -> str:
        return (f"replay of round {self.round} ({self.decision} decision): "
                          f"{self.reason}")


class IncompatibleCostTable(AdaspecError):
    """A saved cost table was made for another launch: costs of another model, algorithm,
    width, parallel layout, graph mode, geometry or device would price this one wrongly.

    ``field`` is the compatibility field that differs, ``saved`` its value in the table,
    ``launch`` the value of this launch.
    """

    def __init__(self, path: str, field: str, saved: object, launch: object) -> None:
        super().__init__(path, field, saved, launch)
        self.path = path
        self.field = field
        self.saved = saved
        self.launch = launch

    def __str__(self) -> str:
        return (f"--adaptive_target_verify_cost_table={self.path}: {self.field} is "
                          f"{show_value(self.saved)} in the saved table but "
                          f"{show_value(self.launch)} in this launch; calibrate this launch "
                          "(drop the flag) or give a table saved by a matching one")
