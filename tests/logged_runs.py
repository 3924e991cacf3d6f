"""Request events for the synthetic runs of the replay tests, as a runtime logs them: every
request a round holds arrives before the first round and finishes after the last."""

import dataclasses

from adaspec.config import SamplingParams
from adaspec.runtime.events.types import Event, RequestArrived, RequestFinished

MAX_TOKENS = 64
SAMPLING = dataclasses.asdict(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def with_requests(events: list[Event], count: int) -> list[Event]:
    """``events`` between the arrival of requests 0..count-1 and their end."""
    arrived = [RequestArrived(request_id=id, num_prompt_tokens=8, sampling=SAMPLING)
               for id in range(count)]
    finished = [RequestFinished(request_id=id, reason="length", num_tokens=MAX_TOKENS)
                for id in range(count)]
    return [*arrived, *events, *finished]
