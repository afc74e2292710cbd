"""The harness on CPU: spec validation, one process per point, statuses, atomic results, sampler, the
environment a result records."""
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from megatrain.metrics import PeakSampler
from suite.check import check, passed
from suite.runner import classify, run_point
from suite.spec import RunSpec
from suite.system import SYSTEMS, System, load

TINY = {"preset": "tiny-llama"}


def tiny(system="native", **kw):
    return RunSpec(**{"system": system, "model": TINY, "seq_len": 32, "batch_size": 2, "grad_accum": 2,
                      "steps": 3, "warmup": 1, "timeout_s": 300.0, **kw})


@pytest.mark.parametrize("bad, message", [
    (dict(system="nope"), "unknown 'nope'"),
    (dict(batch_size=0), "batch_size"),
    (dict(warmup=-1), "warmup"),
    (dict(seq_len=100_000), "max_position_embeddings"),
    (dict(seq_len=1), r"seq_len: must be at least 2 \(a sequence of one token predicts nothing\)"),
    (dict(model={"preset": "qwen9"}), "unknown model preset"),
    (dict(model={"preset": "tiny-llama", "overrides": {"model_type": "bert"}}), "not supported"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_spec_refuses_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny(**bad)


def test_spec_round_trips_and_refuses_unknown_keys():
    spec = tiny(options={"engine": {"checkpoint_every": 1}})
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="unknown keys"):
        RunSpec.from_dict({**spec.to_dict(), "batch": 4})
    assert spec.key() != tiny().key()
    # a result written before the AdamW settings were spec fields still loads, as the same run
    old = {k: v for k, v in spec.to_dict().items() if k not in ("betas", "eps", "weight_decay")}
    assert RunSpec.from_dict(old) == spec
    assert RunSpec.stored(old) == RunSpec.stored(json.loads(json.dumps(spec.to_dict())))


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-gpt-oss", "tiny-qwen3-moe"])
def test_the_baselines_model_is_initialised_as_transformers_initialises_it(preset, chunk, monkeypatch):
    """hf.build_model skips torch's own init of each module (transformers' init overwrites it): every
    weight is still set, with transformers' distributions, its constants and ties, and the same seed
    builds the same model (every rank of a data-parallel baseline builds its own), at one thread as
    at two. chunk 64: every matrix drawn in parallel chunks (a tiny model's are below the default)."""
    from transformers import AutoModelForCausalLM
    from baselines import hf
    if chunk:
        monkeypatch.setattr(hf, "NORMAL_CHUNK", chunk)
    spec = tiny(model={"preset": preset})
    built = hf.build_model(spec, "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        again = hf.build_model(spec, "cpu")
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), again.parameters()))
    torch.manual_seed(spec.seed)
    library = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    ours, theirs = dict(built.named_parameters()), dict(library.named_parameters())
    assert ours.keys() == theirs.keys()
    std = spec.hf_config().initializer_range
    for name, theirs_p in theirs.items():
        p = ours[name].detach()
        assert torch.isfinite(p).all(), name
        if theirs_p.unique().numel() == 1:  # ones and zeros: exactly
            assert torch.equal(p, theirs_p.detach()), name
        elif p.numel() >= 1000:  # a random matrix: N(0, initializer_range)
            assert abs(p.std().item() - std) < 0.1 * std and abs(p.mean().item()) < 0.1 * std, name
    assert (built.get_output_embeddings().weight is built.get_input_embeddings().weight) == \
        (library.get_output_embeddings().weight is library.get_input_embeddings().weight)
    assert all(torch.equal(a, b) for a, b in zip(built.buffers(), library.buffers()))


def test_parallel_normals_end_before_the_init_goes_on(monkeypatch):
    """An embedding with a padding index: transformers draws it, then zeroes the padding row; drawn
    in parallel chunks, the row is still zero after the build and the other rows are drawn, and a
    matrix's chunks are not copies of one another (each its own generator)."""
    from baselines import hf
    monkeypatch.setattr(hf, "NORMAL_CHUNK", 64)
    model = hf.build_model(tiny(model={"preset": "tiny-llama", "overrides": {"pad_token_id": 3}}), "cpu")
    embed = model.get_input_embeddings()
    assert embed.padding_idx == 3
    weight = embed.weight.detach()
    assert torch.equal(weight[3], torch.zeros_like(weight[3]))
    assert (weight[:3] != 0).all() and (weight[4:] != 0).all()
    flat = weight.flatten()
    assert not torch.equal(flat[:64], flat[64:128])


def test_each_system_takes_adamw_settings_from_the_spec():
    import torch
    from baselines import hf
    from baselines.deepspeed_zero import ds_config
    from baselines.megatrain import MegaTrain
    from baselines.native import Native
    spec = tiny(lr=3e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    native = Native(spec, torch.device("cpu"))
    decayed, plain = native.opt.param_groups  # matrices decay, norm weights do not (MegaTrain's rule)
    assert (decayed["betas"], decayed["eps"], decayed["weight_decay"], plain["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.1, 0.0)
    assert {p.dim() for p in decayed["params"]} == {2} and {p.dim() for p in plain["params"]} == {1}
    assert len(hf.adamw_params(native.model, 0.0)) == len(list(native.model.parameters()))  # no decay: one group
    megatrain = MegaTrain(spec, torch.device("cpu"))
    try:
        o = megatrain.trainer.cfg.optim
        assert (o.lr, tuple(o.betas), o.eps, o.weight_decay) == (3e-4, (0.8, 0.9), 1e-6, 0.1)
    finally:
        megatrain.close()
    zero3 = RunSpec(**{**spec.to_dict(), "system": "zero3"})
    assert ds_config(zero3, "cpu")["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6,
                                                              "weight_decay": 0.1}


@pytest.mark.parametrize("options, message", [
    ({"bogus": 1}, "megatrain options: unknown ['bogus']"),
    ({"trace": "t.json", "engine": {"timeline": False}}, "trace writes the engine's timeline; it needs engine.timeline: true"),
    ({"trace": "/proc/nowhere/t.json"}, "megatrain options: trace /proc/nowhere: /proc cannot be written")])
def test_megatrain_options_that_cannot_work_are_refused_before_it_builds(monkeypatch, options, message):
    """Before the trainer is built, not once every step has run."""
    import megatrain.trainer
    from baselines.megatrain import MegaTrain
    monkeypatch.setattr(megatrain.trainer, "Trainer", None)  # building it would fail otherwise
    with pytest.raises(ValueError, match=re.escape(message)):
        MegaTrain(tiny(options=options), torch.device("cpu"))


def test_every_system_names_the_options_it_takes():
    """`suite run` refuses an option its system does not take before a worker starts (exit 2), from
    the class alone; each system refuses it again where it is built."""
    from suite.__main__ import main as suite_main
    from suite.system import check_spec_options, load
    for name in SYSTEMS:
        assert load(name).OPTIONS, name
        check_spec_options(name, dict.fromkeys(load(name).OPTIONS))
        with pytest.raises(ValueError, match=re.escape(f"{name} options: unknown ['bogus']")):
            check_spec_options(name, {"bogus": 1})
    assert suite_main(["run", "--system", "fsdp2", "--preset", "tiny-llama", "--seq", "32", "acumulate=device",
                       "--out", "/nonexistent-never-written/r.json"]) == 2


def test_native_refuses_an_option_it_does_not_take():
    """An option meant for another system (`accumulate=device` is FSDP2's) would change nothing."""
    from baselines.native import Native
    with pytest.raises(ValueError, match=re.escape("native options: unknown ['accumulate']; known: ['admission']")):
        Native(tiny(options={"accumulate": "device"}), torch.device("cpu"))


def test_every_registered_system_implements_the_interface():
    for name in SYSTEMS:  # importing a baseline needs none of its own dependencies
        system = load(name)
        assert issubclass(system, System) and not inspect.isabstract(system), name
    with pytest.raises(ValueError, match="unknown 'nope'"):
        load("nope")


@pytest.mark.parametrize("system", ["native", "megatrain"])
def test_point_runs_in_its_own_process(tmp_path, system):
    out = tmp_path / "r" / "point.json"
    r = run_point(tiny(system), out)
    assert r["status"] == "ok", r.get("log_tail")
    assert json.loads(out.read_text()) == r
    # one warm-up, then three measured or more, until the last three agree (at most 4 x 3: timing.py)
    measured = r["timing"]["measured_steps"]
    assert [s["step"] for s in r["steps"]] == list(range(1, 2 + measured)) and 3 <= measured <= 12
    window = [s["step_time_s"] for s in r["steps"][-3:]]
    assert r["timing"]["median_s"] == r["median"]["step_time_s"] == sorted(window)[1]
    assert r["timing"]["steady"] or measured == 12
    assert r["steps"][0]["tokens"] == 32 * 2 * 2
    assert r["median"]["model_tflops"] > 0 and r["median"]["step_time_s"] > 0
    for row in r["steps"]:  # every rate on the harness's wall clock
        assert row["model_tflops"] == pytest.approx(r["model_flops_per_step"] / row["step_time_s"] / 1e12)
        if system == "megatrain":
            assert row["hardware_tflops"] == pytest.approx(row["hardware_flops"] / row["step_time_s"] / 1e12)
            assert row["hardware_flops"] > r["model_flops_per_step"]  # the recomputed forward
            assert 0 < row["engine_step_time_s"] <= row["step_time_s"]
    # where the wall time went: the worker's start (its imports), the set-up, the steps, the close
    steps = sum(row["step_time_s"] for row in r["steps"])
    assert r["start_s"] > 0.5 and r["close_s"] >= 0  # torch's import alone takes longer
    assert 0 < r["env_s"] < r["start_s"] and 0.5 < r["imported_s"] < r["start_s"]
    assert r["start_s"] + r["setup_s"] + steps + r["close_s"] < r["wall_s"]
    # the sampler watched the worker's tree, not this process
    assert r["peak"]["host_rss_bytes"] > 100 * 2**20
    assert r["peak"]["host_processes"] >= 1 and 0 < r["peak"]["host_rss_largest_bytes"] <= r["peak"]["host_rss_bytes"]
    assert r["env"]["cpu_cores"] and r["env"]["torch"] and "git_commit" in r["env"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["point.json", "point.log"]  # no temp files


def test_timeout_kills_the_tree_and_is_a_result(tmp_path):
    start = time.perf_counter()
    r = run_point(tiny(timeout_s=1.0), tmp_path / "t.json")
    assert r["status"] == "timeout" and "1 s" in r["reason"]
    assert time.perf_counter() - start < 30
    assert json.loads((tmp_path / "t.json").read_text())["status"] == "timeout"


def test_an_interrupt_while_a_late_worker_is_killed_still_leaves_its_result(tmp_path, monkeypatch):
    # `timeout`'s SIGTERM or a Ctrl-C arriving while the runner asks the late worker for its stacks
    # (or waits for it to exit): the timeout's result is written, then the interrupt goes on
    import suite.runner

    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(suite.runner, "_stacks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_point(tiny(timeout_s=1.0), tmp_path / "t.json")
    r = json.loads((tmp_path / "t.json").read_text())
    assert r["status"] == "timeout" and "1 s" in r["reason"]


def test_a_late_worker_that_writes_no_stacks_is_described_by_its_threads(tmp_path):
    # a process that takes no SIGUSR1 (as one blocked in the kernel cannot): the runner's `stacks`
    # then say where each of its threads waited, as /proc tells
    from suite.runner import _stacks
    log = tmp_path / "w.log"
    log.write_text("")
    code = "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, start_new_session=True)
    try:
        # up, and in its sleep: on a busy machine it may still be running between the two
        while "up" not in log.read_text() or psutil.Process(proc.pid).status() != psutil.STATUS_SLEEPING:
            time.sleep(0.05)
        start = log.stat().st_size
        text = _stacks(proc, log, wait_s=0.5)
    finally:
        proc.kill()
        proc.wait()
    assert start == log.stat().st_size  # nothing came on the signal
    assert "no Python stacks came back" in text and f"pid {proc.pid} " in text and "state S" in text


def test_the_partial_result_has_the_set_up_before_the_first_step(tmp_path, monkeypatch):
    # a first step that never ends (Ratel's disk route on the x2 host) must still leave what the
    # set-up measured, and the FLOPs of the model the system really runs, in the partial result
    from suite import worker
    from suite.system import System
    seen = []

    class OwnModel(System):
        model_flops_per_step = 123.0

        def __init__(self, spec, device):
            pass

        def step(self, microbatches):
            seen.append(json.loads((tmp_path / "r.json").read_text()))
            return {"loss": 1.0}

        def info(self):
            return {}

        def save(self, path):
            pass
    monkeypatch.setattr(worker, "load", lambda name: OwnModel)
    worker.run(tiny(steps=1, warmup=0), str(tmp_path / "r.json"))
    first = seen[0]
    assert first["status"] == "running" and first["steps"] == []
    assert first["model_flops_per_step"] == 123.0 and first["setup_s"] >= 0


@pytest.mark.slow
def test_a_timeout_keeps_the_steps_measured_before_it(tmp_path):
    # a tiny run whose steps are many: it measures a few, then the limit kills it
    r = run_point(tiny(steps=100_000, seq_len=64, timeout_s=20.0), tmp_path / "slow.json")
    assert r["status"] == "timeout"
    assert r["partial_samples"] == len(r["steps"]) - 1 > 0
    assert f"{len(r['steps'])} of at least 100001 steps done" in r["reason"]
    assert r["median"]["step_time_s"] > 0
    # where it was when the limit came: the worker's Python stacks, its step loop among them, and
    # each of its threads as the kernel saw it
    assert "most recent call first" in r["stacks"] and "suite/worker.py" in r["stacks"]
    assert "as the kernel saw it" in r["stacks"] and "state " in r["stacks"]
    assert set(r["disk_io"]) == {"read_bytes", "written_bytes"} and min(r["disk_io"].values()) >= 0


def _running(process) -> bool:
    """Alive and not a zombie (a process gone between listing and asking is not running)."""
    import psutil
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _runner_with_its_worker(out):
    """`python -m suite run` of a long point, once its worker runs: (the runner, the worker's tree)."""
    import psutil
    cli = subprocess.Popen([sys.executable, "-m", "suite", "run", "--system", "native", "--preset", "tiny-llama",
                            "--seq", "64", "--steps", "100000", "--out", str(out)])
    def worker(p) -> bool:  # the runner's child in a session of its own (forked or not)
        try:
            return os.getsid(p.pid) == p.pid
        except OSError:  # gone between listing and asking (git, which the runner asks first)
            return False

    def started() -> list:  # the worker itself, not a helper the runner runs before it
        tree = psutil.Process(cli.pid).children(recursive=True)
        return tree if any(worker(p) for p in tree) else []
    deadline = time.time() + 60
    while not (workers := started()) and time.time() < deadline:
        time.sleep(0.2)
    assert workers, "the worker never started"
    return cli, workers


def _suite_run(out, *python_code: str) -> None:
    """`suite run` of a tiny megatrain point to `out`, with `python_code` run before it in its process."""
    code = "; ".join([*python_code, "import sys; from suite.__main__ import main; sys.exit(main(sys.argv[1:]))"])
    done = subprocess.run([sys.executable, "-c", code, "run", "--system", "megatrain", "--preset", "tiny-llama",
                           "--seq", "32", "--batch", "2", "--accum", "2", "--steps", "3", "--max-steps", "3",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_suite_run_forks_its_worker_from_its_imports(tmp_path):
    """`suite run` forks the worker from its own imports: the point trains as a fresh worker's does
    (the same losses, bit for bit), its start without the imports (start_s counted from the fork)."""
    _suite_run(tmp_path / "forked.json")
    forked = json.loads((tmp_path / "forked.json").read_text())
    fresh = run_point(tiny("megatrain", max_steps=3), tmp_path / "fresh.json")  # the same steps as forked's
    assert forked["status"] == fresh["status"] == "ok", forked.get("log_tail")
    assert forked["forked"] and not fresh["forked"]
    assert [s["loss"] for s in forked["steps"]] == [s["loss"] for s in fresh["steps"]]
    assert forked["imported_s"] < 0.5 < fresh["imported_s"] and forked["start_s"] < fresh["start_s"]
    assert forked["launch_s"] > 0.5  # the imports the fork spared the worker, made by the runner


@pytest.mark.slow
def test_a_runner_that_touched_cuda_starts_a_fresh_worker(tmp_path):
    """A child torch marks as forked after its parent's first CUDA call replaces itself by the fresh
    interpreter: the point trains all the same, its worker not forked."""
    _suite_run(tmp_path / "r.json", "import torch", "torch.cuda._is_in_bad_fork = lambda: True")
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["status"] == "ok" and not r["forked"] and r["imported_s"] > 0.5


def test_a_terminated_runner_takes_its_worker_down(tmp_path):
    cli, workers = _runner_with_its_worker(tmp_path / "k.json")
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(timeout=30) == 128 + signal.SIGTERM
    # reaped before the runner exits, not left to die later of its deleted result folder
    assert not [p for p in workers if _running(p)]
    r = json.loads((tmp_path / "k.json").read_text())  # the point is a result all the same
    assert r["status"] == "interrupted" and "SIGTERM" in r["reason"]
    assert r["launch_s"] > 0.5  # the runner's own start before the worker's: torch's import alone takes longer


def test_a_killed_runner_leaves_no_orphan_worker(tmp_path):
    """SIGKILL of `python -m suite run` (nothing of it runs any more): its worker is signalled by
    the kernel and dies too, instead of training on and holding the GPU."""
    import psutil
    cli, workers = _runner_with_its_worker(tmp_path / "k.json")
    cli.kill()
    cli.wait(timeout=30)
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not [p for p in alive if _running(p)]


def test_failures_are_results(tmp_path):
    with pytest.raises(ValueError, match="no_such_knob"):  # refused with the spec, before any worker
        tiny("megatrain", options={"engine": {"no_such_knob": 1}})
    r = run_point(tiny("megatrain", options={"engine": {"host_memory_gb": 0.0001}}), tmp_path / "h.json")
    assert r["status"] == "oom_host" and "host memory" in r["reason"]


def test_a_diverging_system_is_an_error_not_a_speed(tmp_path):
    r = run_point(tiny(lr=1e12, steps=6), tmp_path / "nan.json")
    assert r["status"] == "error" and "diverged" in r["reason"]
    assert "median" not in r


def test_classify_statuses():
    total = 100 * 2**30
    assert classify(None, True, "running", "", 0, total)[0] == "timeout"
    assert classify(0, False, "ok", "", 0, total)[0] == "ok"
    assert classify(1, False, "running", "torch.OutOfMemoryError: CUDA out of memory.", 0, total)[0] == "oom_device"
    status, reason = classify(-signal.SIGKILL, False, "running", "", 95 * 2**30, total)
    assert status == "oom_host" and "OOM killer" in reason
    assert classify(-signal.SIGKILL, False, "running", "", 2**30, total)[0] == "error"
    assert classify(-signal.SIGSEGV, False, None, "", 0, total)[0] == "error"


def test_sampler_sees_a_child_process_tree():
    """The peak counts every process of the tree, and says how many there were at the peak and the
    largest one's share: here a parent touching 100 MiB and its child 300 MiB."""
    touch = "b = bytearray({} * 2**20); b[::4096] = b'x' * len(b[::4096])"
    child = f"import time; {touch.format(300)}; time.sleep(3)"
    code = f"import subprocess, sys; {touch.format(100)}; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    sampler = PeakSampler(pid=proc.pid, interval_s=0.05)
    proc.wait()
    sampler.close()
    assert sampler.peak_host_bytes > 400 * 2**20 and sampler.peak_host_processes == 2
    assert 300 * 2**20 < sampler.peak_host_largest_bytes < sampler.peak_host_bytes - 100 * 2**20


@pytest.mark.slow
def test_check_passes_when_systems_track_native(tmp_path):
    summary = check(["megatrain", "fsdp2"], tmp_path, steps=4)
    assert passed(summary)
    rows = {r["system"]: r for r in summary["systems"]}
    # float32 on the CPU: the same numbers; on a GPU the systems' bf16 compute differs within the
    # check's tolerance (megatrain 1.2e-4 from native on an H200)
    bound = 1e-4 if summary["device"] == "cpu" else summary["tolerance"]
    for system in ("megatrain", "fsdp2"):
        assert rows[system]["status"] == "ok" and rows[system]["max_relative_gap"] < bound
    assert rows["native"]["losses"][-1] < rows["native"]["losses"][0]  # it learns the batch


def test_check_catches_a_diverging_system():
    summary = {"systems": [{"system": "native", "status": "ok"},
                           {"system": "zero3", "status": "ok", "tracks_native": False}]}
    assert not passed(summary)


def test_the_table_names_a_file_it_cannot_read_and_goes_on(tmp_path, capsys):
    from suite.table import rows
    (tmp_path / "a.json").write_text(json.dumps({"system": "native", "status": "ok", "spec": {}}))
    (tmp_path / "b.json").write_text('{"system": "native"')  # cut short
    assert [name for name, _ in rows([tmp_path])] == ["a"]
    assert "b.json: skipped, unreadable" in capsys.readouterr().err


def test_the_table_marks_a_breakdown_the_run_did_not_record():
    from suite.table import line
    spec = {"batch_size": 4, "grad_accum": 1}
    exposed = {"gpu_busy_frac": 0.9, "optimizer_exposed_s": 0.01, "idle_unattributed_s": 0.2}
    old = {"system": "megatrain", "status": "ok", "spec": spec, "median": {"exposed": exposed}}
    new = {**old, "median": {"exposed": {**exposed, "idle_while_issuing_s": 0.0}}}
    issuing = 12  # point, system, status, batch, step s, +-%, steps, TFLOP/s, ratio, busy, opt exp, idle un, issuing
    assert line("old", old).split()[issuing] == "-"  # not measured: never a 0 that reads as measured
    assert line("new", new).split()[issuing] == "0.000"
    timed = {**new, "setup_s": 88.3, "wall_s": 135.2}
    assert line("timed", timed).split()[-2:] == ["88", "135"]  # set-up and wall: what packs a GPU call
    assert line("new", new).split()[-2:] == ["-", "-"]


def test_native_is_refused_by_its_device_count_before_it_allocates(monkeypatch):
    """Native's device count against its measured points (baselines/native.py): at most 3.5 GiB
    under each peak it reached, above the free memory of each point that ran out of it, so the
    H200's 7B at 8 x 4096 x 4 micro-batches (which failed mid-step) is refused up front with the
    count's parts, and 4 x 4096 with no accumulation is not."""
    import torch

    from baselines import hf
    from baselines.native import device_need
    from megatrain.memory import DoesNotFit
    from megatrain.units import GiB

    def spec(preset, batch, accum=1, layers=None):
        model = {"preset": preset, **({"overrides": {"num_hidden_layers": layers}} if layers else {})}
        return RunSpec.from_dict({"system": "native", "model": model, "seq_len": 4096, "batch_size": batch,
                                  "grad_accum": accum})
    for s, peak in [(spec("qwen2.5-3b", 4), 73489711104), (spec("qwen2.5-3b", 2, layers=8), 27475111936),
                    (spec("qwen3-30b-a3b", 8, layers=6), 115055279616)]:  # results/h100, h200 points
        need = device_need(s)[0]
        assert peak - 3.5 * GiB < need <= peak
    assert device_need(spec("qwen2.5-3b", 8))[0] > 78.7 * GiB  # the H100's free memory; it ran out
    h200_free = int(139.2 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (h200_free, 140 * GiB))
    cuda = torch.device("cuda", 0)
    with pytest.raises(DoesNotFit, match=r"at the loss: .*gradients 28\.4 GiB"):
        hf.require_device(spec("qwen2.5-7b", 8, 4), cuda, lambda: device_need(spec("qwen2.5-7b", 8, 4)), "native training")
    hf.require_device(spec("qwen2.5-7b", 4), cuda, lambda: device_need(spec("qwen2.5-7b", 4)), "native training")
    assert device_need(spec("qwen2.5-7b", 4))[0] < h200_free


@pytest.mark.parametrize("options, says", [({"accumulate": "gpu"}, "options.accumulate: 'gpu'"),
                                           ({"sync": False}, "unknown ['sync']")])
def test_fsdp2_refuses_bad_options_before_building(options, says):
    from baselines.fsdp2 import FSDP2
    import torch.distributed as dist
    with pytest.raises(ValueError, match=re.escape(says)):
        FSDP2(RunSpec(system="fsdp2", model={"preset": "tiny-llama"}, seq_len=32, options=options),
              torch.device("cpu"))
    assert not dist.is_initialized()  # refused before the process group, before the model


def test_fsdp2_accumulating_on_the_device_trains_as_on_the_host(monkeypatch):
    """`accumulate: device` turns FSDP2's gradient sync off for all but each step's last micro-batch,
    and the sums are the same: the same losses and trained weights as FSDP2's own per-micro-batch
    reduction (float32 on the CPU, one rank: the same additions). Each run's one-process group
    takes a port of its own and leaves the environment as it was (a later run, or a worker started
    from this process, would inherit the port)."""
    from baselines.fsdp2 import FSDP2
    from megatrain.data import make_source
    from megatrain.shapes import ModelShape
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    environ = dict(os.environ)
    trained = {}
    for where in ("host", "device"):
        spec = RunSpec(system="fsdp2", model={"preset": "tiny-llama"}, seq_len=32, batch_size=2, grad_accum=3,
                       repeat_batch=True, options={"accumulate": where})  # one batch: its loss falls
        system = FSDP2(spec, torch.device("cpu"))
        syncs = []
        sync = system.model.set_requires_gradient_sync
        monkeypatch.setattr(system.model, "set_requires_gradient_sync", lambda on: syncs.append(on) or sync(on))
        data = make_source(spec.data_config(), ModelShape(spec.hf_config()).vocab, None)
        losses = [system.step([data.next() for _ in range(spec.grad_accum)])["loss"] for _ in range(3)]
        weights = {k: v.full_tensor().clone() for k, v in system.model.state_dict().items()}
        system.close()
        assert dict(os.environ) == environ
        trained[where] = losses, weights, syncs, system.info()["accumulate"]
    assert trained["host"][2] == [] and trained["device"][2] == [False, False, True] * 3
    assert (trained["host"][3], trained["device"][3]) == ("host", "device")
    assert trained["device"][0] == pytest.approx(trained["host"][0], rel=1e-6)
    assert trained["host"][0][-1] < trained["host"][0][0]  # it trains
    torch.testing.assert_close(trained["device"][1], trained["host"][1], rtol=1e-6, atol=1e-7)


def test_fsdp2_names_the_parts_of_its_set_up():
    """info.setup_s: the seconds of each part of the build, in order, which together are its set-up."""
    from baselines.fsdp2 import FSDP2
    spec = RunSpec(system="fsdp2", model={"preset": "tiny-llama"}, seq_len=32, batch_size=2)
    clock = time.perf_counter()
    system = FSDP2(spec, torch.device("cpu"))
    whole = time.perf_counter() - clock
    parts = system.info()["setup_s"]
    system.close()
    assert list(parts) == ["join_and_admission", "build", "shard", "optimizer"]
    assert all(s >= 0 for s in parts.values()) and 0.9 * whole <= sum(parts.values()) <= whole


def test_fsdp2_auto_accumulates_on_the_device_where_its_count_leaves_the_slack(monkeypatch):
    """`accumulate: auto` (the default) sums on the device where the count with the float32 unsharded
    gradients leaves AUTO_SLACK free: the 7B at 8 x 4 x 4096 on an H200's free memory, not on an
    H100's; a stated choice stands; on the CPU, the device (no device memory to spare)."""
    from baselines import hf
    from baselines.fsdp2 import AUTO_SLACK, accumulation, device_need
    from megatrain.units import GiB

    def spec(**options):
        return RunSpec.from_dict({"system": "fsdp2", "model": {"preset": "qwen2.5-7b"}, "seq_len": 4096,
                                  "batch_size": 8, "grad_accum": 4, "options": options})
    cuda = torch.device("cuda", 0)
    need = device_need(spec(), "device")[0]
    for free, where in [(int(139.3 * GiB), "device"), (int(78.7 * GiB), "host"),
                        (need + AUTO_SLACK, "device"), (need + AUTO_SLACK - 1, "host")]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 140 * GiB))
        assert accumulation(spec(), cuda, hf.Ranks()) == where
        assert accumulation(spec(accumulate="host"), cuda, hf.Ranks()) == "host"
    assert accumulation(spec(accumulate="device"), cuda, hf.Ranks()) == "device"  # tried, then refused
    assert accumulation(spec(), torch.device("cpu"), hf.Ranks()) == "device"


def test_fsdp2_is_refused_by_its_device_count_before_it_allocates(monkeypatch):
    """FSDP2's device count against its measured points (H100 and H200, 1 to 4 ranks, both
    accumulations, layers of 0.07 to 0.93 B): under each peak it reached, by at most 1 GiB. With
    `accumulate: device` the count adds the float32 unsharded gradients, so 7B at 8 x 4096 x 2 is
    refused on an H100's free memory, naming them, where FSDP2's own accumulation is admitted."""
    from baselines import hf
    from baselines.fsdp2 import device_need
    from megatrain.memory import DoesNotFit
    from megatrain.units import GiB

    def spec(model, batch, accum=1, gpus=1):
        return RunSpec.from_dict({"system": "fsdp2", "model": model, "seq_len": 4096, "batch_size": batch,
                                  "grad_accum": accum, "gpus": gpus})
    seven = {"preset": "qwen2.5-7b"}
    two_layers = {"preset": "qwen2.5-7b", "overrides": {"num_hidden_layers": 2}}
    seven_layers = {"preset": "qwen2.5-7b", "overrides": {"num_hidden_layers": 7}}
    wider = {"preset": "qwen2.5-7b", "overrides": {"num_hidden_layers": 7, "hidden_size": 5376, "intermediate_size": 28416,
                                                   "num_attention_heads": 42, "num_key_value_heads": 6}}
    widest = {"preset": "qwen2.5-7b", "overrides": {"num_hidden_layers": 7, "hidden_size": 7168, "intermediate_size": 37888,
                                                    "num_attention_heads": 56, "num_key_value_heads": 8}}
    measured = [({"preset": "qwen2.5-7b", "overrides": {"num_hidden_layers": 14}}, 8, 2, 1, "host", 66273585152),
                (seven_layers, 8, 2, 1, "host", 64629417984),
                ({"preset": "qwen2.5-3b"}, 4, 1, 1, "host", 33251105792), (two_layers, 4, 1, 1, "host", 32854222848),
                (seven, 8, 2, 1, "host", 69561919488), (seven, 16, 2, 2, "host", 70028559360),
                (seven, 32, 2, 4, "host", 70028035072), ({"preset": "qwen2.5-14b"}, 4, 1, 1, "host", 41806967808),
                (seven, 8, 4, 1, "device", 100036968448), (seven_layers, 8, 4, 1, "device", 75522369536),
                (wider, 8, 4, 1, "device", 88234956288), (widest, 8, 4, 1, "device", 104214905856)]
    # results/*/points/**/*fsdp2*.json
    for model, batch, accum, gpus, where, peak in measured:
        need = device_need(spec(model, batch, accum, gpus), where)[0]
        assert peak - GiB < need <= peak
    host, device = (device_need(spec(seven, 8, 2), where)[0] for where in ("host", "device"))
    assert device - host == 4 * 7615616512
    assert device_need(spec(seven, 8, 1), "device")[0] == device_need(spec(seven, 8, 1), "host")[0]  # no accumulation
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(78.7 * GiB), 80 * GiB))
    cuda = torch.device("cuda", 0)
    with pytest.raises(DoesNotFit, match=r"at the loss: .*float32 unsharded gradients 28\.4 GiB"):
        hf.require_device(spec(seven, 8, 2), cuda, lambda: device_need(spec(seven, 8, 2), "device"), "FSDP2")
    hf.require_device(spec(seven, 8, 2), cuda, lambda: device_need(spec(seven, 8, 2), "host"), "FSDP2")


def test_reading_the_commit_writes_nothing_into_the_repository(tmp_path):
    """`git status` refreshes a stale index file as a side effect; the result's reads of git must
    not write it (a detached run tars the tree meanwhile: experiments/workflow_gpu.sh)."""
    from megatrain.metrics import git

    def run(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    run("init", "-q")
    (tmp_path / "f").write_text("a")
    run("add", "f")
    run("commit", "-qm", "one")
    index = tmp_path / ".git" / "index"
    before = index.stat().st_mtime_ns
    os.utime(tmp_path / "f", ns=(before + 2 * 10 ** 9,) * 2)  # the index's record of f is stale
    assert git("status", "--porcelain", cwd=str(tmp_path)) == ""
    assert index.stat().st_mtime_ns == before


def test_the_environment_names_the_tracked_files_that_differ_from_the_commit(monkeypatch):
    """A GPU point's copy of the tree can differ from its commit; the result says in which files."""
    import megatrain.metrics as metrics
    answers = {"status": " M megatrain/store.py\nM  README.md\n", "rev-parse": "ab" * 20}
    monkeypatch.setattr(metrics, "git", lambda *args: answers[args[0]].strip())  # as git gives them
    monkeypatch.delenv("MEGATRAIN_GIT_COMMIT", raising=False)
    env = metrics.environment()
    assert env["git_dirty"] and env["git_dirty_paths"] == ["megatrain/store.py", "README.md"]
    answers["status"] = ""
    env = metrics.environment()
    assert not env["git_dirty"] and env["git_dirty_paths"] == []


def test_each_layers_rate_against_its_ceiling():
    """suite.worker.layer_ratios (a point with `ceiling`): the ceiling's seconds, one micro-batch's,
    times the step's micro-batches, over each layer's passes in the median step (the timeline's)."""
    from suite.worker import layer_ratios
    spec = RunSpec(system="megatrain", model={"preset": "tiny-qwen2"}, seq_len=32, batch_size=2, grad_accum=4)
    result = {"info": {"ceiling": {"seconds": 0.5}},
              "median": {"exposed": {"gpu_busy_s": 9.0, "layer_s.L0": 2.5, "layer_s.L1": 2.0}}}
    assert layer_ratios(result, spec) == pytest.approx({"L0": 0.8, "L1": 1.0})
    assert layer_ratios({**result, "median": {}}, spec) == {}  # a system without a timeline
    # layers of two kinds (GPT-OSS's sliding-window and full attention): each against its own kind's
    kinds = {"info": {"ceiling": {"seconds": 0.5, "seconds_by_layer": {"L0": 0.25, "L1": 0.75}}}}
    assert layer_ratios({**result, **kinds}, spec) == pytest.approx({"L0": 0.4, "L1": 1.5})
