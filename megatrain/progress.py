"""Progress bars for a run's long work outside its steps: filling the host store (seeded or from a
pretrained checkpoint), reading and writing the training state, writing the model. At 14B these
move 30-200 GB and take from tens of seconds to minutes; without a bar a run looks hung.

`bar` yields `advance(n)`, safe to call from the store's fill threads; the bar is drawn on stderr
(tqdm), or not at all where disabled (the ranks but the first, the harness, `--no-progress`).
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Advance = Callable[[int], None]


def nothing(n: int) -> None:
    """The `advance` of work nobody watches."""


@contextmanager
def bar(description: str, total: int, enabled: bool) -> Iterator[Advance]:
    """`advance(n)` for `total` parameters of work (counted in parameters: a tile's master, its
    moments and its shadow move together)."""
    if not enabled:
        yield nothing
        return
    from tqdm import tqdm
    lock = threading.Lock()
    with tqdm(total=total, desc=description, unit="param", unit_scale=True, file=sys.stderr,
              dynamic_ncols=True) as shown:
        def advance(n: int) -> None:
            with lock:
                shown.update(n)
        yield advance


def say(text: str, enabled: bool) -> None:
    """A line on stderr before a step of set-up that shows no bar."""
    if enabled:
        print(f"megatrain: {text}", file=sys.stderr, flush=True)
