"""Nothing left behind, nothing outlives its parent (issue 74): a save killed outright, a run that
diverges without a NaN, the ranks of a killed torchrun, the CPU run's memory, settings that would
be ignored, the ranks' refusal under `megatrain train --gpus`."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatrain.cli import main

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}  # a job's `python`
TINY = ["model.preset=tiny-llama", "engine.device=cpu", "data.seq_len=16", "data.batch_size=2"]

# `megatrain train ARGS`, killed outright (SIGKILL) once the first file of its first state save is written
KILLED_IN_SAVE = """
import os, signal, sys
import megatrain.checkpoint as checkpoint
real = checkpoint.save_file
def save_then_die(tensors, path, **kwargs):
    real(tensors, path, **kwargs)
    if path.name != "model.safetensors":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save_file = save_then_die
from megatrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def temporaries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith((".state.", ".model.")))


@pytest.fixture(scope="module")
def killed_once(tmp_path_factory) -> Path:
    """The output_dir of one `megatrain train` killed in its first save, made once for the module."""
    out = tmp_path_factory.mktemp("killed") / "out"
    done = subprocess.run([sys.executable, "-c", KILLED_IN_SAVE, "train", "--no-progress", "--no-json", *TINY,
                           "steps=2", f"output_dir={out}"], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert (out / "metrics.jsonl").exists() and temporaries(out), sorted(p.name for p in out.iterdir())
    return out


@pytest.fixture
def killed_in_first_save(killed_once, tmp_path) -> Path:
    """A copy of that output_dir, each test's own: the tests run in it and change it."""
    out = tmp_path / "out"
    shutil.copytree(killed_once, out, symlinks=True)
    assert temporaries(out) == temporaries(killed_once)
    return out


def test_the_next_run_removes_what_a_save_killed_outright_left(killed_in_first_save, capsys):
    """The kill leaves the save's temporary folder (as large as a state); the next run in that
    output_dir removes it, but not a live writer's temporary, nor a file of another name."""
    out = killed_in_first_save
    host = next(n for n in temporaries(out)).split("@")[1].split(".")[0]
    live = subprocess.Popen(["sleep", "60"])
    try:
        (out / f".state.{live.pid}@{host}.abcd1234").mkdir()  # a writer that is alive
        (out / ".state.mine").mkdir()  # not a temporary's name
        assert main(["train", "--no-progress", "--no-json", *TINY, "steps=2", f"output_dir={out}",
                     "overwrite=true"]) == 0
        assert temporaries(out) == sorted([f".state.{live.pid}@{host}.abcd1234", ".state.mine"])
        assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    finally:
        live.kill()
        live.wait()


def test_resume_after_a_first_save_killed_outright_gives_advice_that_works(killed_in_first_save, capsys):
    """No complete save, an earlier run's metrics.jsonl: resume=true is refused with advice (overwrite=true)
    that starts the run, where "leave resume unset" would be refused for the metrics.jsonl."""
    out = killed_in_first_save
    args = ["train", "--no-progress", "--no-json", *TINY, "steps=2", f"output_dir={out}"]
    assert main([*args, "resume=true"]) == 2
    err = capsys.readouterr().err
    assert "no saved training state" in err and "metrics.jsonl" in err and "overwrite=true" in err
    assert "leave resume unset" not in err and "Traceback" not in err
    assert main([*args, "overwrite=true"]) == 0
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2 and not temporaries(out)


def test_a_run_that_diverges_without_a_nan_stops_and_keeps_the_state_before_it(tmp_path, capsys):
    """Resumed at lr 1e3, the tiny model's loss leaps (3.6e7 from 5.5) one step after its weights
    do: the run stops at that step naming it and divergence_factor, exit 3, and the state kept is
    the last one before the divergence (the save whose weights gave that loss is rolled back)."""
    out = tmp_path / "out"
    args = ["train", "--no-progress", "--no-json", *TINY, f"output_dir={out}"]
    assert main([*args, "steps=2", "optim.lr=1e-3"]) == 0
    capsys.readouterr()
    code = main([*args, "steps=6", "optim.lr=1e3", "optim.max_grad_norm=null", "save_every=1", "resume=true",
                 "resume_changes=true"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "step 4: the loss" in err and "divergence_factor 10" in err and "Traceback" not in err
    assert "holds step 2" in err  # where the command says a resume continues from
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    assert not (out / ".state.previous").exists() and not temporaries(out)
    assert not list(out.glob("checkpoint-*"))  # step 3's, whose weights gave step 4's loss, removed with its state
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 4  # the diverged step is in the log
    assert main([*args, "steps=6", "optim.lr=1e3", "save_every=1", "resume=true", "resume_changes=true",
                 "divergence_factor=null"]) == 0  # the guard is a setting: off, the run trains on


def test_a_cpu_run_counts_its_activations_against_the_host(capsys):
    """On the CPU the device is the host: a plan whose activations cannot fit the host is refused,
    by `plan` and by `train`, with the numbers and what to change."""
    args = ["model.preset=tiny-llama", "engine.device=cpu", "data.seq_len=16", "data.grad_accum=1000000000",
            "engine.host_memory_gb=23"]
    assert main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    assert "fits this machine" not in out and "memory plan: host" in out
    assert "does not fit: host memory: needs" in err and "23.0 GiB available" in err and "data.grad_accum" in err
    assert main(["train", "--no-progress", *args]) == 2
    assert capsys.readouterr().err == err  # the same refusal, word for word


@pytest.mark.parametrize("engine, message", [
    (["engine.split_masters=true"], "this run computes in float32 (a CPU run's auto compute_dtype)"),
    (["engine.split_masters=true", "engine.master_dtype=bfloat16", "engine.compute_dtype=bfloat16"],
     "with engine.master_dtype bfloat16 there are no float32 masters to split")])
def test_split_masters_where_it_can_do_nothing_is_refused(capsys, engine, message):
    # at a sequence the model allows: plan, as train, refuses the default 512 over tiny-llama's 256 first
    assert main(["plan", "model.preset=tiny-llama", "engine.device=cpu", "data.seq_len=16", *engine]) == 2
    err = capsys.readouterr().err
    assert "engine.split_masters: true" in err and message in err


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "--layers must be at least 1"),
    (["engine.bogus=1"], "megatrain options: engine: unknown key(s) ['bogus']"),
    (["engine.checkpoint_every=abc"], "megatrain options: engine.checkpoint_every must be an integer, not 'abc'")])
def test_a_suite_spec_with_a_setting_megatrain_would_ignore_or_refuse_is_refused(tmp_path, capsys, args, message):
    """Refused as a spec (exit 2) before any worker starts, not run at the preset's depth or
    recorded as the worker's `error`."""
    from suite.__main__ import main as suite_main
    out = tmp_path / "p.json"
    assert suite_main(["run", "--system", "megatrain", "--preset", "tiny-llama", "--seq", "16", "--steps", "1",
                       "--warmup", "0", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_the_ranks_refusal_reaches_the_user_alone_and_the_command_trains_on_two_ranks(tmp_path):
    """`megatrain train --gpus 2` (torchrun run by the command): a batch that does not split over
    the ranks is refused once, exit 2, without torchrun's log lines or traceback; a batch that
    splits trains on 2 ranks (gloo on the CPU)."""
    command = [sys.executable, "-m", "megatrain.cli", "train", "--gpus", "2", "--no-progress", "--no-json",
               "model.preset=tiny-llama", "engine.device=cpu", "data.seq_len=16", "steps=1"]
    refused = subprocess.run([*command, "data.batch_size=3"], env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("data.batch_size 3 (the global micro-batch) does not split over 2 ranks") == 1
    assert refused.stderr.startswith("megatrain: error:")
    assert "Traceback" not in refused.stderr and "ChildFailedError" not in refused.stderr
    trained = subprocess.run([*command, "data.batch_size=2", f"output_dir={tmp_path / 'out'}"], env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "state" / "state.json").read_text())["step"] == 1


def _descendants(pid: int, needle: str) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if needle in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _running(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def _kill_when_started(parent: subprocess.Popen, needle: str, count: int, settle_s: float) -> list[psutil.Process]:
    """SIGKILL `parent` once `count` of its descendants run `needle` and `settle_s` more have
    passed; those descendants."""
    deadline, found = time.time() + 180, []
    while time.time() < deadline and len(found) < count:
        time.sleep(0.5)
        found = _descendants(parent.pid, needle)
    assert len(found) >= count, f"never started: {needle}"
    time.sleep(settle_s)
    tree = psutil.Process(parent.pid).children(recursive=True)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    return tree


def test_the_ranks_of_a_torchrun_killed_outright_end_with_it(tmp_path):
    """SIGKILL of the torchrun agent while its two ranks train: both end too, not train on as orphans."""
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "megatrain.cli", "train", "--no-progress", "--no-json", *TINY, "steps=100000"],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        tree = _kill_when_started(agent, "megatrain.cli", 2, settle_s=8)
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not _running(alive), "a rank outlived torchrun"
    finally:
        for p in psutil.Process().children(recursive=True):  # whatever a failure left
            p.kill()


def test_a_workflow_job_that_is_no_point_ends_with_snakemake(tmp_path):
    """SIGKILL of Snakemake while `suite accuracy` (a job's shell running python, no `exec`) trains:
    the job and the worker it started end too."""
    pytest.importorskip("snakemake")
    hw = f"killacc{tmp_path.name[-6:]}".replace("_", "")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 32, batch: 1, accum: 1, steps: 1, warmup: 0, timeout: 60}}\n"
                    "accuracy: {systems: [megatrain, native], model: tiny, problems: 40, steps: 100000, batch: 2, "
                    "seq: 160, eval_limit: 4, timeout: 120}\n"
                    "experiments:\n  one:\n    points:\n      - {id: p, system: native, preset: tiny-llama}\n")
    command = [sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", f"results/{hw}/accuracy/summary.json",
               "--config", f"grid={grid}"]
    try:
        flow = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        tree = _kill_when_started(flow, "suite.worker", 1, settle_s=1)
        _, alive = psutil.wait_procs(tree, timeout=40)  # inside the job shell's grace: its SIGTERM ends it
        assert not _running(alive), f"a job outlived the workflow: {[p.pid for p in _running(alive)]}"
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()
        subprocess.run(command + ["--unlock"], cwd=ROOT, env=ENV, capture_output=True)
        for d in ("results", "logs", "plots", "work"):
            import shutil
            shutil.rmtree(ROOT / d / hw, ignore_errors=True)


def test_a_device_another_process_filled_is_refused_by_name(monkeypatch, tmp_path, capsys):
    """The GPU fault `device_taken` (experiments/probes/gpu_faults.py): another process holds all but
    256 MiB of the device, so the run's CUDA context cannot be made; torch says so by a traceback."""
    import torch

    def full(device):
        raise torch.AcceleratorError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", full)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda index: 139 << 30)
    rc = main(["train", "--no-progress", "model.preset=tiny-llama", "engine.device=cuda:0", "data.seq_len=16",
               f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "engine.device cuda:0: no room for a CUDA context" in err and "other processes hold 139.0 GiB" in err
    assert not (tmp_path / "run").exists()
