"""Golden per-step losses of a seeded tiny CPU run (configs/tiny-cpu.yaml), compared exactly: a
change of the engine's numerics is seen, not guessed. The run takes a process of its own with the
maths libraries pinned (pinned_numerics.py). After a change that is meant to move them, regenerate
the file and say why in the commit:

    python tests/engine/test_golden_losses.py --write
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import pinned_numerics

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "tiny_cpu_losses.json"
THREADS = 2  # float reductions depend on the thread count: pinned so every machine sums alike


def losses() -> list[float]:
    from megatrain.config import load_config
    from megatrain.trainer import Trainer
    pinned_numerics.check()
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
    pinned_numerics.skip_unless_recorded_torch(golden)
    got = pinned_numerics.run(Path(__file__))
    assert got == golden["losses"], "\n".join(f"step {i + 1}: {g!r} != golden {w!r}"
                                               for i, (g, w) in enumerate(zip(got, golden["losses"])) if g != w)


if __name__ == "__main__":  # the pinned child prints the losses; --write: run one and record them
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:] == ["--write"]:
        GOLDEN.write_text(json.dumps({"config": "configs/tiny-cpu.yaml", "threads": THREADS, "torch": torch.__version__,
                                      "pins": pinned_numerics.PINS, "losses": pinned_numerics.run(Path(__file__))},
                                     indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(losses()))
