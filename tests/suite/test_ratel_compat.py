"""Ratel's compatibility layer on CPU: the FlashAttention shim against explicit attention, and the
import-time patches applied in a fresh process, to stand-in modules and (with RATEL_HOME) to the artifact."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from baselines.ratel import compat_env
from baselines.ratel_compat import PATH as COMPAT
from baselines.ratel_compat.flash_attn.flash_attention import FlashAttention


def reference(qkv, causal=False, scale=None, key_mask=None):
    """Softmax attention written out: qkv [b, s, 3, h, d] -> [b, s, h, d], in float64."""
    q, k, v = (qkv[:, :, i].double() for i in range(3))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    s = qkv.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def qkv(b=2, s=7, h=3, d=8, seed=0):
    return torch.randn(b, s, 3, h, d, generator=torch.Generator().manual_seed(seed))


# float32 against float64: SDPA's math kernel sums in float32, so agreement to ~1e-6 relative
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_matches_explicit_attention(causal):
    x = qkv()
    out, weights = FlashAttention().eval()(x, causal=causal)
    assert weights is None and out.shape == (2, 7, 3, 8)
    torch.testing.assert_close(out.double(), reference(x, causal), **TOL)


def test_gpt_model_call_is_bidirectional_like_flash_attn_1():
    # gpt_model.py calls `self.attention(QKV)`: flash-attn 1.0.4's causal defaults to False
    x = qkv()
    out, _ = FlashAttention()(x)
    torch.testing.assert_close(out.double(), reference(x, causal=False), **TOL)
    assert not torch.allclose(out.double(), reference(x, causal=True))


def test_softmax_scale_and_dropout_follow_flash_attn_1():
    x = qkv()
    out, _ = FlashAttention(softmax_scale=0.5).eval()(x)
    torch.testing.assert_close(out.double(), reference(x, scale=0.5), **TOL)
    attention = FlashAttention(attention_dropout=0.5)
    torch.testing.assert_close(attention.eval()(x)[0].double(), reference(x), **TOL)  # no dropout in eval
    assert not torch.allclose(attention.train()(x)[0].double(), reference(x))  # dropout in training


def test_key_padding_mask_zeros_padded_queries_and_hides_padded_keys():
    x = qkv()
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False
    out, _ = FlashAttention()(x, key_padding_mask=keep, causal=True)
    assert torch.all(out[1, 5:] == 0)
    torch.testing.assert_close(out[0].double(), reference(x[:1], causal=True)[0], **TOL)
    torch.testing.assert_close(out[1, :5].double(), reference(x[1:, :5], causal=True)[0], **TOL)


def test_unpadded_sequences_by_cu_seqlens_attend_within_themselves():
    x = qkv(b=1, s=9)[0]  # [total 9, 3, h, d]: sequences of 4 and 5 tokens
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, _ = FlashAttention()(x, cu_seqlens=cu, max_s=5, causal=True)
    expect = torch.cat([reference(x[None, :4], causal=True)[0], reference(x[None, 4:], causal=True)[0]])
    torch.testing.assert_close(out.double(), expect, **TOL)


def test_gradients_flow_like_explicit_attention():
    x = qkv().requires_grad_()
    FlashAttention()(x, causal=True)[0].square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    reference(x64, causal=True).square().sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_in_fp16_on_the_gpu(cuda_only, causal):
    """What gpt_model.py runs: fp16 qkv on cuda, SDPA's flash kernel, against float64 on the CPU."""
    x = qkv(b=2, s=256, h=4, d=128).half().cuda()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out, _ = FlashAttention().eval()(x, causal=causal)
    assert out.dtype == torch.float16 and out.shape == (2, 256, 4, 128)
    # fp16 inputs and output: a few units in the last place of values of order 0.1-1
    torch.testing.assert_close(out.cpu().double(), reference(x.cpu().float(), causal), rtol=1e-2, atol=2e-3)


# Stand-ins for the two modules the layer adapts: a builder whose subclass passes -std=c++14 and whose
# jit_load reports the flags torch's load() would get; a gpt_model whose checkpoint reports its kwargs.
STANDINS = {
    "op_ds/ops/op_builder/builder.py": (
        "class OpBuilder:\n"
        "    def cxx_args(self):\n        return []\n"
        "    def jit_load(self, verbose=True):\n        return ['-std=c++20'] + self.cxx_args()\n"
        "class CUDAOpBuilder(OpBuilder):\n"
        "    def cxx_args(self):\n        return ['-O3', '-std=c++17', '-g']\n"),
    "op_ds/ops/op_builder/async_io.py": (
        "from .builder import OpBuilder\n"
        "class AsyncIOBuilder(OpBuilder):\n"
        "    def cxx_args(self):\n        return ['-g', '-O0', '-std=c++14', '-laio']\n"),
    "gpt_model.py": "from torch.utils.checkpoint import checkpoint\n",
}
# A ratel_init whose context wraps every module class's __init__ on entry and sets back on exit what it
# read on entry, as the artifact's SB_Init does; the wrapper counts the constructions it sees.
RATEL_INIT = (
    "import torch\n"
    "seen = []\n"
    "def get_all_subclasses(cls):\n"
    "    found = []\n"
    "    def recurse(c):\n"
    "        for s in c.__subclasses__():\n            found.append(s); recurse(s)\n"
    "    recurse(cls)\n    return found\n"
    "def wrap(f):\n"
    "    def wrapper(module, *a, **k):\n        seen.append(type(module).__name__); f(module, *a, **k)\n"
    "    return wrapper\n"
    "def shutdown_init_context():\n"
    "    for cls in get_all_subclasses(torch.nn.Module):\n        cls.__init__ = cls._old_init\n"
    "class SB_Init:\n"
    "    def __enter__(self):\n"
    "        for cls in get_all_subclasses(torch.nn.Module):\n"
    "            cls._old_init = cls.__init__; cls.__init__ = wrap(cls.__init__)\n"
    "    def __exit__(self, *exc):\n        shutdown_init_context()\n")


def run_in_ratel_env(code: str, checkout: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=300,
                          env=compat_env(checkout, {**os.environ, **env}))


def test_patches_apply_as_the_modules_load(tmp_path):
    for name, text in STANDINS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    code = ("import json, torch.utils.checkpoint as tc\n"
            "tc.checkpoint = lambda f, *a, **kw: kw\n"  # reports what gpt_model's calls pass
            "from op_ds.ops.op_builder.async_io import AsyncIOBuilder\n"
            "from op_ds.ops.op_builder.builder import CUDAOpBuilder\n"
            "import gpt_model\n"
            "print(json.dumps([AsyncIOBuilder().jit_load(), CUDAOpBuilder().jit_load(), gpt_model.checkpoint(None, 1),"
            " gpt_model.checkpoint(None, 1, use_reentrant=False), AsyncIOBuilder().cxx_args()]))\n")
    r = run_in_ratel_env(code, tmp_path)
    assert r.returncode == 0, r.stderr
    aio, cuda, default, explicit, unchanged = json.loads(r.stdout)
    assert aio == ["-std=c++20", "-g", "-O0", "-laio"] and cuda == ["-std=c++20", "-O3", "-g"]
    assert default == {"use_reentrant": True} and explicit == {"use_reentrant": False}
    assert "-std=c++14" in unchanged  # outside jit_load the builder's own flags stand
    assert "[ratel_compat] op builders" in r.stderr and "[ratel_compat] gpt_model" in r.stderr
    assert not list(tmp_path.rglob("__pycache__"))  # no bytecode written into the checkout


@pytest.mark.parametrize("compat", [True, False])
def test_module_classes_leave_the_init_context_as_they_entered(tmp_path, compat):
    """nn.MSELoss has no __init__ of its own in this torch: without the layer, the context's wrapper stays on it."""
    (tmp_path / "ratel_init.py").write_text(RATEL_INIT)
    code = ("import json, torch\n"
            "import ratel_init\n"
            "classes = set(ratel_init.get_all_subclasses(torch.nn.Module))\n"
            "own = lambda: {c: c.__dict__.get('__init__') for c in classes}\n"
            "before = own()\n"
            "with ratel_init.SB_Init():\n    torch.nn.Linear(2, 2)\n"
            "inside = list(ratel_init.seen)\n"
            "torch.nn.MSELoss(); torch.nn.Linear(2, 2)\n"
            "changed = sorted(c.__name__ for c in classes if own()[c] is not before[c])\n"
            "print(json.dumps([before[torch.nn.MSELoss] is None, inside, ratel_init.seen[len(inside):], changed]))\n")
    r = (run_in_ratel_env(code, tmp_path) if compat else  # without the layer: the artifact's own exit
         subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300))
    assert r.returncode == 0, r.stderr
    mse_inherits_init, inside, after, changed = json.loads(r.stdout)
    assert mse_inherits_init and inside == ["Linear"]
    if compat:
        assert after == [] and changed == []
        assert "[ratel_compat] ratel_init" in r.stderr
    else:
        assert "MSELoss" in after and "MSELoss" in changed


# A CPUAdam whose step reports the moments it is given, as the artifact's passes them to its C++ op by
# pointer with the parameter's count of elements.
CPU_ADAM = (
    "import torch\n"
    "class DeepSpeedCPUAdam(torch.optim.Optimizer):\n"
    "    def __init__(self, params, fp32_optimizer_states=True):\n"
    "        super().__init__(params, {})\n        self.fp32_optimizer_states = fp32_optimizer_states\n"
    "    def step(self, closure=None):\n"
    "        return [(tuple(self.state[p]['exp_avg'].shape), self.state[p]['exp_avg_sq'].dtype == torch.float32,\n"
    "                 float(self.state[p]['exp_avg'].abs().sum())) for g in self.param_groups for p in g['params']]\n")


def test_an_emptied_adam_moment_is_its_zeros_again_at_the_step(tmp_path):
    """The host-memory route's set-up empties the moments and nothing fills them (an upstream bug that
    ends in a segmentation fault): the step sees zeros of the parameter's size; a filled moment is left."""
    (tmp_path / "op_ds/ops").mkdir(parents=True)
    (tmp_path / "op_ds/ops/CPUAdam.py").write_text(CPU_ADAM)
    code = ("import json, torch\n"
            "from op_ds.ops.CPUAdam import DeepSpeedCPUAdam\n"
            "a, b = torch.zeros(6, dtype=torch.float16), torch.zeros(4, dtype=torch.float16)\n"
            "opt = DeepSpeedCPUAdam([a, b])\n"
            "for p in (a, b):\n"
            "    opt.state[p]['exp_avg'] = torch.full((p.numel(),), 2.0)\n"
            "    opt.state[p]['exp_avg_sq'] = torch.full((p.numel(),), 2.0)\n"
            "opt.state[a]['exp_avg'].data = torch.Tensor(); opt.state[a]['exp_avg_sq'].data = torch.Tensor()\n"
            "print(json.dumps(opt.step()))\n")
    r = run_in_ratel_env(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [[[6], True, 0.0], [[4], True, 8.0]]
    assert "[ratel_compat] CPUAdam" in r.stderr


QUEUE_FEEDER = """
import multiprocessing as mp

def reader(q):
    q.get()  # the disk route's optimizer process, waiting for what main.py sends

if __name__ == "__main__":
    mp.set_start_method("spawn")
    q = mp.Queue()
    child = mp.Process(target=reader, args=(q,), daemon=True)
    child.start()
    q.put(lambda: 0)  # does not pickle: the feeder thread drops it
    child.join(10)
    print("joined", child.exitcode)
"""


@pytest.mark.parametrize("compat", [True, False])
def test_a_queue_item_that_cannot_be_sent_ends_the_run(tmp_path, compat):
    """Dropped by Python's queue feeder, it would leave the reader waiting and main.py at its final join."""
    (tmp_path / "feed.py").write_text(QUEUE_FEEDER)
    env = compat_env(tmp_path, dict(os.environ)) if compat else dict(os.environ)
    start = time.monotonic()
    r = subprocess.run([sys.executable, "feed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    if compat:
        assert r.returncode == 70 and "joined" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
        assert "[ratel_compat] a multiprocessing queue could not send a function" in r.stderr
        assert time.monotonic() - start < 8  # at once, not at the join's timeout
    else:  # Python's own handling: printed, dropped, and the reader still waiting at the join's timeout
        assert r.returncode == 0 and "joined None" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_ratels_processes_answer_the_runners_request_for_their_stacks(tmp_path):
    # the runner sends a late point's process group SIGUSR1 (suite/runner.py): Ratel's processes
    # write where they are and run on, as the worker does, rather than end without a word
    code = ("import os, signal, time\n"
            "def waiting_in_ratel():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    time.sleep(0.2)\n"
            "    print('still running', flush=True)\n"
            "waiting_in_ratel()\n")
    r = run_in_ratel_env(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "still running" in r.stdout
    assert "most recent call first" in r.stderr and "waiting_in_ratel" in r.stderr


def test_the_compat_directory_holds_no_copy_of_ratel():
    names = {p.relative_to(COMPAT).as_posix() for p in COMPAT.rglob("*.py")}
    assert names == {"__init__.py", "sitecustomize.py", "ratel_patches.py", "ratel_probe.py",
                     "flash_attn/__init__.py", "flash_attn/flash_attention.py"}


@pytest.mark.skipif(not os.environ.get("RATEL_HOME"), reason="RATEL_HOME: a clone of RC4ML/LoHan")
def test_the_artifacts_op_builders_get_torchs_cpp_standard():
    """The real builders under the layer: their import (distutils), and the flags torch's load() receives."""
    checkout = Path(os.environ["RATEL_HOME"])
    code = ("import json, sys, types, torch.utils.cpp_extension as ext\n"
            "seen = {}\n"
            "ext.load = lambda **kw: seen.setdefault(kw['name'], kw['extra_cflags'])\n"
            "sys.modules.setdefault('ninja', types.ModuleType('ninja'))\n"
            "from op_ds.ops.op_builder.async_io import AsyncIOBuilder\n"
            "from op_ds.ops.op_builder.CPUAdamBuilder import CPUAdamBuilder\n"
            "AsyncIOBuilder.is_compatible = lambda self, verbose=True: True\n"
            "AsyncIOBuilder().jit_load(verbose=False); CPUAdamBuilder().jit_load(verbose=False)\n"
            "print(json.dumps(seen))\n")
    r = run_in_ratel_env(code, checkout)
    assert r.returncode == 0, r.stderr
    flags = json.loads(r.stdout.strip().splitlines()[-1])  # the builders print warnings before it
    assert set(flags) == {"async_io", "cpu_adam"}
    assert not [f for fs in flags.values() for f in fs if f.startswith("-std=")], flags
