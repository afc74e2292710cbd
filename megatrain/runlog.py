"""What a run tells its user: output_dir/metrics.jsonl (a JSON line per step and per evaluation),
the trackers of report_to (trackers.py), and the console: a progress bar with ETA and
a short summary line every `log_every` steps on stderr; raw JSON lines only on request.

A step's gradient norm is known only once its optimizer has run, after the next step began
(engine.StepResult.prev_grad_norm), so the trainer hands each step's record over one step late, or
after waiting for the optimizer at a save, an evaluation or the end: every line holds its own
step's norm and no step waits for its optimizer to log.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TextIO

from megatrain.io import write_text
from megatrain.trackers import TRACKERS
from megatrain.units import GiB


class RunLog:
    def __init__(self, output_dir: str | None, total_steps: int, start_step: int, log_every: int,
                 progress: bool = True, report_to: list[str] = (), json_lines: TextIO | None = None,
                 quiet: bool = False, config: dict | None = None):
        """`quiet`: nothing on the console (the data-parallel ranks but the first); `config`: the
        run's settings, for the trackers that record them."""
        from tqdm import tqdm
        out = Path(output_dir) if output_dir else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
        if out and (out / "metrics.jsonl").is_file():
            # a resumed run: keep the records up to its state's step, drop those of steps it redoes
            lines = (out / "metrics.jsonl").read_text().splitlines()
            kept = [line for line in lines if _step(line) is not None and _step(line) <= start_step]
            write_text(out / "metrics.jsonl", "".join(line + "\n" for line in kept))
        self.file = open(out / "metrics.jsonl", "a") if out else None
        self.json_lines, self.log_every = json_lines, log_every
        # their packages are there: the run's settings checked them (config.py)
        self.trackers = [TRACKERS[name](out, config or {}) for name in report_to]
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not progress, unit="step", file=sys.stderr,
                        dynamic_ncols=True)
        self.progress, self.quiet = progress, quiet

    def say(self, text: str) -> None:
        """A line for the console, above the progress bar."""
        if self.quiet:
            return
        if self.progress:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def _write(self, record: dict) -> None:
        line = json.dumps(record)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()
        if self.json_lines:
            print(line, file=self.json_lines, flush=True)

    def step(self, m: dict) -> None:
        """A training step's record, its own gradient norm included."""
        self._write({"kind": "train", **m})
        self._track({f"train/{key}": m.get(key) for key in ("loss", "lr", "grad_norm", "tokens_per_s", "model_tflops")},
                    m["step"])
        if m["step"] % self.log_every == 0:
            norm = "-" if m.get("grad_norm") is None else f"{m['grad_norm']:.3f}"
            self.say(f"step {m['step']}: loss {m['loss']:.4f}, lr {m['lr']:.3g}, grad norm {norm}, "
                     f"{m['tokens_per_s']:.0f} tokens/s, {m['model_tflops']:.1f} TFLOP/s, "
                     f"host {m['peak_host_bytes'] / GiB:.1f} GiB")

    def advance(self, m: dict) -> None:
        """The progress bar, as soon as a step ends."""
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", refresh=False)
        self.bar.update(1)

    def evaluation(self, m: dict) -> None:
        self._write({"kind": "eval", **m})
        self._track({f"eval/{key}": m[f"eval_{key}"] for key in ("loss", "perplexity", "accuracy")}, m["step"])
        self.say(f"step {m['step']}: eval loss {m['eval_loss']:.4f}, perplexity {m['eval_perplexity']:.2f}, "
                 f"token accuracy {m['eval_accuracy']:.4f} ({m['eval_target_tokens']} tokens)")

    def _track(self, scalars: dict[str, float | None], step: int) -> None:
        scalars = {k: v for k, v in scalars.items() if v is not None}  # a norm not known, a perplexity overflowed
        for tracker in self.trackers:
            tracker.log(scalars, step)

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
        for tracker in self.trackers:
            tracker.close()


def perplexity(loss: float) -> float | None:
    return math.exp(loss) if loss < 700 else None  # null rather than Infinity in the JSON


def _step(line: str) -> int | None:
    """A record's step; None for a blank line or one a kill cut short (each record is one write)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None

