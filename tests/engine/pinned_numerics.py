"""The golden runs compare to the bit, so they take the same kernels on every x86 CPU: each runs in
a fresh Python with the maths libraries pinned.

MKL (torch's float32 GEMM on the CPU) picks its code path by the CPU's vendor: on AMD another than
on Intel, and GEMMs with more than 128 terms a sum (the weight gradients over 256 tokens) differ in
their last bits. MKL_CBWR=COMPATIBLE takes one path on every x86 CPU. torch's own kernels and oneDNN
(the bf16 matmuls) choose by instruction set: pinned to AVX2, which every x86 CI machine has. Each
library reads its variable at its first operation, so they are set for the child process alone:
in the test process itself they would also reach inductor's CPU code, which under
ATEN_CPU_CAPABILITY=avx2 computed wrong values (torch 2.13 on the AVX-512 CPU machine), and the
rest of the tests run as a user's process does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PINS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def skip_unless_recorded_torch(golden: dict) -> None:
    """Golden bits are one torch version's: its kernels (the CPU's GEMMs and AdamW among them) change
    their order of roundings between versions, so another version (a GPU image's) skips, saying so."""
    import pytest
    import torch
    recorded, here = str(golden.get("torch", "")).split("+")[0], torch.__version__.split("+")[0]
    if recorded != here:
        pytest.skip(f"golden numbers recorded with torch {recorded}; this is torch {here}")


def run(script: Path, *args: str):
    """`python script args` with the pins, in a fresh process: the JSON its last line prints."""
    done = subprocess.run([sys.executable, str(script), *args], env={**os.environ, **PINS},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def check() -> None:
    """In the child: the pins are there, and torch's kernels took them."""
    import torch
    got = {k: os.environ.get(k) for k in PINS}
    assert got == PINS and torch.backends.cpu.get_cpu_capability() == "AVX2", \
        f"golden runs need {PINS} set before torch's first op, got {got}"
