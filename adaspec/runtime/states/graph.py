"""The round state graph: declared once as data, checked at import, run from a table.

The declaration (``ROUND_GRAPH``) is written in the shape ``transitions`` consumes, so
``build_machine`` can hand it to a real ``transitions.Machine``; that machine is the reference
interpreter the tests compare against, never the hot path. Driving a ``Machine`` costs about a
tenth of a millisecond per round (``AsyncMachine`` several times more, and it cancels
callbacks), while a round must move between stages in microseconds, so ``RoundMachine`` runs a
lookup table derived from the same declaration. Nothing else in the package names a transition.
"""

import inspect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from transitions import Machine

from adaspec.errors import AdaspecError

NUM_SLOTS = 2
"""Pipeline slots: round n uses slot n % 2."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSpec:
    """One declared state of a round."""

    name: str
    """The glossary name (a stage name for working states)."""
    initial: bool = False
    """Every round starts here; a graph has exactly one."""
    terminal: bool = False
    """The round's outcome: no transition leaves it."""


@dataclass(frozen=True, slots=True)
class TransitionSpec:
    """One declared move: ``trigger`` (the event cause) takes a round from source to dest."""

    trigger: str
    source: str
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StateGraph:
    """A state graph as plain data, so the validator and the tests can build broken ones."""

    states: tuple[StateSpec, ...]
    transitions: tuple[TransitionSpec, ...]
    goal: str
    """The state every non-terminal state must be able to reach (a round can always finish)."""

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.states)

    @property
    def initial(self) -> str:
        """The initial state; meaningful only once ``validate`` has passed."""
        return next(spec.name for spec in self.states if spec.initial)

    @property
    def triggers(self) -> tuple[str, ...]:
        """Every declared trigger once, in declaration order."""
        return tuple(dict.fromkeys(move.trigger for move in self.transitions))


ROUND_GRAPH = StateGraph(
    states=(
        StateSpec(name="draft", initial=True),
        StateSpec(name="consensus"),
        StateSpec(name="pack"),
        StateSpec(name="verify"),
        StateSpec(name="sample"),
        StateSpec(name="commit"),
        StateSpec(name="retire"),
        StateSpec(name="retired", terminal=True),
        StateSpec(name="failed", terminal=True),
    ),
    transitions=(
        TransitionSpec("draft_done", "draft", "consensus"),
        TransitionSpec("consensus_done", "consensus", "pack"),
        TransitionSpec("pack_done", "pack", "verify"),
        TransitionSpec("verify_done", "verify", "sample"),
        TransitionSpec("sample_done", "sample", "commit"),
        TransitionSpec("commit_done", "commit", "retire"),
        TransitionSpec("retire_done", "retire", "retired"),
        TransitionSpec("fail", "draft", "failed"),
        TransitionSpec("fail", "consensus", "failed"),
        TransitionSpec("fail", "pack", "failed"),
        TransitionSpec("fail", "verify", "failed"),
        TransitionSpec("fail", "sample", "failed"),
        TransitionSpec("fail", "commit", "failed"),
        TransitionSpec("fail", "retire", "failed"),
    ),
    goal="retire",
)
"""The round: seven working states in stage order, each completed by ``<stage>_done``, any of
them failing through ``fail``; ``retired`` and ``failed`` are its two outcomes."""


class StateGraphError(AdaspecError):
    """A state graph declaration breaks a structural rule.

    ``rule`` names the rule (``one-initial``, ``dead-end``, ...), ``states`` the states at
    fault, so a test or a tool can tell failures apart without parsing the message.
    """

    def __init__(self, rule: str, states: tuple[str, ...], detail: str) -> None:
        super().__init__(rule, states, detail)
        self.rule = rule
        self.states = states
        self.detail = detail

    def __str__(self) -> str:
        return f"state graph rule {self.rule}: {self.detail}"


def _listed(names: Iterable[str]) -> str:
    return ", ".join(names)


def _check_names(graph: StateGraph) -> None:
    names = graph.state_names
    repeated = tuple(dict.fromkeys(name for name in names if names.count(name) > 1))
    if repeated:
        raise StateGraphError("unique-states", repeated,
                              f"states declared more than once: {_listed(repeated)}")
    mentioned = [graph.goal, *(n for move in graph.transitions for n in (move.source, move.dest))]
    unknown = tuple(dict.fromkeys(name for name in mentioned if name not in names))
    if unknown:
        raise StateGraphError("known-states", unknown,
                              f"undeclared states are named: {_listed(unknown)}")


def _check_initial(graph: StateGraph) -> None:
    initial = tuple(spec.name for spec in graph.states if spec.initial)
    if len(initial) != 1:
        shown = _listed(initial) or "none"
        raise StateGraphError("one-initial", initial,
                              f"expected exactly one initial state, got {len(initial)}: {shown}")


def _check_exits(graph: StateGraph) -> None:
    sources = {move.source for move in graph.transitions}
    dead = tuple(s.name for s in graph.states if not s.terminal and s.name not in sources)
    if dead:
        raise StateGraphError("dead-end", dead,
                              f"non-terminal states without an outgoing transition: "
                              f"{_listed(dead)}")
    leaking = tuple(s.name for s in graph.states if s.terminal and s.name in sources)
    if leaking:
        raise StateGraphError("terminal-exit", leaking,
                              f"terminal states with an outgoing transition: {_listed(leaking)}")


def _check_deterministic(graph: StateGraph) -> None:
    dests: dict[tuple[str, str], list[str]] = {}
    for move in graph.transitions:
        dests.setdefault((move.source, move.trigger), []).append(move.dest)
    for (source, trigger), targets in dests.items():
        if len(targets) > 1:
            raise StateGraphError("deterministic", (source,),
                                  f"trigger {trigger} from state {source} is declared "
                                  f"{len(targets)} times: {_listed(targets)}")


def _closure(start: str, edges: dict[str, set[str]]) -> set[str]:
    """Every state reachable from ``start`` along ``edges`` (``start`` included)."""
    seen, queue = {start}, deque([start])
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _check_reachability(graph: StateGraph) -> None:
    forward: dict[str, set[str]] = {}
    backward: dict[str, set[str]] = {}
    for move in graph.transitions:
        forward.setdefault(move.source, set()).add(move.dest)
        backward.setdefault(move.dest, set()).add(move.source)
    finishing = _closure(graph.goal, backward)
    stuck = tuple(s.name for s in graph.states if not s.terminal and s.name not in finishing)
    if stuck:
        raise StateGraphError("reaches-goal", stuck,
                              f"states that cannot reach {graph.goal}: {_listed(stuck)}")
    reached = _closure(graph.initial, forward)
    orphans = tuple(name for name in graph.state_names if name not in reached)
    if orphans:
        raise StateGraphError("reachable", orphans,
                              f"states unreachable from {graph.initial}: {_listed(orphans)}")


def validate(graph: StateGraph) -> None:
    """Raise ``StateGraphError`` for the first broken rule; a pure function of ``graph``.

    The rules make every round end: names are declared once and only declared names are
    used, one initial state, no dead ends and no exits from terminal states, one destination
    per (state, trigger), every non-terminal state can reach the goal, every state can be
    reached from the initial one.
    """
    _check_names(graph)
    _check_initial(graph)
    _check_exits(graph)
    _check_deterministic(graph)
    _check_reachability(graph)


def build_machine(graph: StateGraph = ROUND_GRAPH, model: Any = "self") -> Machine:
    """A ``transitions.Machine`` for ``graph``: the reference interpreter of the declaration
    (tests, tools), too slow for the per-round hot path."""
    states: list[Any] = [{"name": s.name, "final": s.terminal} for s in graph.states]
    moves: list[Any] = [{"trigger": m.trigger, "source": m.source, "dest": m.dest}
                        for m in graph.transitions]
    return Machine(model=model, states=states, transitions=moves, initial=graph.initial,
                   auto_transitions=False)


def mermaid(graph: StateGraph = ROUND_GRAPH) -> str:
    """The graph as mermaid ``stateDiagram-v2`` text, one line per declared transition."""
    lines = ["stateDiagram-v2", f"    [*] --> {graph.initial}"]
    lines += [f"    {m.source} --> {m.dest}: {m.trigger}" for m in graph.transitions]
    lines += [f"    {s.name} --> [*]" for s in graph.states if s.terminal]
    return "\n".join(lines) + "\n"


validate(ROUND_GRAPH)


class RoundState(IntEnum):
    """The states of a round, in declaration order; the values index the transition table.

    Written out rather than generated so mypy knows the members; ``_check_mirror`` fails the
    import if it ever drifts from ``ROUND_GRAPH``.
    """

    DRAFT = 0
    CONSENSUS = 1
    PACK = 2
    VERIFY = 3
    SAMPLE = 4
    COMMIT = 5
    RETIRE = 6
    RETIRED = 7
    FAILED = 8

    @property
    def label(self) -> str:
        """The glossary name, as declared (``draft``, ``retired``, ...)."""
        return self.name.lower()


def _check_mirror(graph: StateGraph) -> None:
    labels = tuple(state.label for state in RoundState)
    if labels != graph.state_names:
        raise StateGraphError("enum-mirror", labels,
                              f"RoundState {_listed(labels)} differs from the declaration "
                              f"{_listed(graph.state_names)}")


def _derive_table(graph: StateGraph) -> tuple[dict[str, RoundState], ...]:
    """Per state (by value), its triggers and their destinations; no entry means invalid."""
    table: tuple[dict[str, RoundState], ...] = tuple({} for _ in RoundState)
    for move in graph.transitions:
        table[RoundState[move.source.upper()]][move.trigger] = RoundState[move.dest.upper()]
    return table


def _derive_stages(graph: StateGraph) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """The stages (the working states, from the initial one in the order their triggers
    chain them), the trigger completing each, and the trigger failing any of them (the one
    every working state takes)."""
    working = [spec.name for spec in graph.states if not spec.terminal]
    leaving = {name: [move for move in graph.transitions if move.source == name]
               for name in working}
    shared = set.intersection(*({move.trigger for move in moves} for moves in leaving.values()))
    if len(shared) != 1:
        raise StateGraphError("one-fail-trigger", tuple(sorted(shared)),
                              "expected exactly one trigger that every working state takes")
    fail = shared.pop()
    stages: list[str] = []
    done: list[str] = []
    state = graph.initial
    while state in leaving and state not in stages:
        onward = [move for move in leaving[state] if move.trigger != fail]
        if len(onward) != 1:
            raise StateGraphError("one-done-trigger", (state,),
                                  f"{state} must complete through exactly one trigger")
        stages.append(state)
        done.append(onward[0].trigger)
        state = onward[0].dest
    if len(stages) != len(working):
        raise StateGraphError("stage-chain", tuple(set(working) - set(stages)),
                              "every working state must lie on the chain from the initial one")
    return tuple(stages), tuple(done), fail


_check_mirror(ROUND_GRAPH)
_TABLE = _derive_table(ROUND_GRAPH)
INITIAL_STATE = RoundState[ROUND_GRAPH.initial.upper()]
TERMINAL_STATES = frozenset(RoundState[s.name.upper()] for s in ROUND_GRAPH.states if s.terminal)
TRIGGERS = ROUND_GRAPH.triggers
STAGES, DONE_TRIGGERS, FAIL_TRIGGER = _derive_stages(ROUND_GRAPH)
"""The device stages of a round in order (its working states), the trigger that completes
each (``DONE_TRIGGERS[i]`` completes ``STAGES[i]``), and the one that fails any of them."""
DONE_TRIGGER: dict[str, str] = dict(zip(STAGES, DONE_TRIGGERS, strict=True))
STAGE_OF: dict[str, str] = dict(zip(DONE_TRIGGERS, STAGES, strict=True))
"""The stage each done trigger completes."""


def allowed_triggers(state: RoundState) -> tuple[str, ...]:
    """The triggers ``state`` accepts, in declaration order (none for a terminal state)."""
    return tuple(_TABLE[state])


class InvalidTransition(AdaspecError):
    """A trigger the round's current state does not accept: the caller's bug, or an event
    delivered to the wrong round. The round's state is unchanged."""

    def __init__(self, round_index: int, state: RoundState, trigger: str) -> None:
        super().__init__(round_index, state, trigger)
        self.round_index = round_index
        self.state = state
        self.trigger = trigger

    def __str__(self) -> str:
        allowed = _listed(allowed_triggers(self.state)) or "none, it is terminal"
        return (f"round {self.round_index} in state {self.state.label} cannot take trigger "
                f"{self.trigger!r} (allowed: {allowed})")


RoundHook = Callable[["RoundMachine", RoundState, RoundState, str], None]
"""Called as ``hook(machine, from_state, to_state, trigger)``."""
StageDone = Callable[["RoundMachine", str], None]
"""Called as ``completed(machine, stage)`` once a stage's done trigger moved the round."""


ENTERED = tuple(dict.fromkeys(move.dest for move in ROUND_GRAPH.transitions))
"""The states some move enters: every state but the initial one."""


class RoundHooks:
    """The hooks of a runtime, shared by all its rounds, run in registration order.

    Registration is rare and compiles, for each destination state, the tuple of hooks a move
    into it runs, so firing a trigger costs one extra tuple lookup (an empty loop when nothing
    is registered). Hooks run synchronously, one after the other, never as gathered tasks: the
    order is part of the behaviour a replay reproduces.
    """

    __slots__ = ("_by_target", "_registered")

    def __init__(self) -> None:
        self._registered: list[tuple[RoundState | None, RoundHook]] = []
        self._by_target: tuple[tuple[RoundHook, ...], ...] = tuple(() for _ in RoundState)

    def on_enter(self, state: RoundState | str, hook: RoundHook) -> None:
        """Run ``hook`` on every move into ``state`` (a ``RoundState`` or its label, such as
        ``"verify"``; not for a round created in it)."""
        if isinstance(state, str) and state.upper() in RoundState.__members__:
            state = RoundState[state.upper()]
        if not isinstance(state, RoundState):
            raise TypeError(f"on_enter(state={state!r}): expected a RoundState or one of "
                            f"{_listed(s.label for s in RoundState)}")
        if state.label not in ENTERED:  # the initial state: a round starts there, never moves in
            raise ValueError(f"on_enter(state={state.label!r}): no move ever enters it (a round "
                             f"is created in it); expected one of {_listed(ENTERED)}, or "
                             "on_transition for every move")
        self._registered.append((state, _checked_hook("on_enter", hook)))
        self._compile()

    def on_transition(self, hook: RoundHook) -> None:
        """Run ``hook`` on every move of every round."""
        self._registered.append((None, _checked_hook("on_transition", hook)))
        self._compile()

    def remove(self, hook: RoundHook) -> None:
        """Stop running ``hook`` (every registration of it)."""
        self._registered = [(state, h) for state, h in self._registered if h is not hook]
        self._compile()

    @property
    def empty(self) -> bool:
        """Whether no hook is registered: a move then runs no hook."""
        return not self._registered

    def _compile(self) -> None:
        self._by_target = tuple(
            tuple(hook for state, hook in self._registered if state is None or state is target)
            for target in RoundState)


def _checked_hook(method: str, hook: object) -> RoundHook:
    """``hook`` when it can be called as ``hook(machine, source, target, trigger)``."""
    if not callable(hook):
        raise TypeError(f"{method}(hook={hook!r}): expected a callable, called as "
                        "hook(machine, source, target, trigger)")
    try:
        inspect.signature(hook).bind(None, None, None, None)
    except TypeError:
        raise TypeError(f"{method}(hook={getattr(hook, '__qualname__', hook)!r}): expected a "
                        "callable taking (machine, source, target, trigger)") from None
    except ValueError:  # a builtin without a signature: its call will tell
        pass
    return hook


_NO_HOOKS = RoundHooks()


class RoundMachine:
    """Where one round is in the round graph, moved by ``fire``.

    A move is a transaction: the hooks for the destination run first, and the state changes
    only when all of them returned. A raising hook therefore leaves the round in its source
    state, which is always a working state, so the failure handler can still fire ``fail``.
    A move that completes a stage then tells ``completed`` (the runtime's stage event is made
    there, by the move, and nowhere else).
    """

    __slots__ = ("_completed", "_hooks", "_state", "round_index", "slot")

    def __init__(self, round_index: int, hooks: RoundHooks = _NO_HOOKS,
                 slot: int | None = None, completed: StageDone | None = None) -> None:
        self.round_index = round_index
        # The pipeline says which pipeline slot the round uses (always 0 without schedule overlap);
        # round % 2 is the two-slot default.
        self.slot = round_index % NUM_SLOTS if slot is None else slot
        self._state = INITIAL_STATE
        self._hooks = hooks
        self._completed = completed

    @property
    def state(self) -> RoundState:
        return self._state

    @property
    def terminal(self) -> bool:
        return self._state in TERMINAL_STATES

    def fire(self, trigger: str) -> RoundState:
        """Move along ``trigger`` and return the new state; ``InvalidTransition`` if the
        current state does not accept it."""
        source = self._state
        target = _TABLE[source].get(trigger)
        if target is None:
            raise InvalidTransition(self.round_index, source, trigger)
        for hook in self._hooks._by_target[target]:
            hook(self, source, target, trigger)
        self._state = target
        if self._completed is not None and trigger in STAGE_OF:
            self._completed(self, STAGE_OF[trigger])
        return target

    def __repr__(self) -> str:
        return f"RoundMachine(round={self.round_index}, state={self._state.label})"
