"""The worker's start: forked from the runner's imports where it can be, else a fresh interpreter.

A point's worker imports torch, transformers and the suite before it does anything (3 s on the
2-core CPU machine, 10-12 s on the four-GPU host), all of which `suite run` has imported already
to check the spec. There, one worker on one GPU is forked from the runner instead: the child
takes its own session, environment, output and working directory as the fresh process would, and
runs suite.worker. A fork is only as good as the parent's state:
- CUDA: torch marks a child forked after its parent's first CUDA call, and such a child replaces
  itself by the fresh interpreter (`exec`), so a runner that touched the GPU still gets a working
  point, only not the saved seconds. `suite run` checks the spec with NVML's count of the GPUs
  (PYTORCH_NVML_BASED_CUDA_CHECK), not CUDA's.
- OpenMP: a child of a process whose OpenMP threads ran can wait forever for threads it does not
  have, so only a caller that ran no tensor work asks for the fork (`suite run`, not a test
  process or a library caller of run_point).
- Exit: the child leaves by `os._exit` once its output is flushed; the runner's exit handlers
  (the point's temporary folder among them) are the runner's.
Several ranks (torchrun) or a system without `os.pidfd_open` start the fresh process.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable


class Forked:
    """A forked worker as the runner watches it, as a Popen would: its pid, a wait with a timeout
    (on a pidfd: no polling), its return code (a signal's as its negative number)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._fd = os.pidfd_open(pid)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            poll = select.poll()
            poll.register(self._fd, select.POLLIN)
            if not poll.poll(None if timeout is None else max(0, round(timeout * 1000))):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            os.close(self._fd)
        return self.returncode


def start(command: list[str], log_file, env: dict, cwd: Path, preexec: Callable[[], None],
          fork: bool) -> subprocess.Popen | Forked:
    """`command` (`python -m suite.worker SPEC RESULT`, or torchrun's) with its output in
    `log_file`, in a session of its own, `preexec` run in it first: forked from this process where
    `fork` and the system allow (module docstring), else as a new process."""
    if not (fork and hasattr(os, "pidfd_open")):
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=preexec, cwd=cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    ready, told = os.pipe()
    pid = os.fork()
    if pid:
        os.close(told)
        os.read(ready, 1)  # its session exists: the runner may signal it as a group from now on
        os.close(ready)
        return Forked(pid)
    code = 1
    try:
        os.close(ready)
        os.setsid()
        os.write(told, b"1")
        os.close(told)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter has them
        signal.signal(signal.SIGINT, signal.default_int_handler)
        preexec()
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # the runner's, kept by tempfile: the worker's TMPDIR instead
        import torch
        if torch.cuda._is_in_bad_fork():
            os.execve(command[0], command, env)
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
        from suite import worker
        code = worker.main(command[-2:], forked=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
