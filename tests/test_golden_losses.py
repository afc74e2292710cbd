"""Golden per-step losses of a seeded tiny CPU run (configs/tiny-cpu.yaml), compared exactly: a
change of the engine's numerics is seen, not guessed. After a change that is meant to move them,
regenerate the file and say why in the commit:

    python tests/test_golden_losses.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "tiny_cpu_losses.json"
THREADS = 2  # float reductions depend on the thread count: pinned so every machine sums alike


def losses() -> list[float]:
    from megatrain.config import load_config
    from megatrain.trainer import Trainer
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    trainer = Trainer(load_config(ROOT / "configs" / "tiny-cpu.yaml", ["engine.device=cpu"]))
    try:
        return [trainer.train_step(trainer.next_microbatches())["loss"] for _ in range(trainer.total_steps)]
    finally:
        trainer.close()
        torch.set_num_threads(threads)


def test_losses_are_the_golden_ones():
    golden = json.loads(GOLDEN.read_text())
    got = losses()
    assert got == golden["losses"], "\n".join(f"step {i + 1}: {g!r} != golden {w!r}"
                                               for i, (g, w) in enumerate(zip(got, golden["losses"])) if g != w)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    GOLDEN.write_text(json.dumps({"config": "configs/tiny-cpu.yaml", "threads": THREADS, "torch": torch.__version__,
                                  "losses": losses()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
