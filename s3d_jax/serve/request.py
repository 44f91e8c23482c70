"""A request to the engine and what it hands back: its text a chunk at a time, and at the end its loop counts."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from s3d_jax.sampling import Sampling


@dataclasses.dataclass
class Delta:
    """What a request gets after each chunk: its new text and tokens, and at the end why it finished."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    drafted_iterations: int = 0  # at the end: the request's loop iterations that verified drafts, and those that took a plain step
    plain_iterations: int = 0


@dataclasses.dataclass
class Request:
    """One completion. `deliver` is called from the engine's thread with each Delta, the last one finished."""

    prompt_ids: list[int]
    max_new_tokens: int
    deliver: Callable[[Delta], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    # The engine's bookkeeping.
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    sent_text: str = ""
    # Its loop counts from the batches it left (`Lane.regroup`): iterations by drafts accepted, and plain steps.
    accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    plain_steps: int = 0

    def bank(self, accepted: np.ndarray, plain_steps: int) -> None:
        """Adds loop counts of this request's row to those it holds."""
        self.accepted = add_histograms(self.accepted, accepted)
        self.plain_steps += int(plain_steps)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, 0, self.top_p if self.temperature else 1.0)


def add_histograms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two acceptance histograms (iterations by drafts accepted) of plans of any reach, summed."""
    width = max(len(a), len(b))
    return np.pad(a, (0, width - len(a))).astype(np.int64) + np.pad(b, (0, width - len(b)))
