"""Every job's shell (the Snakefile's `shell.executable`, through workflows/job_shell): `-c COMMAND`
runs COMMAND with /bin/sh, as Snakemake's own shell would, in a process group of its own that ends
when Snakemake dies, however it dies (SIGKILL included): the kernel signals this process when its
parent dies (PR_SET_PDEATHSIG, as megatrain/lifetime.py asks it), and it ends the command's whole
group, SIGTERM first (a point's harness records its interruption), SIGKILL after GRACE_S. No job (a
point, `suite accuracy`, a table, a figure) runs on and writes after the workflow. Ctrl-C, SIGTERM
and SIGHUP reach the command's group through it. The standard library only."""
import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 30.0  # a point's runner writes its result and its worker's tree ends well within it


def main(argv: list[str]) -> int:
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # Snakemake died before the line above
        return 128 + signal.SIGTERM
    job = subprocess.Popen(["/bin/sh", *argv], preexec_fn=os.setpgrp)
    ending: list[int] = []

    def signal_group(sig: int) -> bool:
        try:
            os.killpg(job.pid, sig)
            return True
        except ProcessLookupError:  # the group has ended
            return False

    def end(signum, frame) -> None:  # no waiting here: the wait below holds the child's lock
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        ending.append(signum)
        signal.signal(signal.SIGALRM, lambda *_: signal_group(signal.SIGKILL))
        signal.alarm(int(GRACE_S))
        signal_group(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, end)
    code = job.wait()
    if not ending:
        return code if code >= 0 else 128 - code
    while signal_group(0):  # the shell gone, what it started may still be ending (until the alarm's SIGKILL)
        time.sleep(0.2)
    return 128 + ending[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
