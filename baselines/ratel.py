"""Ratel (Liao et al., ICDE 2025), driven through the user's own checkout of its public artifact
(https://github.com/RC4ML/LoHan) and the user's own environment for it. Nothing of Ratel is vendored.

Ratel is a standalone script, not a library. Its `main.py` builds its own GPT-2-style model (fp16,
DeepSpeed's CPU Adam, NVMe offload configured by a `config.json`), runs a number of iterations that
is fixed in the script, and prints for each one

    -----------------------Iter 3-----------------------
    forward time 1.234
    back_and_opt time 5.678

So at the first `step()` this System runs main.py once in a subprocess, parses those lines, and hands
back one iteration per `step()` call: the warm-up steps are Ratel's first iterations. A row's
`step_time_s` is Ratel's own forward + back_and_opt time of that iteration (the harness's wall clock
around `step()` is the whole run on the first call and nothing after). main.py prints no loss (its
loss is an MSE of the last hidden states against a random target), so `loss` is None.

Options:
  checkout           the clone (default: $RATEL_HOME)
  python             Ratel's interpreter (default: the README's conda env `ratel` if found, else this one)
  nvme_path          a directory on the NVMe array; replaces every nvme_path of the checkout's config.json
  args               more main.py flags, e.g. {"swap_ratio": 0.5}; over run.sh's single-GPU settings
  approximate_model  true: run Ratel's GPT model at the spec's shape although the spec's model differs
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from megatrain.metrics import model_flops
from suite.system import System, Unsupported

REPO = "https://github.com/RC4ML/LoHan"
ENTRY = "main.py"
CONFIG = "config.json"  # main.py's --sb_config: offload devices, NVMe paths, aio settings
_OPTIONS = {"checkout", "python", "nvme_path", "args", "approximate_model"}
# run.sh's single-GPU invocation
RUN_SH_FLAGS = {"is_swap_and_recompute": 0, "is_swap_prior": 1, "is_fully_swap": 0, "swap_ratio": 0.3,
                "is_new_param_async": 1, "is_grad_async": 1, "is_mp": 1, "is_nvme": 1, "is_nvme_async": 1,
                "is_nvme_rearrange": 1}
_SPEC_FLAGS = {"hidden_dim", "num_heads", "num_layers", "vocab_size", "max_seq_len", "batch_size", "sb_config",
               "model_size"}
# flash-attn 1.x's FlashAttention, which main.py's model imports (gone in flash-attn 2)
_PROBE = "import flash_attn.flash_attention, torch; print(torch.__version__)"
_NUMBER = r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_ITER = re.compile(r"^-+Iter (\d+)-+$")
_FORWARD = re.compile(rf"^forward time\s+{_NUMBER}$")
_BACKWARD = re.compile(rf"^back_and_opt time\s+{_NUMBER}$")
_DEVICE_OOM = ("CUDA out of memory", "OutOfMemoryError")


def parse_output(text: str) -> list[tuple[int, float, float]]:
    """(iteration, forward seconds, backward + optimizer seconds) of every complete iteration printed."""
    out, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if m := _ITER.match(line):
            current = [int(m.group(1)), None]
        elif current is not None and (m := _FORWARD.match(line)):
            current[1] = float(m.group(1))
        elif current is not None and current[1] is not None and (m := _BACKWARD.match(line)):
            out.append((current[0], current[1], float(m.group(1))))
            current = None
    return out


def _default_python() -> str:
    """The README's `conda create -n ratel` environment when conda is active, else this interpreter."""
    conda = os.environ.get("CONDA_EXE")
    if conda:
        candidate = Path(conda).resolve().parents[1] / "envs" / "ratel" / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    return sys.executable


class Ratel(System):
    own_step_time = True  # main.py's per-iteration times, not the wall clock around step()

    def __init__(self, spec, device):
        # `device` is not used: Ratel's main.py takes the GPU that CUDA_VISIBLE_DEVICES leaves it
        unknown = sorted(set(spec.options) - _OPTIONS)
        if unknown:
            raise ValueError(f"ratel options: unknown {unknown}; known: {sorted(_OPTIONS)}")
        self.spec = spec
        self.checkout = self._checkout(spec.options)
        self.differences, self.shape = self._model(spec)
        flags = {**RUN_SH_FLAGS, **self._extra_args(spec.options.get("args", {}))}
        self.sb_config = self._config(spec.options.get("nvme_path"))
        self.python = self._python(spec.options)
        self.torch_version = self._probe()
        self.workdir = Path(tempfile.mkdtemp(prefix="ratel-"))  # made last: a refusal leaves nothing behind
        config_file = self.workdir / CONFIG
        config_file.write_text(json.dumps(self.sb_config, indent=1))
        argv = {**self.shape, **flags, "sb_config": config_file}
        self.command = [self.python, ENTRY] + [x for k, v in argv.items() for x in (f"--{k}", str(v))]
        h, layers, seq, batch = (self.shape[k] for k in ("hidden_dim", "num_layers", "max_seq_len", "batch_size"))
        # qkv 3h², out h², MLP 8h² per layer; no LM head: the FLOPs of the model Ratel really runs
        self.model_flops_per_step = model_flops(12 * h * h * layers, [(h, None)] * layers, [seq] * batch)
        self.rows: list[dict] | None = None
        self.taken = 0
        self.output_tail = ""

    # ---- validation: every refusal names what to change ----
    @staticmethod
    def _checkout(options) -> Path:
        given = options.get("checkout") or os.environ.get("RATEL_HOME")
        if not given:
            raise Unsupported(f"no Ratel checkout: set RATEL_HOME or options.checkout to a clone of {REPO} "
                              "built per its README (torch 2.0, flash-attn 1.x, NVMe RAID)")
        path = Path(given).expanduser().resolve()
        missing = [name for name in (ENTRY, CONFIG) if not (path / name).is_file()]
        if missing:
            raise Unsupported(f"{path} is not a Ratel checkout: no {' or '.join(missing)} there "
                              f"(expected a clone of {REPO}, whose entry script is {ENTRY})")
        return path

    @staticmethod
    def _model(spec) -> tuple[list[str], dict]:
        """main.py's model flags for the spec, and how Ratel's model differs from the spec's."""
        if spec.model_config().pretrained:
            raise Unsupported("model.pretrained: Ratel's main.py initialises its own model at random; "
                              "it cannot load a checkpoint")
        if spec.grad_accum != 1:
            raise Unsupported(f"grad_accum {spec.grad_accum}: Ratel's main.py has no gradient accumulation; "
                              "use grad_accum 1 and put the sequences in batch_size")
        hf = spec.hf_config()
        hidden, heads = hf.hidden_size, hf.num_attention_heads
        if hidden % heads:
            raise Unsupported(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                              "(main.py asserts it)")
        head_dim = hidden // heads
        if head_dim > 128 or head_dim % 8:
            raise Unsupported(f"head dim {head_dim}: flash-attn 1.x, Ratel's attention, takes multiples "
                              "of 8 up to 128")
        diffs = [f"model_type {hf.model_type} (RMSNorm, gated SiLU MLP, rotary positions); Ratel's model is "
                 "GPT-2-style (LayerNorm, GELU MLP, learned positions)"]
        if hf.intermediate_size != 4 * hidden:
            diffs.append(f"intermediate_size {hf.intermediate_size}; Ratel's is 4 x hidden = {4 * hidden}")
        kv = getattr(hf, "num_key_value_heads", None) or heads
        if kv != heads:
            diffs.append(f"num_key_value_heads {kv}; Ratel's attention has {heads} key/value heads")
        explicit = getattr(hf, "head_dim", None)
        if explicit and explicit != head_dim:
            diffs.append(f"head_dim {explicit}; Ratel's is hidden / heads = {head_dim}")
        diffs.append("an LM head with cross-entropy; Ratel's model has no LM head and its loss is the MSE of "
                     "the last hidden states against a random target")
        if not spec.options.get("approximate_model"):
            raise Unsupported("Ratel's main.py trains only its own GPT-2-style model; this spec's differs: "
                              + "; ".join(diffs) + ". Set options.approximate_model=true to run Ratel's model "
                              "at the spec's hidden_size, num_hidden_layers, num_attention_heads, vocab_size, "
                              "seq_len and batch_size (a different model of about the same size)")
        shape = {"hidden_dim": hidden, "num_heads": heads, "num_layers": hf.num_hidden_layers,
                 "vocab_size": hf.vocab_size, "max_seq_len": spec.seq_len, "batch_size": spec.batch_size}
        return diffs, shape

    @staticmethod
    def _extra_args(args) -> dict:
        if not isinstance(args, dict):
            raise ValueError(f"ratel options.args: a mapping of main.py flags to values, not {args!r}")
        owned = sorted(set(args) & _SPEC_FLAGS)
        if owned:
            raise ValueError(f"ratel options.args: {owned} come from the spec (model, seq_len, batch_size) "
                             "or from options.nvme_path; set them there")
        return dict(args)

    def _config(self, nvme_path) -> dict:
        """The checkout's config.json with options.nvme_path put in; every NVMe path must exist."""
        config = json.loads((self.checkout / CONFIG).read_text())
        paths = []
        for section in ("offload_optimizer", "offload_param", "offload_act"):
            part = config.get("zero_config", {}).get(section) or {}
            if part.get("device") == "nvme":
                if nvme_path:
                    part["nvme_path"] = str(nvme_path)
                paths.append(part.get("nvme_path"))
        missing = sorted({str(p) for p in paths if not p or not Path(p).is_dir()})
        if missing:
            raise Unsupported(f"Ratel offloads to NVMe at {missing} (from {self.checkout / CONFIG}), which is "
                              "not a directory here: set options.nvme_path to a directory on an NVMe array "
                              "(the artifact's make_raid.sh builds a RAID 0 of NVMe drives)")
        return config

    @staticmethod
    def _python(options) -> str:
        python = options.get("python") or _default_python()
        found = shutil.which(python)
        if not found:
            raise Unsupported(f"options.python: no interpreter {python}")
        return found

    def _probe(self) -> str:
        """Refuse up front when Ratel's environment cannot import what its model needs."""
        r = subprocess.run([self.python, "-c", _PROBE], cwd=self.checkout, capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unsupported(f"Ratel's interpreter {self.python} cannot import flash_attn.flash_attention "
                              f"(flash-attn 1.x) and torch: {last}. Build the environment per the artifact's "
                              "README (python 3.10, torch 2.0.0+cu118, flash-attn 1.0.4) and set options.python")
        return r.stdout.strip().splitlines()[-1]

    # ---- running ----
    def _run(self) -> list[dict]:
        log = self.workdir / "ratel.log"
        # no timeout here: the runner kills the worker's whole process tree, Ratel's included
        with open(log, "w") as f:
            code = subprocess.run(self.command, cwd=self.checkout, stdout=f, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
        text = log.read_text(errors="replace")
        self.output_tail = text[-4000:]
        tail = text[-2000:]
        if code:
            if any(s in text for s in _DEVICE_OOM):
                raise torch.cuda.OutOfMemoryError(f"Ratel ran out of device memory; last output:\n{tail}")
            raise RuntimeError(f"Ratel exited with code {code}; last output:\n{tail}")
        iterations = parse_output(text)
        need = self.spec.total_steps
        if not iterations:
            raise RuntimeError("no per-iteration times in Ratel's output (expected main.py's "
                               "'-----Iter N-----', 'forward time S' and 'back_and_opt time S' lines); "
                               f"last output:\n{tail}")
        if len(iterations) < need:
            raise RuntimeError(f"Ratel printed {len(iterations)} complete iterations; the spec needs {need} "
                               f"(warmup {self.spec.warmup} + steps {self.spec.steps}), and main.py fixes its "
                               f"loop count: lower them; last output:\n{tail}")
        return [{"loss": None, "step_time_s": fwd + bwd, "forward_s": fwd, "backward_optimizer_s": bwd,
                 "ratel_iteration": i} for i, fwd, bwd in iterations[:need]]

    def step(self, microbatches) -> dict:
        """Ratel's next iteration; it draws its own random batch, so `microbatches` is not used."""
        if self.rows is None:
            self.rows = self._run()
        if self.taken >= len(self.rows):
            raise RuntimeError(f"ratel: asked for step {self.taken + 1}, the spec has {len(self.rows)}")
        self.taken += 1
        return self.rows[self.taken - 1]

    def info(self) -> dict:
        h, layers, vocab, seq = (self.shape[k] for k in ("hidden_dim", "num_layers", "vocab_size", "max_seq_len"))
        commit = None
        if (self.checkout / ".git").exists():
            try:
                commit = subprocess.run(["git", "-C", str(self.checkout), "rev-parse", "HEAD"],
                                        capture_output=True, text=True).stdout.strip() or None
            except OSError:  # no git here
                pass
        return {
            "artifact": f"Ratel, {REPO}", "checkout": str(self.checkout),
            "checkout_commit": commit, "python": self.python,
            "torch": self.torch_version, "command": self.command, "sb_config": self.sb_config,
            "model": "Ratel's GPT-2-style model at the spec's shape (options.approximate_model)",
            "differences_from_spec": self.differences,
            "ratel_params": layers * (12 * h * h + 13 * h) + (vocab + seq) * h + 2 * h,
            "precision": "fp16 weights and compute; fp32 master and Adam state in DeepSpeedCPUAdam "
                         "(adamw_mode=False, its default lr): main.py takes no optimizer settings "
                         "(the spec's lr, betas, eps and weight_decay are not used)",
            "data": "one random batch for every iteration; main.py takes no seed",
            "loss": "not printed by main.py (MSE of the last hidden states against a random target)",
            "step_time_s": "main.py's 'forward time' + 'back_and_opt time' of the iteration",
            "iterations_used": len(self.rows or []), "output_tail": self.output_tail,
        }

    def save(self, path: str) -> None:
        raise Unsupported("Ratel's main.py keeps its trained weights to itself: it writes no checkpoint")

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
