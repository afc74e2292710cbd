"""What a run tells its user: output_dir/metrics.jsonl (a JSON line per step and per evaluation),
optional TensorBoard events (output_dir/tensorboard), and the console: a progress bar with ETA and
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
from megatrain.units import GiB


class RunLog:
    def __init__(self, output_dir: str | None, total_steps: int, start_step: int, log_every: int,
                 progress: bool = True, tensorboard: bool = False, json_lines: TextIO | None = None,
                 quiet: bool = False):
        """`quiet`: nothing on the console (the data-parallel ranks but the first)."""
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
        self.tb = None
        if tensorboard:  # the package is there: the run's settings checked it (config.py)
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tensorboard"))
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
        if self.tb:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "model_tflops"):
                if m.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", m[key], m["step"])
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
        if self.tb:
            self.tb.add_scalar("eval/loss", m["eval_loss"], m["step"])
            self.tb.add_scalar("eval/perplexity", m["eval_perplexity"], m["step"])
        self.say(f"step {m['step']}: eval loss {m['eval_loss']:.4f}, perplexity {m['eval_perplexity']:.2f} "
                 f"({m['eval_target_tokens']} tokens)")

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def perplexity(loss: float) -> float | None:
    return math.exp(loss) if loss < 700 else None  # null rather than Infinity in the JSON


def _step(line: str) -> int | None:
    """A record's step; None for a blank line or one a kill cut short (each record is one write)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None

