"""Request events for the synthetic runs of the replay tests, as a runtime logs them: every
request a round holds arrives before the first round and finishes after the last."""

import dataclasses
from collections.abc import Callable

from adaspec.config import SamplingParams
from adaspec.runtime.events.types import (
    Event,
    RequestArrived,
    RequestFinished,
    RoundRetired,
    StageCompleted,
)
from adaspec.runtime.states import STAGES

MAX_TOKENS = 1024  # more than any synthetic run delivers
SAMPLING = dataclasses.asdict(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def stages(round: int) -> list[Event]:
    """A round's stages, completed in order (it may retire after the last)."""
    return [StageCompleted(round=round, slot=round % 2, stage=stage) for stage in STAGES]


def with_requests(events: list[Event], count: int,
                  prompts: Callable[[int], int] = lambda id: 8) -> list[Event]:
    """``events`` between the arrival of requests 0..count-1 (request ``id`` with
    ``prompts(id)`` prompt tokens) and their end: cancelled after the rounds, holding the
    prefill's token and accepted + 1 of each round fed back."""
    arrived = [RequestArrived(request_id=id, num_prompt_tokens=prompts(id), sampling=SAMPLING)
               for id in range(count)]
    tokens = dict.fromkeys(range(count), 1)
    for event in events:
        if isinstance(event, RoundRetired):
            for id, accepted in zip(event.feedback.request_ids, event.feedback.num_accepted,
                                    strict=True):
                tokens[id] += accepted + 1
    finished = [RequestFinished(request_id=id, reason="cancelled", num_tokens=tokens[id])
                for id in range(count)]
    return [*arrived, *events, *finished]
