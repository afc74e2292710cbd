"""Learning-rate schedules: transformers.get_scheduler's, applied as the HF Trainer applies them.

Each schedule's rates are the library's scheduler's over torch.optim.AdamW to the bit, and a
streamed run under a schedule trains as the plain transformers + AdamW reference does
(tests/engine/test_engine_reference.py's tolerances)."""
from __future__ import annotations

import math
import typing

import pytest
import torch
from transformers import get_scheduler
from transformers.trainer_utils import SchedulerType

from megatrain.cli import main
from megatrain.config import SCHEDULES, OptimConfig
from megatrain.optim import lr_at, schedule_arguments
from test_engine_reference import train_and_compare

# the schedules a metric drives (ReduceLROnPlateau, GreedyLR): not a function of the step
METRIC_DRIVEN = {"reduce_lr_on_plateau", "greedy"}

ARGS = {  # each schedule with the arguments that make it differ from its defaults
    "linear": {}, "cosine": {}, "constant": {}, "constant_with_warmup": {},
    "cosine_with_restarts": {"schedule_kwargs": {"num_cycles": 3}},
    "polynomial": {"schedule_kwargs": {"power": 2.0, "lr_end": 1e-4}},
    "inverse_sqrt": {"schedule_kwargs": {"timescale": 3}},
    "cosine_with_min_lr": {"min_lr_ratio": 0.2},
    "cosine_warmup_with_min_lr": {},
    "warmup_stable_decay": {"schedule_kwargs": {"num_decay_steps": 7, "decay_type": "1-sqrt"}},
}


def test_every_schedule_of_transformers_driven_by_the_step_is_offered():
    offered = set(typing.get_args(SCHEDULES))
    assert offered == {s.value for s in SchedulerType} - METRIC_DRIVEN
    assert set(ARGS) == offered


@pytest.mark.parametrize("name", sorted(ARGS))
def test_rates_are_the_library_schedulers_over_adamw(name):
    """Update t's rate is the one torch.optim.AdamW has at its t-th step under get_scheduler's
    scheduler, stepped once after each optimizer step as the HF Trainer steps it: equal to the bit."""
    steps = 23
    cfg = OptimConfig(lr=3e-3, warmup_steps=0 if name == "constant" else 4, schedule=name, **ARGS[name])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = get_scheduler(name, opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=steps,
                          scheduler_specific_kwargs=schedule_arguments(cfg))
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [lr_at(t, cfg, steps) for t in range(steps)] == rates
    assert len(set(rates)) == 1 if name == "constant" else len(set(rates)) > 3, rates  # constant, or it moves


def test_a_schedule_relative_to_lr_follows_it():
    """polynomial decays to an absolute lr_end: its factor depends on lr, and two rates two schedules."""
    a, b = (OptimConfig(lr=lr, schedule="polynomial", schedule_kwargs={"lr_end": 1e-4}) for lr in (1e-3, 2e-3))
    assert lr_at(10, a, 10) == lr_at(10, b, 10) == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize("name", ["cosine_with_restarts", "polynomial", "warmup_stable_decay"])
def test_streamed_training_under_a_schedule_matches_reference(tmp_path, name):
    """Six steps, two of warm-up (the first at rate 0), clipped, two micro-batches: the engine and the
    resident model under the library's scheduler."""
    train_and_compare(tmp_path, "tiny-qwen2", {}, 2, 2, 0.5, True, {},
                      optim={"warmup_steps": 2, "schedule": name, **ARGS[name]}, steps=6)


@pytest.mark.parametrize("settings, message", [
    (["optim.schedule=linear", "optim.min_lr_ratio=0.1"],
     "optim.min_lr_ratio applies to the schedules cosine_with_min_lr and cosine_warmup_with_min_lr, not linear"),
    (["optim.schedule=constant", "optim.warmup_steps=3"],
     "optim.schedule constant takes no warm-up: with optim.warmup_steps, use constant_with_warmup"),
    (["optim.schedule=cosine", "optim.schedule_kwargs={power: 2}"],
     "optim.schedule cosine with optim.schedule_kwargs {'power': 2}: "),
    (["optim.schedule=step"], "optim.schedule must be 'linear' or "),
])
def test_a_schedule_that_cannot_be_built_is_refused_by_name(tmp_path, capsys, settings, message):
    out = tmp_path / "out"
    assert main(["train", "--config", "configs/tiny-cpu.yaml", "engine.device=cpu", f"output_dir={out}",
                 "optim.warmup_steps=0", *settings]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_lr_schedule():
    """transformers' warm-up (update t at t / warmup_steps of lr) and its cosine down to
    min_lr_ratio; tests/engine/test_schedules.py holds every schedule to the library's."""
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert lr_at(4, cfg, 14) == 1.0
    assert math.isclose(lr_at(9, cfg, 14), 0.55)  # halfway down the cosine
    assert math.isclose(lr_at(14, cfg, 14), 0.1)  # past it the library's cosine goes on: no run gets there
    assert lr_at(50, OptimConfig(lr=2.0, schedule="constant"), 10) == 2.0
