"""`megatrain train --gpus N`: one host's N data-parallel ranks, started by torch.distributed.run.

The command checks the settings, then runs torchrun's agent (this module, `python -m
megatrain.launch N ARGS...`) as a child in a session of its own, tied to the command's life
(lifetime.py): the agent's ranks end with it, and it with the command, however either is killed.
A rank that refuses the run (a setting, a file, the memory plan: exit 2) writes its refusal to a
folder the command names (REFUSALS_ENV) instead of its stderr; the command prints each distinct
refusal once and exits 2, without the agent's log lines and traceback for a failed child.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megatrain.lifetime import die_with_parent

REFUSALS_ENV = "MEGATRAIN_REFUSALS"


def launch(gpus: int, argv: list[str]) -> int:
    """Run `megatrain ARGV` (`train ...`) on `gpus` ranks of this host; its exit code."""
    with tempfile.TemporaryDirectory(prefix="megatrain-ranks-") as refusals:
        parent = os.getpid()
        agent = subprocess.Popen([sys.executable, "-m", "megatrain.launch", str(gpus), *argv],
                                 env={**os.environ, REFUSALS_ENV: refusals}, start_new_session=True,
                                 preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent))
        while True:
            try:
                code = agent.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C reaches this process's group only: the agent stops its ranks
                agent.send_signal(signal.SIGINT)
        said = sorted(Path(refusals).iterdir())  # rank0, rank1, ...: the first rank's first
        messages = list(dict.fromkeys(p.read_text() for p in said))
    for message in messages:
        print(f"megatrain: error: {message}", file=sys.stderr)
    if messages:
        return 2
    if code not in (0, 2, 3, 130):  # a crash: the rank's own output above says where
        print(f"megatrain: a rank ended with exit code {code} (its output above)", file=sys.stderr)
    return code


def refuse(message: str) -> bool:
    """Under `megatrain train --gpus`: this rank's refusal, written for the command to print once.
    False where the rank was started otherwise (it prints its refusal itself)."""
    folder = os.environ.get(REFUSALS_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    (Path(folder) / f"rank{int(os.environ.get('RANK', 0)):05d}").write_text(message)
    return True


def agent(gpus: int, argv: list[str]) -> int:
    """torchrun's agent, in this process: the ranks run `python -m megatrain.cli ARGV`; the first
    failed rank's exit code, without torchrun's log lines and traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    logging.disable(logging.CRITICAL)  # a refusal or crash is the ranks' to say (above); torchrun adds only noise
    try:
        run(parse_args(["--standalone", "--nproc-per-node", str(gpus), "-m", "megatrain.cli", *argv]))
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code  # a signal's death, as a shell reports it
    except SignalException as e:  # the command's Ctrl-C or a SIGTERM: torchrun stopped the ranks
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(agent(int(sys.argv[1]), sys.argv[2:]))
