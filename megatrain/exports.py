"""What a run keeps of its model besides output_dir/model: a `checkpoint-N` per save (save_every),
at most save_total_limit of them, the best model by an evaluation metric (output_dir/best), and
the early stop that metric decides (the HF Trainer's save_total_limit, metric_for_best_model and
EarlyStoppingCallback).

Each folder is a `transformers` checkpoint written atomically (checkpoint.save_pretrained) with
`megatrain.json` beside the weights: the step whose weights they are and, where the run evaluated
at that step, the evaluation's metrics."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from megatrain.io import remove_dir

META = "megatrain.json"  # in every exported folder: {"step": N, "eval": {...} or null}
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / f"checkpoint-{step}"


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The checkpoint-N folders in `out`, oldest first."""
    found = [(int(m[1]), p) for p in out.iterdir() if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()] \
        if out.is_dir() else []
    return sorted(found)


def rotate(out: Path, limit: int | None, keep: int | None) -> list[Path]:
    """Remove the oldest checkpoint-N folders until `limit` are left (None: no limit), never the
    newest nor the one of step `keep` (the best model's): with the best among them, one more
    stays, as in the HF Trainer. Returns what was removed."""
    if limit is None:
        return []
    found = checkpoints(out)
    doomed = [p for step, p in found[:-1] if step != keep][:max(0, len(found) - limit)]
    for path in doomed:
        remove_dir(path)
    return doomed


# whether a greater value is better, for each metric the evaluation gives (trainer.evaluate)
GREATER_IS_BETTER = {"loss": False, "perplexity": False, "accuracy": True}


@dataclass
class Best:
    """The best evaluation so far by `metric` (metric_for_best_model) and the evaluations since it
    that did not improve it by more than `threshold` (early stopping's count)."""
    metric: str
    patience: int | None = None
    threshold: float = 0.0
    step: int | None = None
    value: float | None = None
    stale: int = 0  # evaluations in a row without an improvement

    def judge(self, evaluation: dict) -> bool:
        """Count an evaluation in; True where it is the best so far (the best model to keep)."""
        value = evaluation[f"eval_{self.metric}"]
        if value is None:  # perplexity overflows to null: no better than any
            value = math.inf
        sign = 1 if GREATER_IS_BETTER[self.metric] else -1
        better = self.value is None or sign * (value - self.value) > 0
        if self.value is None or sign * (value - self.value) > self.threshold:
            self.stale = 0
        else:
            self.stale += 1
        if better:
            self.step, self.value = evaluation["step"], value
        return better

    @property
    def stop(self) -> bool:
        """The patience is spent: early stopping ends the run."""
        return self.patience is not None and self.stale >= self.patience

    def state(self) -> dict:
        return {"step": self.step, "value": self.value, "stale": self.stale}

    def restore(self, saved: dict | None) -> None:
        if saved:
            self.step, self.value, self.stale = saved["step"], saved["value"], saved["stale"]
