"""The Ratel runner on CPU: its refusals, and the spec -> main.py mapping run against a stub checkout."""
import json
import sys
from pathlib import Path

import pytest
import torch

from megatrain.batch import Batch
from suite.spec import RunSpec
from baselines.ratel import RUN_SH_FLAGS, Ratel, parse_output
from suite.system import Unsupported

CPU = torch.device("cpu")
PAPER = Path(__file__).resolve().parents[1] / "baselines" / "paper_ratel.json"

# Prints what main.py prints per iteration (forward i/10 s, back_and_opt 2i/10 s), with a fixed loop
# count like the artifact's; records its argv and the config it was given. RATEL_STUB_ITERS and
# RATEL_STUB_EXIT change the loop count and the exit code.
STUB_MAIN = '''
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
json.dump({"argv": sys.argv, "config": json.load(open(args["--sb_config"]))}, open("seen.json", "w"))
print("[0, 1, 2]")
for i in range(int(os.environ.get("RATEL_STUB_ITERS", 10))):
    print(f"-----------------------Iter {i}-----------------------")
    print("---begin forward---")
    print("forward time", (i + 1) / 10)
    print("---begin backward---")
    print("back_and_opt time", 2 * (i + 1) / 10)
if os.environ.get("RATEL_STUB_EXIT"):
    print("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    sys.exit(int(os.environ["RATEL_STUB_EXIT"]))
'''


def _config(nvme: str) -> dict:
    part = {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4}
    return {"zero_config": {"offload_optimizer": dict(part), "offload_param": dict(part), "offload_act": dict(part)},
            "aio_config": {"block_size": 1048576, "queue_depth": 32, "thread_count": 2}}


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "LoHan"
    (root / "flash_attn").mkdir(parents=True)
    (root / "flash_attn" / "__init__.py").write_text("")
    (root / "flash_attn" / "flash_attention.py").write_text("class FlashAttention: pass\n")
    # the README's environment, faked inside the checkout (the probe runs there): fast, and seen in info()
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text("__version__ = '2.0.0+stub'\n")
    (root / "main.py").write_text(STUB_MAIN)
    (root / "config.json").write_text(json.dumps(_config("/RAID0/not-here")))
    (tmp_path / "nvme").mkdir()
    return root


def spec(checkout=None, **kw) -> RunSpec:
    options = {"checkout": str(checkout), "python": sys.executable, "nvme_path": str(checkout.parent / "nvme"),
               "approximate_model": True} if checkout else {}
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


def test_the_spec_maps_onto_main_py_and_steps_replay_its_iterations(checkout):
    s = spec(checkout, options={"args": {"swap_ratio": 0.5}})
    system = Ratel(s, CPU)
    try:
        batch = Batch(torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
        rows = [system.step([batch]) for _ in range(s.total_steps)]
        info = system.info()
    finally:
        system.close()
    seen = json.loads((checkout / "seen.json").read_text())
    args = dict(zip(seen["argv"][1::2], seen["argv"][2::2]))
    assert seen["argv"][0] == "main.py"
    # tiny-llama: hidden 64, 3 layers, 4 heads, vocab 256
    assert {k: args[f"--{k}"] for k in ("hidden_dim", "num_layers", "num_heads", "vocab_size", "max_seq_len",
                                        "batch_size")} == {"hidden_dim": "64", "num_layers": "3", "num_heads": "4",
                                                           "vocab_size": "256", "max_seq_len": "32", "batch_size": "2"}
    assert args["--swap_ratio"] == "0.5" and args["--is_nvme"] == str(RUN_SH_FLAGS["is_nvme"])
    nvme = str(checkout.parent / "nvme")
    assert {part["nvme_path"] for part in seen["config"]["zero_config"].values()} == {nvme}
    # the first warmup + steps of main.py's ten iterations, one per step(), timed by Ratel itself
    assert [r["ratel_iteration"] for r in rows] == [0, 1, 2, 3, 4]
    for i, r in enumerate(rows):
        assert r["loss"] is None
        assert r["forward_s"] == pytest.approx((i + 1) / 10)
        assert r["step_time_s"] == pytest.approx(3 * (i + 1) / 10)
    assert info["iterations_used"] == 5 and info["ratel_params"] > 0 and info["torch"] == "2.0.0+stub"
    assert any("intermediate_size 128" in d for d in info["differences_from_spec"])
    assert not Path(system.workdir).exists()


def test_a_different_model_family_is_refused_unless_approximated(checkout):
    with pytest.raises(Unsupported, match=r"only its own GPT-2-style model.*intermediate_size 128.*"
                                          r"num_key_value_heads 2.*approximate_model"):
        Ratel(spec(checkout, options={"approximate_model": False}), CPU)


@pytest.mark.parametrize("change, error, message", [
    (dict(grad_accum=2), Unsupported, "grad_accum 2: Ratel's main.py has no gradient accumulation"),
    (dict(options={"nvme_path": "/no/such/raid"}), Unsupported, r"offloads to NVMe at \['/no/such/raid'\]"),
    (dict(options={"args": {"batch_size": 4}}), ValueError, "come from the spec"),
    (dict(options={"nvme": "x"}), ValueError, "unknown"),
])
def test_what_main_py_cannot_express_is_refused(checkout, change, error, message):
    with pytest.raises(error, match=message):
        Ratel(spec(checkout, **change), CPU)


def test_an_environment_without_flash_attn_1_is_refused(checkout):
    for f in (checkout / "flash_attn").iterdir():
        f.unlink()
    (checkout / "flash_attn").rmdir()
    with pytest.raises(Unsupported, match=r"cannot import flash_attn.flash_attention.*flash-attn 1.0.4"):
        Ratel(spec(checkout), CPU)


@pytest.mark.parametrize("env, error, message", [
    ({"RATEL_STUB_ITERS": "3"}, RuntimeError, r"(?s)printed 3 complete iterations; the spec needs 5.*Iter 2"),
    ({"RATEL_STUB_ITERS": "0"}, RuntimeError, r"(?s)no per-iteration times in Ratel's output.*\[0, 1, 2\]"),
    ({"RATEL_STUB_EXIT": "1"}, torch.cuda.OutOfMemoryError, "Ratel ran out of device memory"),
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
    # the FLOPs of the GPT Ratel runs at tiny-llama's width: 12 h² per layer, no LM head
    assert r["model_flops_per_step"] == 2 * 32 * (6 * 12 * 64 * 64 * 3 + 12 * 3 * 64 * 32)


def test_the_harness_records_unsupported_without_a_checkout(monkeypatch, tmp_path):
    from suite.runner import run_point
    monkeypatch.delenv("RATEL_HOME", raising=False)
    r = run_point(spec(), tmp_path / "ratel.json")
    assert r["status"] == "unsupported" and "RATEL_HOME" in r["reason"]
