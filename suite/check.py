"""Does each system train? Its loss over a few steps on one fixed batch, from the same initial
weights, must track PyTorch native's within a tolerance (bf16 compute on a GPU: a few percent).

A system that diverges is broken, not slow: a DeepSpeed build that skipped weight init once gave
loss 1314 where native gave 9.35. Systems that cannot run here are listed with their status.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from megatrain.io import write_json
from suite.spec import RunSpec
from suite.system import SYSTEMS


def refuse(systems: list[str], steps: int, tolerance: float) -> None:
    """A check that cannot mean anything is refused before any system runs."""
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise ValueError(f"--systems: unknown {unknown}; known: {list(SYSTEMS)}")
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, not {steps}")
    if not tolerance > 0:
        raise ValueError(f"--tolerance must be above 0, not {tolerance}")


def initial_weights(directory: Path, preset: str, seed: int) -> Path:
    """One seeded random init saved as a `transformers` checkpoint that every system loads."""
    import torch
    from transformers import AutoModelForCausalLM
    from megatrain.shapes import load_hf_config
    from megatrain.config import ModelConfig
    torch.manual_seed(seed)
    hf = load_hf_config(ModelConfig(preset=preset))
    AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(directory)
    return directory


def check(systems: list[str], out_dir: str | Path, preset: str = "tiny-llama", steps: int = 10,
          tolerance: float = 0.03, timeout_s: float = 900.0) -> dict:
    """Run every system on the same batch and weights; compare each step's loss with native's."""
    from suite.runner import run_point  # the harness and torch: not for `python -m suite`'s other commands
    refuse(systems, steps, tolerance)
    out_dir = Path(out_dir)
    systems = ["native", *[s for s in systems if s != "native"]]
    results = {}
    with tempfile.TemporaryDirectory(prefix="suite-init-") as tmp:
        init = initial_weights(Path(tmp), preset, seed=0)
        for system in systems:
            spec = RunSpec(system=system, model={"pretrained": str(init)}, seq_len=64, batch_size=2,
                           grad_accum=2, steps=steps, warmup=0, lr=1e-3, repeat_batch=True, timeout_s=timeout_s)
            results[system] = run_point(spec, out_dir / f"{system}.json")
    reference = [r["loss"] for r in results["native"]["steps"]]
    rows = []
    for system, r in results.items():
        losses = [s["loss"] for s in r["steps"]]
        row = {"system": system, "status": r["status"], "reason": r.get("reason"), "losses": losses}
        if r["status"] == "ok" and len(losses) == len(reference) == steps:
            gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            row.update(max_relative_gap=gap, tracks_native=gap <= tolerance)
        rows.append(row)
    summary = {"preset": preset, "steps": steps, "tolerance": tolerance,
               "device": results["native"].get("env", {}).get("gpu", "cpu"), "systems": rows}
    write_json(out_dir / "check.json", summary)
    return summary


def passed(summary: dict) -> bool:
    """Native ran, and every system that ran tracks it."""
    rows = {r["system"]: r for r in summary["systems"]}
    return rows["native"]["status"] == "ok" and all(r.get("tracks_native", True) for r in rows.values()
                                                    if r["status"] == "ok")
