"""The README's two commands: they come first, CI runs the test one as written, and the Makefile's
decisions (which profile, which Python) hold without installing anything: a fake `nvidia-smi` and
a fake old Python stand in for the machines we do not have."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def first_code_block(text: str) -> list[str]:
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert first_code_block(readme) == ["make run", "make test"]
    # First screen: the block opens before the first section and within the first 10 lines.
    assert readme.index("```bash") < readme.index("\n## ")
    assert "```bash" in "\n".join(readme.splitlines()[:10])
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci


def make(tmp_path: Path, *args: str, gpu: str | None = None, **files: str) -> subprocess.CompletedProcess:
    """`make -s ARGS` in the repository, with tmp_path/bin (fakes) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu is not None:
        files["nvidia-smi"] = f'#!/bin/sh\ncase "$1" in -L) echo "GPU 0: {gpu} (UUID: x)";; *) echo "{gpu}";; esac\n'
    for name, body in files.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PROFILE", "PYTHON", "VENV")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return subprocess.run(["make", "-s", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("gpu,profile", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA GH200 480GB", "gh200"),  # before H200: the name contains it
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
])
def test_profile_is_named_after_the_gpu(tmp_path, gpu, profile):
    r = make(tmp_path, "profile", gpu=gpu)
    assert (r.returncode, r.stdout.strip()) == (0, profile), r.stderr


@pytest.mark.parametrize("gpus,profile", [(1, "h200x4"), (4, "h200x4"), (8, "h200x8")])
def test_an_h200_host_under_a_tebibyte_takes_the_grid_of_its_gpus(tmp_path, gpus, profile):
    """(This machine's host is under 1 TiB.)"""
    listing = "".join(f"echo 'GPU {k}: NVIDIA H200 (UUID: x{k})'; " for k in range(gpus))
    smi = f'#!/bin/sh\ncase "$1" in -L) {listing};; *) echo "NVIDIA H200";; esac\n'
    r = make(tmp_path, "profile", **{"nvidia-smi": smi})
    assert (r.returncode, r.stdout.strip()) == (0, profile), r.stderr


def test_profile_without_a_gpu_is_cpu_and_one_can_be_chosen(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    assert make(tmp_path, "profile").stdout.strip() == "cpu"
    assert make(tmp_path, "profile", "PROFILE=h100").stdout.strip() == "h100"


def test_unknown_gpu_or_profile_names_the_profiles(tmp_path):
    for r in (make(tmp_path, "profile", gpu="Tesla V100"), make(tmp_path, "profile", "PROFILE=nope")):
        assert r.returncode != 0
        assert "PROFILE" in r.stderr or "profile 'nope'" in r.stderr
        assert "h100" in r.stderr and "cpu" in r.stderr


def test_python_missing_or_too_old_is_refused_before_anything_is_made(tmp_path):
    old = '#!/bin/sh\ncase "$1" in -V) echo "Python 3.9.18";; *) exit 1;; esac\n'
    venv = tmp_path / "venv"
    r = make(tmp_path, "setup", "PYTHON=python3.9", f"VENV={venv}", **{"python3.9": old})
    assert r.returncode != 0 and "Python 3.9.18" in r.stderr and ">= 3.11" in r.stderr
    r = make(tmp_path, "setup", "PYTHON=python3.0-nonexistent", f"VENV={venv}")
    assert r.returncode != 0 and "python3.0-nonexistent not found" in r.stderr and ">= 3.11" in r.stderr
    assert not venv.exists()
