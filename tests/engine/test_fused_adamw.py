"""The one-pass host AdamW (megatrain/fused_adamw.py, host_adamw.cpp) against torch's AdamW and the
eager update it replaces, in both layouts of a tile's float32 masters; its build cache across
processes; that it lets other threads run; its setting's refusal and fallback. Builds the small C++
kernel once (a few seconds), or loads it from the per-user cache."""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from helpers import random_batches, store_params, tiny_checkpoint
from megatrain import adamw as tile_adamw
from megatrain import fused_adamw, host_executor
from megatrain.adamw import Update
from megatrain.config import OptimConfig, load_config
from megatrain.kernel_build import compiled
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile
from megatrain.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 5000  # a decayed matrix and a bias, neither a multiple of the vector width


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def tile_with_state(seed: int, split: bool = False, specs=None) -> Tile:
    specs = specs or [ParamSpec("w.weight", (N // 50, 50)), ParamSpec("w.bias", (37,))]
    tile = Tile("t", Layout.of(specs), torch.float32, torch.bfloat16, pinned=False, grad=False, split=split)
    gen = torch.Generator().manual_seed(seed)
    n = tile.layout.numel
    tile.exp_avg.copy_(torch.randn(n, generator=gen) * 1e-4)
    tile.exp_avg_sq.copy_(torch.rand(n, generator=gen) * 1e-6)
    start = torch.randn(n, generator=gen) * 0.02
    start[::97] = ((bits(start[::97]) & ~0xFFFF) | 0x8000).view(torch.float32)  # some halfway between two bf16s
    tile.write_master(start)  # after the moments: a split tile's flags live in exp_avg_sq
    return tile


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # the lerp from exp_avg, and (weight 0.7 > 0.5) from the gradient
@pytest.mark.parametrize("split", [False, True])
def test_one_pass_update_is_torchs_adamw(split, beta1):
    """Five updates of a tile (a decayed matrix, an undecayed bias; some steps with a clipping
    scale) against torch.optim.AdamW on the same float32 elements, one parameter per piece the
    update calls on: with fused=True (the eager update's kernel) bit for bit, masters and moments
    (a split tile's shadow the master's bf16 cast), in either layout; against the plain float32 reference
    (foreach=False) within a few float32 ulps of each quantity's scale (the fused kernels fuse
    some products and sums; a first moment that nearly cancels keeps the absolute error)."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, betas=(beta1, 0.95))
    tile = tile_with_state(0, split)
    n, decay_end = tile.layout.numel, tile.layout.decay_numel
    with tile.plain_state() as state:
        start = {k: v.clone() for k, v in state.items()}
    references = []
    for fused in (True, False):
        pieces = [torch.nn.Parameter(start["master"][a:b].clone()) for a, b in ((0, decay_end), (decay_end, n))]
        adamw = torch.optim.AdamW([{"params": [pieces[0]], "weight_decay": 0.1}, {"params": [pieces[1]], "weight_decay": 0.0}],
                                  lr=1e-3, betas=cfg.betas, eps=cfg.eps, fused=fused, foreach=False if not fused else None)
        for p, (a, b) in zip(pieces, ((0, decay_end), (decay_end, n))):
            adamw.state[p].update(step=torch.tensor(0.0), exp_avg=start["exp_avg"][a:b].clone(),
                                  exp_avg_sq=start["exp_avg_sq"][a:b].clone())
        references.append((pieces, adamw))
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        grad = torch.randn(n, generator=gen) * 1e-2
        scale = 0.37 if step % 2 else 1.0
        tile_adamw.adamw(tile, 0, n, grad.clone(), Update(step, 1e-3, cfg), scale, compiled=True)
        for pieces, adamw in references:
            for p, (a, b) in zip(pieces, ((0, decay_end), (decay_end, n))):
                p.grad = grad[a:b] * scale
            adamw.step()
    with tile.plain_state() as state:
        got = {k: v.clone() for k, v in state.items()}
    for (pieces, adamw), exact in zip(references, (True, False)):
        expected = {"master": torch.cat([p.detach() for p in pieces]),
                    "exp_avg": torch.cat([adamw.state[p]["exp_avg"] for p in pieces]),
                    "exp_avg_sq": torch.cat([adamw.state[p]["exp_avg_sq"] for p in pieces])}
        for name, want in expected.items():
            if exact:
                assert torch.equal(bits(got[name]), bits(want)), name
            else:  # a few ulps of each quantity's scale
                torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(tile.source.to(torch.bfloat16), got["master"].to(torch.bfloat16))
    assert not torch.equal(got["master"], start["master"]), "the update moved nothing"


@pytest.mark.parametrize("tail", ["kernel", "torch"])
@pytest.mark.parametrize("split", [False, True])
def test_one_pass_update_is_the_eager_one_in_pieces(monkeypatch, split, tail):
    """The tile's update in the pieces the worker gives it (slab ranges that start and end off the
    vector width, across the decayed and undecayed parts) and in chunks of adamw.CHUNK: the one
    pass leaves every bit of the eager update, the split's flags and low halves included; a bf16
    gradient is its float32 widening. `torch`: as where no scalar form of the kernel is torch's,
    the elements past each call's last full vector updated by torch's own fused AdamW."""
    monkeypatch.setattr(tile_adamw, "CHUNK", 4096)
    if tail == "torch":
        monkeypatch.setattr(fused_adamw, "_build", dataclasses.replace(fused_adamw.build(), scalar_tail=False))
    specs = [ParamSpec("w", (600, 400)), ParamSpec("norm", (7000,))]
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    eager, one_pass = tile_with_state(2, split, specs), tile_with_state(2, split, specs)
    n = eager.layout.numel
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16 if step == 3 else torch.float32)
        for lo, hi in ((0, 25_000), (25_000, 241_111), (241_111, n)):
            update = Update(step, 1e-3, cfg)
            tile_adamw.adamw(eager, lo, hi, grad[lo:hi].to(torch.float32, copy=True), update, 0.5)
            tile_adamw.adamw(one_pass, lo, hi, grad[lo:hi].clone(), update, 0.5, compiled=True)
    names = ["exp_avg", "exp_avg_sq"] + (["shadow", "low"] if split else ["master"])
    for name in names:
        assert torch.equal(getattr(one_pass, name).view(torch.int16 if name in ("shadow", "low") else torch.int32),
                           getattr(eager, name).view(torch.int16 if name in ("shadow", "low") else torch.int32)), name
    if split:
        assert int((one_pass.exp_avg_sq.view(torch.int32) < 0).sum()) > 0  # flags set by the updates


def calls_with_ticks_inside(update, calls: int = 5) -> list[int]:
    """For each of `calls` calls of `update()` on a worker thread (one OpenMP thread: a core left to
    the main thread), the ticks the main thread (sleeping 1 ms between them) took strictly
    between the call's start and end. A call that holds the GIL lets none in but at its edges
    (the main thread may take the GIL once as the call begins, and once as it returns)."""
    spans, done, ticks = [], threading.Event(), []

    def worker():
        try:
            torch.set_num_threads(1)
            update()  # the thread's first call, untimed: its OpenMP team starts
            for _ in range(calls):
                start = time.perf_counter()
                update()
                spans.append((start, time.perf_counter()))
        finally:  # a call that raises ends the ticks too (and leaves fewer spans than calls)
            done.set()

    threads = torch.get_num_threads()
    thread = threading.Thread(target=worker)
    thread.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    thread.join()
    torch.set_num_threads(threads)  # the worker's setting is the process's
    return [sum(a < t < b for t in ticks) for a, b in spans]


@pytest.mark.alone  # a loaded core stretches a call's edges, where a held GIL lets the ticks in
def test_the_one_pass_update_lets_other_threads_run():
    """The update runs on the optimizer worker while the main thread launches the GPU's kernels: it
    must not hold the GIL for its pass (a 7B layer's update held it about 50 ms on the H100 when
    the kernel did). Each call is long (2^24 elements: tens of ms), and in most of several calls the
    main thread ticks inside it more often than a call that holds the GIL allows at its edges. The
    same library called holding the GIL (ctypes.PyDLL) fails the same criterion in every call, so
    the criterion tells the two apart on a loaded machine too."""
    cfg = OptimConfig()
    n = 1 << 24
    master, grad, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.zeros(n), torch.zeros(n)
    inside = calls_with_ticks_inside(lambda: fused_adamw.update(grad, m, v, 1, 1e-3, 0.0, cfg, master=master))
    assert len(inside) == 5 and sum(k >= 5 for k in inside) >= 3, inside
    held = ctypes.PyDLL(str(fused_adamw.build().path)).megatrain_adamw_whole
    held.restype, held.argtypes = None, fused_adamw.build().library.megatrain_adamw_whole.argtypes
    args = (master.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), n, n, 1.0, 1e-3, 0.9, 0.95, 0.0, 1e-8, 1.0,
            0, 1, fused_adamw.build().form)
    assert all(k < 5 for k in calls_with_ticks_inside(lambda: held(*args))), "the criterion does not tell a held GIL"


def test_the_forms_found_are_torchs_and_the_probe_tells_them_apart():
    """torch's builds fuse different products and sums (torch 2.13's AVX2 kernel and 2.11's AVX-512
    one differ): the load finds the forms that are torch's here. The probe that finds them tells the
    forms apart, so it cannot pass a wrong one: of the vector and the scalar forms, each gives
    numbers no other gives (an update of random state with weight decay)."""
    build = fused_adamw.build()
    assert build.why is None and build.form in {v | s for v in fused_adamw.VECTOR_FORMS for s in fused_adamw.SCALAR_FORMS}
    gen = torch.Generator().manual_seed(1)
    for forms, n in ((fused_adamw.VECTOR_FORMS, 64 * fused_adamw.VECTOR), (fused_adamw.SCALAR_FORMS, fused_adamw.VECTOR - 1)):
        state = [torch.randn(n * 64, generator=gen) * 1e-2, torch.randn(n * 64, generator=gen) * 1e-3,
                 torch.rand(n * 64, generator=gen) * 1e-5]
        results = set()
        for form in forms:
            p, m, v = state[1] * 1e3, state[1].clone(), state[2].clone()
            for piece in range(64):  # calls of n elements: all vectors, or all scalar tail
                a, b = piece * n, (piece + 1) * n
                build.library.megatrain_adamw_whole(p[a:b].data_ptr(), state[0][a:b].data_ptr(),
                                                    m[a:b].data_ptr(), v[a:b].data_ptr(), n, n - n % fused_adamw.VECTOR,
                                                    1.0, 1e-3, 0.9, 0.999, 0.01, 1e-8, 1.0, 0, 1, form)
            results.add(tuple(t.view(torch.int32).numpy().tobytes() for t in (p, m, v)))
        assert len(results) == len(forms)


def test_a_second_process_builds_nothing(tmp_path):
    """The kernel is built once into the per-user cache (MEGATRAIN_CACHE_DIR here) and a later
    process loads it: with no C++ compiler at all (CXX names none) it has the kernel, compiles
    nothing, and updates as the first process did."""
    code = ("import json, torch; from megatrain import fused_adamw; from megatrain.config import OptimConfig\n"
            "b = fused_adamw.build(); n = 1000; p, g = torch.linspace(-1, 1, n), torch.linspace(1, -1, n) * 1e-2\n"
            "m, v = torch.zeros(n), torch.zeros(n)\n"
            "fused_adamw.update(g, m, v, 1, 1e-3, 0.1, OptimConfig(), master=p)\n"
            "print(json.dumps([b.compiled, b.why, str(b.path), p.sum().item(), v.sum().item()]))")
    env = {**os.environ, "MEGATRAIN_CACHE_DIR": str(tmp_path), "PYTHONPATH": ROOT}
    runs = []
    for cxx in (None, str(tmp_path / "no-such-compiler")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**env, **({"CXX": cxx} if cxx else {})})
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    (built, why, path, master, moment), (built_again, why_again, path_again, master_again, moment_again) = runs
    assert built and why is None and path.startswith(str(tmp_path))
    assert not built_again and why_again is None and path_again == path
    assert (master_again, moment_again) == (master, moment)
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [os.path.basename(path)]  # no temporaries left


def test_without_a_compiler_the_reason_is_given(tmp_path):
    """A process that must build the kernel and has no C++ compiler is told so, by name."""
    code = "from megatrain import fused_adamw; print(fused_adamw.probe())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "MEGATRAIN_CACHE_DIR": str(tmp_path), "PYTHONPATH": ROOT,
                              "CXX": str(tmp_path / "no-such-compiler")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"no C++ compiler found (CXX={tmp_path / 'no-such-compiler'})"


def test_a_kernel_called_while_another_thread_builds_a_kernel_waits_for_it(monkeypatch):
    """While a thread builds a kernel, torch sets a process-wide flag that FX is tracing, and a compiled
    function called meanwhile refuses to run (pytorch#126024); the engine's kernels wait and run."""
    import torch.fx._symbolic_trace as fx_trace
    double = compiled(lambda x, out: out.copy_(x * 2))
    x, out = torch.randn(1000), torch.zeros(1000)
    double(x, torch.empty(1000))  # built
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", True)  # another thread's build, in progress
    errors = []

    def call():
        try:
            double(x, out)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(0.3)
    assert worker.is_alive() and not out.any()  # waiting, nothing written
    fx_trace._is_fx_tracing_flag = False  # the build is done
    worker.join(60)
    assert not worker.is_alive() and not errors, errors
    assert torch.equal(out, x * 2)


def test_planning_imports_no_compiler_and_a_kernel_builds_at_its_first_call():
    """The modules that plan (shapes, the harness's spec, the workflow's grid) import neither dynamo nor
    inductor, about a second each on the 2-core machine: each kernel asks torch.compile at its first
    call, and the first call computes what the eager function does."""
    code = ("import sys; import megatrain.shapes, suite.spec, workflows.scripts.grid, megatrain.swiglu\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
            "import torch; from megatrain.kernel_build import compiled\n"
            "k = compiled(lambda a, b: a * torch.sigmoid(b)); a, b = torch.randn(64), torch.randn(64)\n"
            "print(torch.allclose(k(a, b), a * torch.sigmoid(b)), 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True True"]


def tree(tmp_path, kernel: str) -> dict:
    return {"model": {"pretrained": str(tmp_path / "init")},
            "engine": {"device": "cpu", "compute_dtype": "bfloat16", "optimizer_kernel": kernel},
            "optim": {"lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 1.0},
            "data": {"seq_len": 16, "batch_size": 2, "grad_accum": 2}, "steps": 3}


@pytest.mark.parametrize("split", [False, True])
def test_a_run_with_the_one_pass_update_is_the_eager_one(tmp_path, split):
    """bf16 compute on the CPU (a shadow to refresh), clipping (a scale on each update), whole or
    split masters: 3 steps alike to the bit."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    runs = []
    for kernel in ("eager", "compiled"):
        base = tree(tmp_path, kernel)
        base["engine"]["split_masters"] = split
        trainer = Trainer(load_config(base=base))
        try:
            assert trainer.settings.optimizer_kernel == kernel and trainer.settings.split_masters == split
            batches = random_batches(3, 2, 2, 16, trainer.shape.vocab, pad=True)
            runs.append(([trainer.train_step(mbs)["loss"] for mbs in batches], store_params(trainer)))
        finally:
            trainer.close()
    (eager_losses, eager), (losses, params) = runs
    assert losses == eager_losses
    for name in eager:
        assert torch.equal(params[name], eager[name]), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late, settings", [
    (0.0, {}),
    (1.0, {}),  # the next step's forward waits for a tile the failed update never publishes
    (1.0, {"optim": {"max_grad_norm": None}, "engine": {"grad_slabs": 1}}),  # the backward waits for the one slab
])
def test_an_update_that_fails_names_its_cause_on_the_main_thread(tmp_path, monkeypatch, late, settings):
    """The worker's exception reaches the step with its own type and message in the error's text
    (a harness that records only the message still says what failed), also when it comes `late`,
    while the main thread waits for what the failed worker would have given back."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")

    def broken(*args, **kwargs):
        time.sleep(late)
        raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function")
    monkeypatch.setattr(host_executor, "adamw", broken)
    base = tree(tmp_path, "eager")
    for section, values in settings.items():
        base[section] = {**base[section], **values}
    trainer = Trainer(load_config(base=base))
    try:
        batches = random_batches(2, 2, 2, 16, trainer.shape.vocab, pad=True)
        with pytest.raises(RuntimeError, match="the optimizer worker failed: RuntimeError: Detected that you are using FX"):
            for mbs in batches:
                trainer.train_step(mbs)
    finally:
        with pytest.raises(RuntimeError, match="optimizer worker failed"):
            trainer.close()


def test_a_compiled_update_that_cannot_build_is_refused_and_auto_falls_back(tmp_path, monkeypatch):
    """engine.optimizer_kernel: compiled on a machine where the kernel cannot be built is refused by
    name before the store is allocated; auto there is the eager update, the reason said; auto where
    it builds is the one pass, its set-up seconds recorded."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    trainer = Trainer(load_config(base=tree(tmp_path, "auto")))
    try:
        assert trainer.settings.optimizer_kernel == "compiled" and trainer.setup_s["optimizer_kernel"] >= 0
    finally:
        trainer.close()
    why = "no C++ compiler found (c++, g++ and clang++ are not on PATH)"
    monkeypatch.setattr(fused_adamw, "probe", lambda: why)
    trainer = Trainer(load_config(base=tree(tmp_path, "auto")))
    try:
        assert trainer.settings.optimizer_kernel == "eager" and why in trainer.optimizer_kernel_note
    finally:
        trainer.close()
    monkeypatch.setattr("megatrain.trainer.HostStore", None)  # reaching the allocation would fail otherwise
    with pytest.raises(ValueError, match="optimizer_kernel: compiled, but the host AdamW's C\\+\\+ kernel cannot be built"):
        Trainer(load_config(base=tree(tmp_path, "compiled")))
