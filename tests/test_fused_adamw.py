"""The one-pass host AdamW (megatrain/fused_adamw.py) against the eager update it replaces, and its
setting's refusals. Compiles a small C++ kernel (torch.compile, seconds, cached after)."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import random_batches, store_params, tiny_checkpoint
from megatrain import fused_adamw, optim, trainer as trainer_module
from megatrain.config import OptimConfig, load_config
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile
from megatrain.trainer import Trainer

N = 5000  # a decayed matrix and a bias, neither a multiple of the vector width


def tile_with_state(seed: int) -> Tile:
    specs = [ParamSpec("w.weight", (N // 50, 50)), ParamSpec("w.bias", (37,))]
    tile = Tile("t", Layout.of(specs), torch.float32, torch.bfloat16, pinned=False, grad=False)
    gen = torch.Generator().manual_seed(seed)
    n = tile.layout.numel
    tile.write_master(torch.randn(n, generator=gen) * 0.02)
    tile.exp_avg.copy_(torch.randn(n, generator=gen) * 1e-4)
    tile.exp_avg_sq.copy_(torch.rand(n, generator=gen) * 1e-6)
    return tile


def test_one_pass_update_tracks_torchs_fused_adamw():
    """Three updates of a tile (decayed matrix, undecayed bias): masters and moments within a few
    float32 ulps of the eager update (of each quantity's scale: a first moment that nearly cancels
    keeps the absolute error, not the relative one), and the shadow the master's bf16 cast exactly."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    eager, one_pass = tile_with_state(0), tile_with_state(0)
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        grad = torch.randn(eager.layout.numel, generator=gen) * 1e-3
        optim.adamw(eager, 0, eager.layout.numel, grad.clone(), step, 1e-3, cfg, 1.0)
        optim.adamw(one_pass, 0, one_pass.layout.numel, grad.clone(), step, 1e-3, cfg, 1.0, compiled=True)
    for name in ("master", "exp_avg", "exp_avg_sq"):  # a few ulps of each quantity's scale
        expected = getattr(eager, name)
        torch.testing.assert_close(getattr(one_pass, name), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    assert torch.equal(one_pass.shadow, one_pass.master.to(torch.bfloat16))
    assert not torch.equal(one_pass.master, tile_with_state(0).master), "the update moved nothing"


def test_the_one_pass_update_lets_other_threads_run():
    """The update runs on the optimizer worker while the main thread launches the GPU's kernels: the
    compiled kernel must not hold the GIL for its whole pass (inductor's default Python binding does;
    each 7B layer's update then stalled the launches for about 50 ms on the H100)."""
    cfg = OptimConfig()
    n = 8_000_000
    args = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
    fused_adamw.update(*args, 1, 1e-3, 0.0, cfg)  # built before the timing
    inside, done, ticks = threading.Event(), threading.Event(), []

    def worker():
        torch.set_num_threads(1)  # a core left to the main thread
        # the thread's first update, untimed: its one-time start in a new thread at a new thread count
        # (a 0.3 s stall of the main thread on the 2-core CI machine) is not the per-layer stall looked for
        fused_adamw.update(*args, 2, 1e-3, 0.0, cfg)
        inside.set()
        for step in range(3, 7):
            fused_adamw.update(*args, step, 1e-3, 0.0, cfg)
        done.set()

    threads = torch.get_num_threads()
    thread = threading.Thread(target=worker)
    thread.start()
    inside.wait()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.0005)
    thread.join()
    torch.set_num_threads(threads)  # the worker's setting is the process's
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    # held for a whole pass, the main thread would not run between the update's start and its end
    assert len(ticks) >= 20 and max(gaps) < 0.5 * (ticks[-1] - ticks[0]), (len(ticks), max(gaps, default=0))


def test_an_update_called_while_another_thread_builds_a_kernel_waits_for_it(monkeypatch):
    """While a thread builds a kernel, torch sets a process-wide flag that FX is tracing, and a compiled
    function called meanwhile refuses to run (pytorch#126024); the engine's kernels wait and run."""
    import torch.fx._symbolic_trace as fx_trace
    cfg = OptimConfig()
    n = 1000
    args = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
    fused_adamw.update(*args, 1, 1e-3, 0.0, cfg)
    master = args[0].clone()
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", True)  # another thread's build, in progress
    errors = []

    def update():
        try:
            fused_adamw.update(*args, 2, 1e-3, 0.0, cfg)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    worker = threading.Thread(target=update)
    worker.start()
    worker.join(0.3)
    assert worker.is_alive() and torch.equal(args[0], master)  # waiting, nothing written
    fx_trace._is_fx_tracing_flag = False  # the build is done
    worker.join(60)
    assert not worker.is_alive() and not errors, errors
    assert not torch.equal(args[0], master)


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
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True True"]


def tree(tmp_path, kernel: str) -> dict:
    return {"model": {"pretrained": str(tmp_path / "init")},
            "engine": {"device": "cpu", "compute_dtype": "bfloat16", "optimizer_kernel": kernel},
            "optim": {"lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 1.0},
            "data": {"seq_len": 16, "batch_size": 2, "grad_accum": 2}, "steps": 3}


def test_a_run_with_the_one_pass_update_tracks_the_eager_one(tmp_path):
    """bf16 compute on the CPU (a shadow to refresh), clipping: 3 steps alike within float32 ulps."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    runs = []
    for kernel in ("eager", "compiled"):
        trainer = Trainer(load_config(base=tree(tmp_path, kernel)))
        try:
            assert trainer.settings.optimizer_kernel == kernel
            batches = random_batches(3, 2, 2, 16, trainer.shape.vocab, pad=True)
            runs.append(([trainer.train_step(mbs)["loss"] for mbs in batches], store_params(trainer)))
        finally:
            trainer.close()
    (eager_losses, eager), (losses, params) = runs
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)
    for name in eager:
        torch.testing.assert_close(params[name], eager[name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


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
    monkeypatch.setattr(optim, "adamw", broken)
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


def test_a_compiled_update_that_cannot_build_is_refused(tmp_path, monkeypatch):
    """engine.optimizer_kernel: compiled on a machine where torch.compile cannot build is refused
    by name before the store is allocated; auto on the CPU is the eager update."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    monkeypatch.setattr(fused_adamw, "probe", lambda cfg: "InvalidCxxCompiler: no working C++ compiler found")
    monkeypatch.setattr("megatrain.trainer.HostStore", None)  # reaching the allocation would fail otherwise
    with pytest.raises(ValueError, match="optimizer_kernel: compiled, but torch.compile cannot build"):
        Trainer(load_config(base=tree(tmp_path, "compiled")))
    monkeypatch.undo()
    trainer = Trainer(load_config(base=tree(tmp_path, "auto")))
    try:
        assert trainer.settings.optimizer_kernel == "eager"
    finally:
        trainer.close()


@pytest.mark.parametrize("compiled_rate, chosen", [(0.5, "eager"), (2.0, "compiled")])
def test_auto_keeps_the_compiled_update_only_where_it_is_faster(tmp_path, monkeypatch, compiled_rate, chosen):
    """Where `auto` resolves to the compiled update (a GPU run), the trainer times both on this host
    and keeps the faster; the rates are reported. (A serial build ran at a fraction of the eager rate.)"""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    real = trainer_module.resolve
    monkeypatch.setattr(trainer_module, "resolve",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), optimizer_kernel="compiled"))
    monkeypatch.setattr(trainer_module, "rates", lambda cfg: {"eager": 1.0, "compiled": compiled_rate})
    trainer = Trainer(load_config(base=tree(tmp_path, "auto")))
    try:
        assert trainer.settings.optimizer_kernel == chosen
        assert trainer.optimizer_rates == {"eager": 1.0, "compiled": compiled_rate}
    finally:
        trainer.close()


class FakeISA:
    """A candidate vector instruction set of inductor's: its own check, and where `extra` names a
    further one's test program, that check, which adds a flag when it passes (as AVX-512's bf16);
    `check(name, code)` answers. Its answer is kept for the process, as inductor's is."""

    def __init__(self, name, check, extra=None):
        self.name, self.check, self.extra, self.flags = name, check, extra, f"-m{name.replace(' ', ' -m')}"
        self.answer = None

    def __str__(self):
        return self.name

    def build_arch_flags(self):
        return self.flags

    def check_build(self, code):
        return self.check(self.name, code)

    def __bool__(self):
        if self.answer is None:
            self.answer = self.check_build("own")
            if self.answer and self.extra and self.check_build(self.extra):
                self.flags += " -mextra"
        return self.answer


def fake_isas(monkeypatch, tmp_path, names, check, extra=None):
    """A fresh process's candidates (`names`; the CPU's flags admit each but "neon"), their checks
    by `check`, the answers kept under `tmp_path`; returns them and the calls of inductor's list."""
    import torch._inductor.config as inductor
    import torch._inductor.cpu_vec_isa as vec_isa
    from megatrain import kernel_build
    fakes, listed, flags = [FakeISA(n, check, (extra or {}).get(n)) for n in names], [], ["avx2", "avx512", "amx_tile"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(kernel_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vec_isa, "x86_isa_checker", lambda: flags)
    monkeypatch.setattr(vec_isa, "supported_vec_isa_list", fakes)
    monkeypatch.setattr(vec_isa, "valid_vec_isa_list",  # inductor's: the sets the flags admit that pass
                        lambda: listed.append([str(f) for f in fakes if set(str(f).split()) <= set(flags) and f]))
    return fakes, listed


def test_the_vector_isa_checks_run_side_by_side(monkeypatch, tmp_path):
    """kernel_build.check_vector_isas: each candidate instruction set the CPU's flags allow is
    checked on a thread of its own, all at once, before inductor's list (which then reuses the
    answers); a set the flags lack is not checked."""
    from megatrain import kernel_build
    checked = {}

    def check(name, code):
        checked[name] = threading.current_thread().name
        time.sleep(0.4)
        return True
    _, listed = fake_isas(monkeypatch, tmp_path, ("avx512 amx_tile", "avx512", "avx2", "neon"), check)
    start = time.perf_counter()
    kernel_build.check_vector_isas()
    assert time.perf_counter() - start < 1.0  # three checks of 0.4 s, side by side
    assert sorted(checked) == ["avx2", "avx512", "avx512 amx_tile"]  # not "neon"
    assert len(set(checked.values())) == 3 and len(listed) == 1


def test_passed_vector_isa_checks_are_replayed_in_later_processes(monkeypatch, tmp_path):
    """kernel_build.check_vector_isas: once every check has passed, each check's answer is kept
    beside inductor's cache, and a later process with the same torch, Python, compiler and
    candidates replays them: a set's further checks too, with the flags they add, so inductor's
    list and its first build check nothing; a failed check is never kept; another key, or a
    check the record lacks, is checked again."""
    from megatrain import kernel_build
    checked, answer = [], {}

    def check(name, code):
        checked.append(f"{name}:{code}")
        return answer.get(f"{name}:{code}", True)

    def process(extra_code="extra"):  # a fresh process: new candidates, nothing checked yet
        fakes, listed = fake_isas(monkeypatch, tmp_path, ("avx512", "avx2"), check, extra={"avx512": extra_code})
        checked.clear()
        kernel_build.check_vector_isas()
        listed.clear()
        flags = [f.build_arch_flags() for f in fakes if f]  # inductor's list, as its first build reads it
        return sorted(checked), flags, listed
    all_checks = ["avx2:own", "avx512:extra", "avx512:own"]
    answer["avx2:own"] = False  # a check that fails: checked every time, nothing kept
    assert process()[0] == all_checks and process()[0] == all_checks
    assert not (tmp_path / "megatrain_vector_isas.json").exists()
    answer.clear()
    assert process()[:2] == (all_checks, ["-mavx512 -mextra", "-mavx2"])  # checked and kept
    assert process()[:2] == ([], ["-mavx512 -mextra", "-mavx2"])  # replayed, the extra flag too
    assert process("extra2")[0] == ["avx512:extra2"]  # a check the record lacks: made, then kept
    assert process("extra2")[0] == [] and process()[0] == []
    monkeypatch.setattr(kernel_build.torch, "__version__", "0.0.0")
    assert process()[0] == all_checks  # another torch: checked again
    assert process()[0] == []
    assert len(json.loads((tmp_path / "megatrain_vector_isas.json").read_text())["checks"]) == 2


def test_the_kept_vector_isa_answers_reach_a_real_later_process(tmp_path):
    """The same with this torch's own inductor, in two fresh processes sharing a cache: the first
    checks and keeps the answers; in the second neither the check nor inductor's list and its
    choice of a set for a build (which made each set's further checks, one after another: seconds
    on torch 2.11) checks anything, and the choice and its flags are the same."""
    probe = ("import json, torch; from torch._inductor import cpu_vec_isa; calls = []; "
             "real = cpu_vec_isa.VecISA.check_build; "
             "cpu_vec_isa.VecISA.check_build = lambda self, code: calls.append(str(self)) or real(self, code); "
             "from megatrain import kernel_build; kernel_build.check_vector_isas(); "
             "isas = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]; "
             "print(json.dumps([len(calls), isas, cpu_vec_isa.pick_vec_isa().build_arch_flags()]))")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                      check=True, timeout=300).stdout.splitlines()[-1]) for _ in range(2)]
    (checks_first, first, flags_first), (checks_second, second, flags_second) = runs
    if not first or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no candidate sets to keep: not an x86 CPU, or none passed inductor's check")
    assert (tmp_path / "megatrain_vector_isas.json").is_file()
    assert checks_first > 0 and checks_second == 0
    assert first == second and flags_first == flags_second


def test_the_rates_time_both_updates():
    """optim.rates runs both updates (compiling the one-pass kernel) and gives positive rates."""
    got = optim.rates(OptimConfig(), n=1 << 16, reps=2)
    assert set(got) == {"eager", "compiled"} and all(r > 0 for r in got.values())
