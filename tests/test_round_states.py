"""The round state graph: the table engine behaves exactly like a transitions.Machine built from
the same declaration, the validator rejects broken declarations with pinned messages, hooks run
in registration order, and the diagram shows every declared transition."""

import itertools
import random
import re
from collections.abc import Callable
from dataclasses import replace

import pytest
from transitions import MachineError

from adaspec.runtime.states import (
    DONE_TRIGGER,
    DONE_TRIGGERS,
    FAIL_TRIGGER,
    INITIAL_STATE,
    ROUND_GRAPH,
    STAGE_OF,
    STAGES,
    TRIGGERS,
    InvalidTransition,
    RoundHook,
    RoundHooks,
    RoundMachine,
    RoundState,
    StateGraph,
    StateGraphError,
    StateSpec,
    TransitionSpec,
    build_machine,
    mermaid,
    validate,
)

# An undeclared trigger too: both interpreters must reject it from every state.
ALPHABET = (*TRIGGERS, "no_such_trigger")

Trace = list[tuple[bool, str]]  # per event: accepted?, state after it


class _Model:
    """transitions adds ``state`` and ``trigger`` to the model it drives."""

    state: str
    trigger: Callable[[str], bool]


class Reference:
    """The declaration run by a real transitions.Machine: the oracle for the table engine."""

    def __init__(self) -> None:
        self.model = _Model()
        self.machine = build_machine(model=self.model)

    def reset(self) -> None:
        self.machine.set_state(ROUND_GRAPH.initial, model=self.model)

    def fire(self, trigger: str) -> bool:
        try:
            self.model.trigger(trigger)
        except (MachineError, AttributeError):
            return False
        return True

    def trace(self, events: tuple[str, ...]) -> Trace:
        self.reset()
        return [(self.fire(trigger), self.model.state) for trigger in events]


def table_trace(events: tuple[str, ...]) -> Trace:
    round_states = RoundMachine(0)
    trace = []
    for trigger in events:
        try:
            round_states.fire(trigger)
        except InvalidTransition:
            trace.append((False, round_states.state.label))
        else:
            trace.append((True, round_states.state.label))
    return trace


def disagreements(reference: Reference, sequences: list[tuple[str, ...]]) -> list[str]:
    return [f"{events}: table {table_trace(events)} machine {reference.trace(events)}"
            for events in sequences if table_trace(events) != reference.trace(events)]


def random_walk(reference: Reference, rng: random.Random) -> tuple[str, ...]:
    """Mostly triggers the current state accepts (so walks get deep), sometimes any trigger."""
    reference.reset()
    events = []
    for _ in range(rng.randint(1, 12)):
        accepted = reference.machine.get_triggers(reference.model.state)
        trigger = rng.choice(accepted if accepted and rng.random() < 0.7 else ALPHABET)
        reference.fire(trigger)
        events.append(trigger)
    return tuple(events)


def full_paths() -> list[tuple[str, ...]]:
    """Every trigger sequence from the initial state to a terminal one, from the declaration."""
    paths: list[tuple[str, ...]] = []
    stack: list[tuple[str, tuple[str, ...]]] = [(ROUND_GRAPH.initial, ())]
    terminal = {s.name for s in ROUND_GRAPH.states if s.terminal}
    while stack:
        state, events = stack.pop()
        if state in terminal:
            paths.append(events)
        stack += [(m.dest, (*events, m.trigger)) for m in ROUND_GRAPH.transitions
                  if m.source == state]
    return sorted(paths)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


# --- the table engine agrees with transitions.Machine ---------------------------------------

def test_table_agrees_with_machine_on_every_sequence_up_to_length_4(
        reference: Reference) -> None:
    sequences = [events for length in range(1, 5)
                 for events in itertools.product(ALPHABET, repeat=length)]
    assert len(sequences) == sum(len(ALPHABET) ** n for n in range(1, 5))
    assert disagreements(reference, sequences) == []


def test_table_agrees_with_machine_on_seeded_random_walks_up_to_length_12(
        reference: Reference) -> None:
    rng = random.Random(20240613)
    walks = [random_walk(reference, rng) for _ in range(3000)]
    assert max(len(w) for w in walks) == 12
    assert any(table_trace(w)[-1][1] == "retired" for w in walks)  # walks do get deep
    assert disagreements(reference, walks) == []


def test_table_agrees_with_machine_on_every_full_path(reference: Reference) -> None:
    paths = full_paths()
    # one success path and one failure from each of the seven working states
    assert len(paths) == 8
    for events in paths:
        assert table_trace(events) == reference.trace(events)
        assert all(accepted for accepted, _ in table_trace(events))


def test_table_agrees_with_machine_on_every_trigger_from_every_reachable_state(
        reference: Reference) -> None:
    # The prefixes of the full paths reach every state, the deep ones included.
    prefixes = {path[:n] for path in full_paths() for n in range(len(path) + 1)}
    reached = {table_trace(p)[-1][1] if p else ROUND_GRAPH.initial for p in prefixes}
    assert reached == set(ROUND_GRAPH.state_names)
    sequences = [(*prefix, trigger) for prefix in sorted(prefixes) for trigger in ALPHABET]
    assert disagreements(reference, sequences) == []


def test_a_round_runs_the_stages_in_order_and_retires() -> None:
    round_states = RoundMachine(5)
    assert round_states.state is INITIAL_STATE is RoundState.DRAFT
    visited = [round_states.fire(f"{stage}_done") for stage in STAGES]
    assert visited == [RoundState.CONSENSUS, RoundState.PACK, RoundState.VERIFY,
                       RoundState.SAMPLE, RoundState.COMMIT, RoundState.RETIRE,
                       RoundState.RETIRED]
    assert round_states.terminal
    assert round_states.slot == 1


def test_working_states_are_the_device_stages() -> None:
    working = tuple(s.name for s in ROUND_GRAPH.states if not s.terminal)
    assert working == STAGES
    assert TRIGGERS == (*(f"{stage}_done" for stage in STAGES), "fail")


def test_an_invalid_trigger_names_round_state_and_trigger_and_changes_nothing() -> None:
    round_states = RoundMachine(3)
    round_states.fire("draft_done")
    message = "round 3 in state consensus cannot take trigger 'pack_done' " \
              "(allowed: consensus_done, fail)"
    with pytest.raises(InvalidTransition, match=re.escape(message)) as info:
        round_states.fire("pack_done")
    assert (info.value.state, info.value.trigger) == (RoundState.CONSENSUS, "pack_done")
    assert round_states.state is RoundState.CONSENSUS


def test_a_terminal_round_accepts_no_trigger() -> None:
    round_states = RoundMachine(0)
    round_states.fire("fail")
    message = "round 0 in state failed cannot take trigger 'fail' (allowed: none, it is terminal)"
    with pytest.raises(InvalidTransition, match=re.escape(message)):
        round_states.fire("fail")


# --- the validator --------------------------------------------------------------------------

def with_states(*extra: StateSpec) -> tuple[StateSpec, ...]:
    return (*ROUND_GRAPH.states, *extra)


def with_moves(*extra: TransitionSpec) -> tuple[TransitionSpec, ...]:
    return (*ROUND_GRAPH.transitions, *extra)


def initial_at(*names: str) -> tuple[StateSpec, ...]:
    return tuple(replace(s, initial=s.name in names) for s in ROUND_GRAPH.states)


BROKEN = {
    "two initial states": (
        replace(ROUND_GRAPH, states=initial_at("draft", "pack")),
        "one-initial", "expected exactly one initial state, got 2: draft, pack"),
    "no initial state": (
        replace(ROUND_GRAPH, states=initial_at()),
        "one-initial", "expected exactly one initial state, got 0: none"),
    "a state that cannot reach retire": (
        replace(ROUND_GRAPH, states=with_states(StateSpec(name="stall")),
                transitions=with_moves(TransitionSpec("stall", "draft", "stall"),
                                       TransitionSpec("wait", "stall", "stall"),
                                       TransitionSpec("fail", "stall", "failed"))),
        "reaches-goal", "states that cannot reach retire: stall"),
    "a dead end": (
        replace(ROUND_GRAPH, states=with_states(StateSpec(name="limbo")),
                transitions=with_moves(TransitionSpec("give_up", "draft", "limbo"))),
        "dead-end", "non-terminal states without an outgoing transition: limbo"),
    "a terminal state with an exit": (
        replace(ROUND_GRAPH, transitions=with_moves(TransitionSpec("retry", "failed", "draft"))),
        "terminal-exit", "terminal states with an outgoing transition: failed"),
    "a nondeterministic trigger": (
        replace(ROUND_GRAPH, transitions=with_moves(TransitionSpec("draft_done", "draft", "pack"))),
        "deterministic",
        "trigger draft_done from state draft is declared 2 times: consensus, pack"),
    "a state declared twice": (
        replace(ROUND_GRAPH, states=with_states(StateSpec(name="pack"))),
        "unique-states", "states declared more than once: pack"),
    "an undeclared state": (
        replace(ROUND_GRAPH, transitions=with_moves(TransitionSpec("skip", "draft", "nowhere"))),
        "known-states", "undeclared states are named: nowhere"),
    "an unreachable state": (
        replace(ROUND_GRAPH, states=with_states(StateSpec(name="orphan")),
                transitions=with_moves(TransitionSpec("fail", "orphan", "failed"),
                                       TransitionSpec("resume", "orphan", "retire"))),
        "reachable", "states unreachable from draft: orphan"),
}


def test_the_round_graph_is_valid() -> None:
    validate(ROUND_GRAPH)


@pytest.mark.parametrize(("graph", "rule", "detail"), BROKEN.values(), ids=BROKEN.keys())
def test_the_validator_rejects_a_broken_declaration(
        graph: StateGraph, rule: str, detail: str) -> None:
    with pytest.raises(StateGraphError, match=re.escape(f"state graph rule {rule}: {detail}")) \
            as info:
        validate(graph)
    assert info.value.rule == rule
    assert "\n" not in str(info.value)


# --- hooks ----------------------------------------------------------------------------------

Call = tuple[str, RoundMachine, RoundState, RoundState, str]


def recorder(calls: list[Call], name: str) -> RoundHook:
    """A hook that appends its name and arguments to ``calls``."""

    def hook(round_states: RoundMachine, source: RoundState, target: RoundState,
             trigger: str) -> None:
        calls.append((name, round_states, source, target, trigger))

    return hook


def test_hooks_run_in_registration_order_with_the_move_as_arguments() -> None:
    calls: list[Call] = []
    hooks = RoundHooks()
    hooks.on_transition(recorder(calls, "first"))
    hooks.on_enter(RoundState.CONSENSUS, recorder(calls, "on consensus"))
    hooks.on_transition(recorder(calls, "last"))
    round_states = RoundMachine(4, hooks)
    round_states.fire("draft_done")
    move = (round_states, RoundState.DRAFT, RoundState.CONSENSUS, "draft_done")
    assert calls == [("first", *move), ("on consensus", *move), ("last", *move)]


def test_each_move_runs_each_hook_once() -> None:
    calls: list[Call] = []
    hooks = RoundHooks()
    hooks.on_transition(recorder(calls, "every"))
    hooks.on_enter(RoundState.RETIRED, recorder(calls, "retired"))
    hooks.on_enter(RoundState.FAILED, recorder(calls, "failed"))
    round_states = RoundMachine(0, hooks)
    for stage in STAGES:
        round_states.fire(f"{stage}_done")
    moves = [(c[2].label, c[3].label, c[4]) for c in calls if c[0] == "every"]
    assert moves == [(a, b, f"{a}_done") for a, b in zip(STAGES, (*STAGES[1:], "retired"),
                                                         strict=True)]
    assert [c[0] for c in calls].count("retired") == 1
    assert "failed" not in [c[0] for c in calls]


def test_hooks_are_shared_by_rounds_and_see_their_round() -> None:
    calls: list[Call] = []
    hooks = RoundHooks()
    first, second = RoundMachine(6, hooks), RoundMachine(7, hooks)
    hooks.on_transition(recorder(calls, "every"))  # registered after the rounds exist
    second.fire("fail")
    first.fire("draft_done")
    assert [(c[1].round_index, c[1].slot, c[4]) for c in calls] == [(7, 1, "fail"),
                                                                   (6, 0, "draft_done")]


def test_a_raising_hook_propagates_and_leaves_the_round_able_to_fail() -> None:
    calls: list[Call] = []

    def broken(round_states: RoundMachine, source: RoundState, target: RoundState,
               trigger: str) -> None:
        raise RuntimeError("target forward could not be submitted")

    hooks = RoundHooks()
    hooks.on_enter(RoundState.VERIFY, broken)
    hooks.on_transition(recorder(calls, "after the broken one"))
    round_states = RoundMachine(2, hooks)
    round_states.fire("draft_done")
    round_states.fire("consensus_done")
    calls.clear()
    with pytest.raises(RuntimeError, match="target forward could not be submitted"):
        round_states.fire("pack_done")
    assert calls == []  # hooks after the raising one do not run
    assert round_states.state is RoundState.PACK
    assert round_states.fire("fail") is RoundState.FAILED
    assert calls == [("after the broken one", round_states, RoundState.PACK, RoundState.FAILED,
                      "fail")]


def test_a_hook_on_entering_the_initial_state_is_refused_as_it_could_never_run() -> None:
    calls: list[Call] = []
    hooks = RoundHooks()
    for state in (RoundState.DRAFT, "draft"):
        with pytest.raises(ValueError, match=r"^on_enter\(state='draft'\): no move ever enters "
                                             r"it \(a round is created in it\); expected one of "
                                             r"consensus, pack, .*, failed, or on_transition"):
            hooks.on_enter(state, recorder(calls, "draft"))
    assert hooks.empty


# --- the diagram ----------------------------------------------------------------------------

def test_the_stages_and_their_triggers_are_derived_from_the_graph() -> None:
    working = tuple(spec.name for spec in ROUND_GRAPH.states if not spec.terminal)
    assert STAGES == working  # declared in stage order
    for index, (stage, trigger) in enumerate(zip(STAGES, DONE_TRIGGERS, strict=True)):
        machine = RoundMachine(0)
        for earlier in DONE_TRIGGERS[:index]:
            machine.fire(earlier)
        assert machine.state.label == stage
        after = STAGES[index + 1] if index + 1 < len(STAGES) else "retired"
        assert machine.fire(trigger).label == after
        assert (STAGE_OF[trigger], DONE_TRIGGER[stage]) == (stage, trigger)
    for index in range(len(STAGES)):
        machine = RoundMachine(0)
        for earlier in DONE_TRIGGERS[:index]:
            machine.fire(earlier)
        assert machine.fire(FAIL_TRIGGER).label == "failed"


def test_a_graph_whose_stages_do_not_chain_is_refused() -> None:
    from adaspec.runtime.states.graph import _derive_stages

    forked = replace(ROUND_GRAPH, transitions=(
        *ROUND_GRAPH.transitions, TransitionSpec("skip", "draft", "pack")))
    with pytest.raises(StateGraphError) as raised:
        _derive_stages(forked)
    assert raised.value.rule == "one-done-trigger"


def test_completed_is_told_each_stage_a_move_completes_and_nothing_else() -> None:
    told: list[tuple[int, str]] = []
    machine = RoundMachine(4, completed=lambda states, stage: told.append(
        (states.round_index, stage)))
    for trigger in DONE_TRIGGERS[:3]:
        machine.fire(trigger)
    with pytest.raises(InvalidTransition):
        machine.fire(DONE_TRIGGERS[0])  # refused: no move, nothing told
    machine.fire(FAIL_TRIGGER)
    assert told == [(4, stage) for stage in STAGES[:3]]


def test_mermaid_shows_every_declared_transition() -> None:
    lines = mermaid().splitlines()
    assert lines[0] == "stateDiagram-v2"
    body = [line.strip() for line in lines[1:]]
    moves = [f"{m.source} --> {m.dest}: {m.trigger}" for m in ROUND_GRAPH.transitions]
    assert body == ["[*] --> draft", *moves, "retired --> [*]", "failed --> [*]"]


def test_hooks_that_could_never_run_are_refused_when_registered() -> None:
    hooks = RoundHooks()
    with pytest.raises(TypeError, match=r"^on_transition\(hook=None\): expected a callable"):
        hooks.on_transition(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"taking \(machine, source, target, trigger\)$"):
        hooks.on_transition(lambda: None)  # type: ignore[arg-type,misc]
    for state in (99, "nope"):
        with pytest.raises(TypeError, match=rf"^on_enter\(state={state!r}\): expected a "
                                            "RoundState or one of draft, consensus"):
            hooks.on_enter(state, lambda *args: None)  # type: ignore[arg-type]
    assert hooks.empty
    seen: list[str] = []
    hooks.on_enter("consensus", lambda machine, source, target, trigger: seen.append(trigger))
    machine = RoundMachine(0, hooks)
    machine.fire(DONE_TRIGGERS[0])
    assert seen == [DONE_TRIGGERS[0]]  # a state's label names it as well as the enum
