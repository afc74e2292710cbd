"""The systems under comparison, each behind one small interface:

    system = System(spec, device)        # build the model and the optimizer
    row = system.step(microbatches)      # one optimizer step, device synchronised: {"loss": ..., ...}
    system.info()                        # what the system wants recorded once (settings, versions)
    system.save(path)                    # the trained weights as a `transformers` checkpoint (float32)
    system.close()

A constructor that finds the system cannot run here raises `Unsupported(reason)`; one that finds
the point cannot fit raises `megatrain.memory.DoesNotFit` (which memory, needed and available
bytes) before allocating anything.
"""
from __future__ import annotations

import importlib


class Unsupported(Exception):
    """This system cannot run on this machine or in this environment (the reason says why)."""


def load(name: str):
    """The System class of a named system (imported only when asked for: each has its own deps)."""
    return importlib.import_module(f"suite.systems.{name}").System
