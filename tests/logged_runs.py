"""Request events for the synthetic runs of the replay tests, as a runtime logs them: every
request a round holds arrives before the first round and finishes after the last."""

import dataclasses

from adaspec.config import SamplingParams
from adaspec.runtime.events.types import (
    STAGES,
    Event,
    RequestArrived,
    RequestFinished,
    StageCompleted,
)

MAX_TOKENS = 64
SAMPLING = dataclasses.asdict(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def stages(round: int) -> list[Event]:
    """A round's stages, completed in order (it may retire after the last)."""
    return [StageCompleted(round=round, slot=round % 2, stage=stage) for stage in STAGES]


def with_requests(events: list[Event], count: int) -> list[Event]:
    """``events`` between the arrival of requests 0..count-1 and their end: cancelled after
    the rounds, as a synthetic run's feedback need not add up to the tokens of a request
    that decoded to its max_tokens."""
    arrived = [RequestArrived(request_id=id, num_prompt_tokens=8, sampling=SAMPLING)
               for id in range(count)]
    finished = [RequestFinished(request_id=id, reason="cancelled", num_tokens=1)
                for id in range(count)]
    return [*arrived, *events, *finished]
