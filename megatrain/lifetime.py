"""A process that ends with the one that started it: no rank, worker or job trains on as an orphan.

`die_with_parent` asks the kernel (Linux's PR_SET_PDEATHSIG) to signal this process when its parent
dies, however it dies, SIGKILL included: a torchrun agent's ranks (megatrain's own and the harness's
workers under it, from the import of the megatrain package on: `end_with_launcher`), the harness's
worker (suite.runner), a workflow job's shell (workflows/job_shell.py, which asks it alike). Only
the standard library here: the package imports this first.
"""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send this process `sig` when its parent dies (elsewhere than Linux nothing);
    exit at once if the parent (`parent`, else the current one) is already gone."""
    parent = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def end_with_launcher(env=os.environ) -> None:
    """A rank (torchrun's WORLD_SIZE above 1) ends with the process that started it, torchrun's
    agent: an agent killed outright takes its ranks with it instead of leaving them to train on."""
    if int(env.get("WORLD_SIZE", 1)) > 1:
        die_with_parent(signal.SIGKILL)
