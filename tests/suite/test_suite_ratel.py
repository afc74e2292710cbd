"""The Ratel runner on CPU: its refusals, and the spec -> main.py mapping run against a stub checkout."""
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from baselines import ratel_memory
from megatrain.batch import Batch
from megatrain.memory import DoesNotFit
from megatrain.units import GiB
from suite.spec import RunSpec
from baselines.ratel import Ratel, parse_output
from suite.system import Unsupported

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

CPU = torch.device("cpu")
PAPER = Path(__file__).resolve().parents[2] / "baselines" / "paper_ratel.json"

# Prints what main.py prints per iteration (forward i/10 s, back_and_opt 2i/10 s), its loop count not a
# literal like the artifact's; records its argv, working directory, path and the config it was given
# beside itself. RATEL_STUB_ITERS and RATEL_STUB_EXIT change the loop count and the exit code;
# RATEL_STUB_SEGV ends it by a segmentation fault after a screenful of the artifact's [INFO] logging;
# RATEL_STUB_HANG stops it in a backward, beside a helper process of its own.
STUB_MAIN = """
import json, os, subprocess, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
seen = {"argv": sys.argv, "cwd": os.getcwd(), "pythonpath": os.environ["PYTHONPATH"].split(os.pathsep),
        "bytecode": os.environ.get("PYTHONDONTWRITEBYTECODE"), "config": json.load(open(args["--sb_config"]))}
json.dump(seen, open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "seen.json"), "w"))
print("[0, 1, 2]")
if os.environ.get("RATEL_STUB_HANG"):  # a process of its own, as its optimizer's with is_mp
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper.pid"), "w").write(str(helper.pid))
for i in range(int(os.environ.get("RATEL_STUB_ITERS", 10))):
    print(f"-----------------------Iter {i}-----------------------")
    print("---begin forward---")
    print("forward time", (i + 1) / 10)
    print("---begin backward---")
    print("back_and_opt time", 2 * (i + 1) / 10)
if os.environ.get("RATEL_STUB_SEGV"):
    print("---begin backward---")
    for _ in range(100):
        print("[2026-11-23 20:19:33,780] [INFO] [see_mem.py:18:see_memory_usage] MA 0.03 GB", flush=True)
    import signal
    os.kill(os.getpid(), signal.SIGSEGV)
if os.environ.get("RATEL_STUB_HANG"):
    print("---begin backward---", flush=True)
    time.sleep(600)
if os.environ.get("RATEL_STUB_EXIT"):
    print("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    sys.exit(int(os.environ["RATEL_STUB_EXIT"]))
"""

# The environment the probe checks, faked inside the checkout (it is on the probe's path): a torch that
# sees a GPU and a CUDA 13.0 toolkit, einops, ninja, and an async_io builder that finds libaio unless
# RATEL_STUB_NO_AIO is set. Fast, and seen in info().
STUB_ENV = {
    "torch/__init__.py": "__version__ = '2.11.0+stub'\nfrom . import cuda, version, nn, utils\n",
    "torch/cuda.py": "def is_available():\n    return True\n",
    "torch/version.py": "cuda = '13.0'\n",
    "torch/nn/__init__.py": "class Module:\n    pass\n",
    "torch/nn/functional.py": "",
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": "import os\nCUDA_HOME = os.path.join(os.path.dirname(__file__), '..', '..', 'cuda')\n",
    "cuda/bin/nvcc": "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n",
    "einops.py": "",
    "ninja.py": "",
    "op_ds/ops/op_builder/async_io.py": ("import os\nclass AsyncIOBuilder:\n    def is_compatible(self, verbose=False):\n"
                                         "        return not os.environ.get('RATEL_STUB_NO_AIO')\n"),
}


def _config(nvme: str) -> dict:
    part = {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4, "buffer_size": 1e6,
            "max_in_cpu": 1e5}
    return {"zero_config": {"offload_optimizer": dict(part), "offload_param": dict(part), "offload_act": dict(part)},
            "aio_config": {"block_size": 1048576, "queue_depth": 32, "thread_count": 2}}


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "LoHan"
    for name, text in STUB_ENV.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "cuda/bin/nvcc").chmod(0o755)
    (root / "main.py").write_text(STUB_MAIN)
    (root / "config.json").write_text(json.dumps(_config("/share/data12")))
    (tmp_path / "nvme").mkdir()
    return root


def spec(checkout=None, **kw) -> RunSpec:
    options = {"checkout": str(checkout), "python": sys.executable, "approximate_model": True} if checkout else {}
    options.update(kw.pop("options", {}))
    return RunSpec(**{"system": "ratel", "model": {"preset": "tiny-llama"}, "seq_len": 32, "batch_size": 2,
                      "steps": 3, "warmup": 2, "options": options, **kw})


def test_without_a_checkout_says_where_to_get_one(monkeypatch):
    monkeypatch.delenv("RATEL_HOME", raising=False)
    with pytest.raises(Unsupported, match=r"no Ratel checkout: set RATEL_HOME or options.checkout .*RC4ML/LoHan"):
        Ratel(spec(), CPU)


def test_an_empty_directory_is_not_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("RATEL_HOME", str(tmp_path))
    with pytest.raises(Unsupported, match=r"is not a Ratel checkout: no main.py or config.json"):
        Ratel(spec(), CPU)


def _replay(s: RunSpec, checkout: Path) -> tuple[list[dict], dict, dict]:
    system = Ratel(s, CPU)
    try:
        batch = Batch(torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
        rows = [system.step([batch]) for _ in range(s.total_steps)]
        info = system.info()
    finally:
        system.close()
    assert not Path(system.workdir).exists()
    return rows, info, json.loads((checkout / "seen.json").read_text())


def test_the_spec_maps_onto_main_py_and_steps_replay_its_iterations(checkout):
    rows, info, seen = _replay(spec(checkout, options={"args": {"swap_ratio": 0.5}}), checkout)
    args = dict(zip(seen["argv"][1::2], seen["argv"][2::2]))
    assert seen["argv"][0] == str(checkout / "main.py")
    # tiny-llama: hidden 64, 3 layers, 4 heads, vocab 256
    assert {k: args[f"--{k}"] for k in ("hidden_dim", "num_layers", "num_heads", "vocab_size", "max_seq_len",
                                        "batch_size")} == {"hidden_dim": "64", "num_layers": "3", "num_heads": "4",
                                                           "vocab_size": "256", "max_seq_len": "32", "batch_size": "2"}
    assert args["--swap_ratio"] == "0.5" and args["--is_nvme"] == "1" and args["--is_mp"] == "1"
    # the checkout is left alone: main.py runs elsewhere, writes no bytecode, sees the compat layer first
    assert Path(seen["cwd"]) != checkout and seen["bytecode"] == "1"
    assert seen["pythonpath"][:2] == [str(Path("baselines/ratel_compat").resolve()), str(checkout)]
    # disk offload by default: every section swaps into the run's own directory
    swap = {part["nvme_path"] for part in seen["config"]["zero_config"].values()}
    assert swap == {info["swap_dir"]} and Path(info["swap_dir"]).parent == Path(seen["cwd"])
    assert {part["device"] for part in seen["config"]["zero_config"].values()} == {"nvme"}
    # the first warmup + steps of main.py's ten iterations, one per step(), timed by Ratel itself
    assert [r["ratel_iteration"] for r in rows] == [0, 1, 2, 3, 4]
    for i, r in enumerate(rows):
        assert r["loss"] is None
        assert r["forward_s"] == pytest.approx((i + 1) / 10)
        assert r["step_time_s"] == pytest.approx(3 * (i + 1) / 10)
    assert info["iterations_used"] == 5 and info["ratel_params"] > 0
    assert info["torch"] == "2.11.0+stub" and info["torch_cuda"] == "13.0" and info["offload"] == "disk"
    assert info["compat"]["torch_extensions_dir"].endswith("/ratel")
    assert any("intermediate_size 128" in d for d in info["differences_from_spec"])
    assert any("spans batch_size = 2 positions" in d for d in info["differences_from_spec"])


def test_host_memory_offload_marks_the_config_cpu_and_turns_the_swappers_off(checkout):
    rows, info, seen = _replay(spec(checkout, options={"offload": "cpu"}), checkout)
    args = dict(zip(seen["argv"][1::2], seen["argv"][2::2]))
    assert {k: args[f"--{k}"] for k in ("is_nvme", "is_nvme_async", "is_nvme_rearrange", "is_mp")} == dict.fromkeys(
        ("is_nvme", "is_nvme_async", "is_nvme_rearrange", "is_mp"), "0")
    assert {part["device"] for part in seen["config"]["zero_config"].values()} == {"cpu"}
    # the activation swapper is built in every mode and makes its folder under nvme_path
    assert {part["nvme_path"] for part in seen["config"]["zero_config"].values()} == {info["swap_dir"]}
    assert info["offload"] == "cpu" and len(rows) == 5


def test_a_named_swap_directory_is_used_and_kept(checkout):
    nvme = checkout.parent / "nvme"
    _, info, seen = _replay(spec(checkout, options={"nvme_path": str(nvme)}), checkout)
    assert {part["nvme_path"] for part in seen["config"]["zero_config"].values()} == {str(nvme)}
    assert nvme.is_dir()


def test_a_different_model_family_is_refused_unless_approximated(checkout):
    with pytest.raises(Unsupported, match=r"only its own GPT-2-style model.*intermediate_size 128.*"
                                          r"num_key_value_heads 2.*approximate_model"):
        Ratel(spec(checkout, options={"approximate_model": False}), CPU)


@pytest.mark.parametrize("change, error, message", [
    (dict(grad_accum=2), Unsupported, "grad_accum 2: Ratel's main.py has no gradient accumulation"),
    (dict(batch_size=64), Unsupported, r"batch_size 64 > seq_len 32: .*positions"),
    (dict(options={"nvme_path": "/no/such/raid"}), Unsupported, r"nvme_path /no/such/raid is not a directory"),
    (dict(options={"offload": "cpu", "nvme_path": "/tmp"}), ValueError, "only with offload=disk"),
    (dict(options={"offload": "nvme"}), ValueError, r"offload: 'nvme'; one of \['cpu', 'disk'\]"),
    (dict(options={"args": {"batch_size": 4}}), ValueError, "come from the spec"),
    (dict(options={"args": {"is_tiny": 1}}), ValueError, r"unknown main.py flags \['is_tiny'\]"),
    (dict(options={"args": {"is_nvme_async": 0}}), ValueError, "never steps the optimizer"),
    (dict(options={"offload": "cpu", "args": {"is_nvme_rearrange": 1}}), ValueError, "need is_nvme 1"),
    (dict(options={"nvme": "x"}), ValueError, "unknown"),
])
def test_what_main_py_cannot_express_is_refused(checkout, change, error, message):
    with pytest.raises(error, match=message):
        Ratel(spec(checkout, **change), CPU)


def test_more_steps_than_main_py_runs_are_refused_up_front(checkout):
    # upstream's loop: `for i in range(4):` then the Iter line
    (checkout / "main.py").write_text("for i in range(4):\n    iter_start = 0\n    print(f'---Iter {i}---')\n")
    with pytest.raises(Unsupported, match=r"warmup 2 \+ steps 3 = 5: .*main.py runs 4 iterations"):
        Ratel(spec(checkout), CPU)


@pytest.mark.parametrize("breaks, message", [
    # a module that fails to import, as if absent (the real one may be installed here)
    (lambda root: (root / "einops.py").write_text("raise ImportError('stub')"), r"lacks: einops \(gpt_model.py's rearrange\)"),
    (lambda root: (root / "ninja.py").write_text("raise ImportError('stub')"), r"lacks: ninja \(the op builders' JIT build"),
    (lambda root: (root / "torch/cuda.py").write_text("def is_available():\n    return False\n"),
     r"lacks: a CUDA GPU"),
    (lambda root: (root / "torch/version.py").write_text("cuda = '12.8'\n"), r"lacks: nvcc 13.0 matching torch's CUDA 12.8"),
    (lambda root: (root / "torch/utils/cpp_extension.py").write_text("CUDA_HOME = None\n"),
     r"lacks: a CUDA toolkit \(CUDA_HOME\)"),
])
def test_an_environment_without_ratels_toolchain_is_refused(checkout, breaks, message):
    breaks(checkout)
    with pytest.raises(Unsupported, match=rf"Ratel's environment \(.*, torch 2.11.0\+stub\) {message}"):
        Ratel(spec(checkout), CPU)


def test_without_libaio_the_refusal_says_how_to_get_it(checkout, monkeypatch):
    monkeypatch.setenv("RATEL_STUB_NO_AIO", "1")
    with pytest.raises(Unsupported, match=r"libaio .*baselines/libaio.sh env .libaio"):
        Ratel(spec(checkout), CPU)


@pytest.mark.parametrize("env, error, message", [
    ({"RATEL_STUB_ITERS": "3"}, RuntimeError, r"(?s)printed 3 complete iterations; the spec needs 5.*Iter 2"),
    ({"RATEL_STUB_ITERS": "0"}, RuntimeError, r"(?s)no per-iteration times in Ratel's output.*\[0, 1, 2\]"),
    # ended before the spec's iterations (main.py is stopped once it has printed them)
    ({"RATEL_STUB_ITERS": "2", "RATEL_STUB_EXIT": "1"}, torch.cuda.OutOfMemoryError, "Ratel ran out of device memory"),
    # its logging left out of the tail, so that the last line printed is seen
    ({"RATEL_STUB_ITERS": "2", "RATEL_STUB_SEGV": "1"}, RuntimeError, r"(?s)Ratel was killed by SIGSEGV; last output:\n.*---begin backward---$"),
])
def test_a_failed_or_short_run_is_an_error_with_the_output_tail(checkout, monkeypatch, env, error, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    system = Ratel(spec(checkout), CPU)
    try:
        with pytest.raises(error, match=message):
            system.step([])
    finally:
        system.close()


def test_main_py_is_stopped_once_it_has_printed_the_specs_iterations(checkout, monkeypatch):
    """The spec's 5 iterations printed, main.py then hangs: its tree is killed and the run is a result."""
    monkeypatch.setenv("RATEL_STUB_ITERS", "5")
    monkeypatch.setenv("RATEL_STUB_HANG", "1")
    system = Ratel(spec(checkout), CPU)
    try:
        start = time.monotonic()
        rows = [system.step([]) for _ in range(5)]
        assert time.monotonic() - start < 60
        assert [r["ratel_iteration"] for r in rows] == [0, 1, 2, 3, 4]
        assert system.info()["main_py_stopped"] == "after the spec's iterations"
    finally:
        system.close()
    helper = int((checkout / "helper.pid").read_text())
    assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE


def test_parser_keeps_complete_iterations_only():
    text = ("-----Iter 0-----\nforward time 1.5\nbackward time 2\nback_and_opt time 2.5e0\n"
            "-----Iter 1-----\nforward time 3\n")
    assert parse_output(text) == [(0, 1.5, 2.5)]


def test_paper_numbers_parse_and_carry_their_source():
    paper = json.loads(PAPER.read_text())
    assert paper["section"].startswith("Appendix B")
    assert [(e["model"], e["value"], e["unit"]) for e in paper["entries"]] == [
        ("7B", 2.03, "TFLOPS"), ("14B", 10.90, "TFLOPS"), ("32B", 10.91, "TFLOPS")]
    for e in paper["entries"]:
        assert "Appendix B" in e["source"] and e["hardware"] == "GH200"
        assert float(e["printed"]) == e["value"]


def test_the_harness_takes_ratels_own_times_and_flops(checkout, tmp_path):
    from suite.runner import run_point
    r = run_point(spec(checkout), tmp_path / "ratel.json")
    assert r["status"] == "ok", r.get("log_tail")
    assert [s["step_time_s"] for s in r["steps"]] == pytest.approx([0.3, 0.6, 0.9, 1.2, 1.5])
    assert r["median"]["step_time_s"] == pytest.approx(1.2) and r["median"].get("loss") is None
    # the FLOPs of the GPT Ratel runs at tiny-llama's width: 12 h² per layer, no LM head, and attention
    # over batch_size (2) positions in each of seq_len (32) rows, main.py's layout
    assert r["model_flops_per_step"] == 32 * 2 * (6 * 12 * 64 * 64 * 3 + 12 * 3 * 64 * 2)


def test_a_ratel_run_past_the_timeout_shows_its_own_last_output_and_leaves_no_swap(checkout, monkeypatch, tmp_path):
    """The runner kills a late point's whole tree: Ratel's own lines reach the result's log tail, and
    its run directory (the swap within) goes with the runner's, though close() never ran."""
    from suite.runner import run_point
    monkeypatch.setenv("RATEL_STUB_ITERS", "2")
    monkeypatch.setenv("RATEL_STUB_HANG", "1")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    r = run_point(spec(checkout, timeout_s=20.0), tmp_path / "ratel.json")
    assert r["status"] == "timeout"
    assert "ratel| back_and_opt time 0.4\nratel| ---begin backward---" in r["log_tail"]
    run_dir = Path(json.loads((checkout / "seen.json").read_text())["cwd"])
    assert run_dir.name.startswith("ratel-") and temp in run_dir.parents
    assert list(temp.iterdir()) == []


def test_the_harness_records_unsupported_without_a_checkout(monkeypatch, tmp_path):
    from suite.runner import run_point
    monkeypatch.delenv("RATEL_HOME", raising=False)
    r = run_point(spec(), tmp_path / "ratel.json")
    assert r["status"] == "unsupported" and "RATEL_HOME" in r["reason"]


# The sizes in the artifact's config.json (RC4ML/LoHan feb88fe) that its host memory follows
ARTIFACT = {"zero_config": {"offload_optimizer": {"buffer_count": 8},
                            "offload_param": {"buffer_count": 6, "buffer_size": 1.2e9, "max_in_cpu": 1e8},
                            "offload_act": {"buffer_count": 4, "buffer_size": 1.2e9, "max_in_cpu": 1e8}}}
RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.mark.parametrize("machine", ["h100", "h200"])
def test_the_host_model_holds_the_measured_ratel_points(machine):
    """ratel_memory against the committed 1B points of each route (Ratel's model at the 7B width, 4
    layers, 1024 x 4). On disk the harness adds each process's resident memory, so the shared
    buffers count twice there; in host memory the model errs high by the blocks the allocator reuses."""
    for route in ("disk", "cpu"):
        result = json.loads((RESULTS / machine / "points" / "ratel" / f"1b_ratel_{route}.json").read_text())
        _, shape = Ratel._model(RunSpec.from_dict(RunSpec.stored(result["spec"])))
        need, how = ratel_memory.host_bytes(shape, ARTIFACT, route)
        measured = result["peak"]["host_rss_bytes"]
        if route == "disk":
            g = max(ratel_memory.sub_groups(ratel_memory.tensors(3584, 4, 152064, 1024)))
            counted = need + ratel_memory.SHARED_BUFFERS * 4 * g
            assert abs(counted - measured) < 1 * GiB, (route, counted / GiB, measured / GiB, how)
        else:
            assert measured <= need < measured + 3 * GiB, (route, need / GiB, measured / GiB, how)


def test_optimizer_sub_groups_follow_the_models_order():
    """Parameters join sub-groups in the model's order, each closed at 700 M elements or more: the
    7B shape's largest is 0.73 B, so its optimizer buffers are no larger than the 1B model's; an
    embedding of 700 M or more is a sub-group of its own."""
    sizes = ratel_memory.tensors(3584, 28, 152064, 4096)
    assert sum(sizes) == Ratel.ratel_params(3584, 28, 152064, 4096)
    groups = ratel_memory.sub_groups(sizes)
    assert sum(groups) == sum(sizes) and len(groups) == 7 and 0.70e9 <= max(groups) < 0.75e9
    assert ratel_memory.sub_groups(ratel_memory.tensors(5120, 48, 152064, 4096))[0] == 152064 * 5120
    disk = ratel_memory.host_bytes({"hidden_dim": 3584, "num_layers": 28, "vocab_size": 152064,
                                    "max_seq_len": 4096, "batch_size": 8}, ARTIFACT, "disk")[0]
    assert 100 * GiB < disk < 115 * GiB  # the 7B point's prediction (docs/log.md, 2026-11-27)


def test_a_run_the_host_cannot_hold_is_refused_before_anything_is_made(checkout, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    monkeypatch.setenv("MEGATRAIN_HOST_MEMORY_GB", "2")
    for route in ("disk", "cpu"):
        with pytest.raises(DoesNotFit, match=rf"ratel does not fit: host memory: needs \d+\.\d GiB, 2\.0 GiB "
                                             rf"available \(Ratel's {route} route at .* processes"):
            Ratel(spec(checkout, options={"offload": route}), CPU)
    assert not list((tmp_path / "temp").iterdir())
    Ratel(spec(checkout, options={"admission": False}), CPU).close()  # tried anyway when told


def test_a_config_without_the_artifacts_sizes_is_refused(checkout):
    (checkout / "config.json").write_text(json.dumps({"zero_config": {}}))
    with pytest.raises(Unsupported, match=r"config.json is not the artifact's config.json \(KeyError"):
        Ratel(spec(checkout), CPU)
