"""Ratel (Liao et al., ICDE 2025), driven through the user's own checkout of its public artifact
(https://github.com/RC4ML/LoHan). Nothing of Ratel is vendored: the user supplies the checkout.

Ratel is a standalone script, not a library. Its `main.py` builds its own GPT-2-style model (fp16,
DeepSpeed's CPU Adam, parameters and optimizer state offloaded as a `config.json` says), runs a number
of iterations that is fixed in the script (4 upstream), and prints for each one

    -----------------------Iter 3-----------------------
    forward time 1.234
    back_and_opt time 5.678

So at the first `step()` this System runs main.py once in a subprocess, parses those lines, and hands
back one iteration per `step()` call: the warm-up steps are Ratel's first iterations. Once main.py has
printed the spec's iterations, it is stopped with the processes it started. A row's
`step_time_s` is Ratel's own forward + back_and_opt time of that iteration (the harness's wall clock
around `step()` is the whole run on the first call and nothing after). main.py prints no loss (its
loss is an MSE of the last hidden states against a random target), so `loss` is None.

The artifact wants torch 2.0, flash-attn 1.0.4 and Python 3.10. Its processes run with
`baselines/ratel_compat/` first on their PYTHONPATH: a flash-attn 1.x `FlashAttention` on torch's SDPA,
and import hooks for what newer torch and Python break (ratel_compat/ratel_patches.py says what). The
checkout is never written: main.py runs in a temporary directory, without bytecode files.

Options:
  checkout           the clone (default: $RATEL_HOME)
  python             the interpreter (default: the README's conda env `ratel` if found, else this one)
  offload            disk (default): parameters and optimizer state on a disk through libaio, run.sh's
                     single-GPU flags; cpu: both in host memory (--is_nvme 0, synchronous CPU Adam)
  nvme_path          (disk) the swap directory; default one in the run's directory under the temp dir,
                     removed at close
  args               more main.py flags, e.g. {"swap_ratio": 0.5}; over the offload's flags
  approximate_model  true: run Ratel's GPT model at the spec's shape although the spec's model differs
  admission          false: run even where the host or the disk seems too small (baselines/ratel_memory.py)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from baselines import hf, ratel_memory
from baselines.ratel_compat import PATH as COMPAT
from megatrain.memory import DoesNotFit, Shortage
from megatrain.metrics import model_flops
from megatrain.resolve import host_available_bytes
from suite.system import System, Unsupported, check_options

REPO = "https://github.com/RC4ML/LoHan"
ENTRY = "main.py"
CONFIG = "config.json"  # main.py's --sb_config: offload sections, NVMe paths, aio settings
_SECTIONS = ("offload_optimizer", "offload_param", "offload_act")
# run.sh's single-GPU invocation: the disk offload
RUN_SH_FLAGS = {"is_swap_and_recompute": 0, "is_swap_prior": 1, "is_fully_swap": 0, "swap_ratio": 0.3,
                "is_new_param_async": 1, "is_grad_async": 1, "is_mp": 1, "is_nvme": 1, "is_nvme_async": 1,
                "is_nvme_rearrange": 1}
# host memory: no swappers (--is_nvme 0). The asynchronous optimizer paths (is_nvme_async, is_nvme_rearrange)
# assert a swappable optimizer, and the optimizer process (is_mp) is fed only by them, so all are off and
# main.py steps DeepSpeed's CPU Adam itself after each backward.
HOST_FLAGS = {**RUN_SH_FLAGS, "is_mp": 0, "is_nvme": 0, "is_nvme_async": 0, "is_nvme_rearrange": 0}
OFFLOADS = {"disk": RUN_SH_FLAGS, "cpu": HOST_FLAGS}
SWAP_BYTES_PER_PARAM = 18  # fp16 parameters + fp32 master, Adam moments and gradients: an upper bound
_SPEC_FLAGS = {"hidden_dim", "num_heads", "num_layers", "vocab_size", "max_seq_len", "batch_size", "sb_config",
               "model_size"}
_NUMBER = r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_ITER = re.compile(r"^-+Iter (\d+)-+$")
_FORWARD = re.compile(rf"^forward time\s+{_NUMBER}$")
_BACKWARD = re.compile(rf"^back_and_opt time\s+{_NUMBER}$")
_LOOP = re.compile(r"for \w+ in range\((\d+)\):\s*\n(?:.*\n){0,3}?.*Iter")  # main.py's fixed iteration count
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


def _stop(proc: subprocess.Popen) -> bool:
    """Kill main.py and the processes it started (its optimizer's, with is_mp), which share the worker's
    session, and wait for it. False where it had ended by itself."""
    try:
        tree = psutil.Process(proc.pid)
        tree = [tree, *tree.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()  # main.py by Popen (psutil would reap it first, and Popen would then see exit code 0)
    psutil.wait_procs(tree[1:])
    return proc.returncode == -signal.SIGKILL


def flags_for(offload: str, args: dict) -> dict:
    """main.py's system flags: the offload's, then options.args; combinations main.py mishandles refused."""
    flags = {**OFFLOADS[offload], **args}
    on = {k for k in ("is_mp", "is_nvme", "is_nvme_async", "is_nvme_rearrange") if int(flags[k])}
    if "is_mp" in on and "is_nvme_async" not in on:
        raise ValueError("ratel options.args: is_mp 1 with is_nvme_async 0 never steps the optimizer (its "
                         "process is fed by the asynchronous path only, and main.py steps only when is_mp is 0)")
    if "is_nvme" not in on and on & {"is_nvme_async", "is_nvme_rearrange"}:
        raise ValueError("ratel options.args: is_nvme_async and is_nvme_rearrange need is_nvme 1 (their "
                         "optimizer step asserts a swappable optimizer); for host memory use offload=cpu")
    return flags


def compat_env(checkout: Path, base: dict | None = None) -> dict:
    """The environment of Ratel's processes: the compatibility layer first on the path, the checkout next,
    no bytecode written into the checkout, its ops built apart from DeepSpeed's same-named ones."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT), str(checkout)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    extensions = env.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(extensions, "ratel")
    return env


def _default_python() -> str:
    """The README's `conda create -n ratel` environment when conda is active, else this interpreter."""
    conda = os.environ.get("CONDA_EXE")
    if conda:
        for name in ("ratel", "lohan"):  # the README's env is `lohan` upstream, `ratel` in the fork
            candidate = Path(conda).resolve().parents[1] / "envs" / name / "bin" / "python"
            if candidate.is_file():
                return str(candidate)
    return sys.executable


def _exit(code: int) -> str:
    """How a process ended, for a message: a negative code is the signal that killed it."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _without_info(text: str) -> str:
    """The output without the artifact's `[INFO]` logging (its memory reports), which would fill a tail."""
    return "\n".join(line for line in text.splitlines() if "] [INFO] [" not in line)


class Ratel(System):
    OPTIONS = frozenset({"checkout", "python", "offload", "nvme_path", "args", "approximate_model", "admission"})
    own_step_time = True  # main.py's per-iteration times, not the wall clock around step()

    def __init__(self, spec, device):
        # `device` is not used: Ratel's main.py takes the GPU that CUDA_VISIBLE_DEVICES leaves it
        check_options("ratel", spec.options, self.OPTIONS)
        self.spec = spec
        self.offload = spec.options.get("offload", "disk")
        if self.offload not in OFFLOADS:
            raise ValueError(f"ratel options.offload: {self.offload!r}; one of {sorted(OFFLOADS)} "
                             "(disk: a swap directory through libaio; cpu: host memory)")
        if self.offload == "cpu" and spec.options.get("nvme_path"):
            raise ValueError("ratel options.nvme_path: only with offload=disk")
        self.checkout = self._checkout(spec.options)
        self.differences, self.shape = self._model(spec)
        self.iterations = self._loop_count(spec)
        self.flags = flags_for(self.offload, self._extra_args(spec.options.get("args", {})))
        self.python = self._python(spec.options)
        self.env = compat_env(self.checkout)
        self.swap, self.owns_swap = self._swap(spec.options.get("nvme_path"))
        self._fits_in_host()
        self.probe = self._probe()
        self.workdir = Path(tempfile.mkdtemp(prefix="ratel-"))  # made last: a refusal leaves nothing behind
        if self.owns_swap:  # on the temp dir's disk, removed with the run's directory
            self.swap = str(self.workdir / "swap")
            os.makedirs(self.swap)
        self.sb_config = self._config()
        config_file = self.workdir / CONFIG
        config_file.write_text(json.dumps(self.sb_config, indent=1))
        argv = {**self.shape, **self.flags, "sb_config": config_file}
        self.command = [self.python, str(self.checkout / ENTRY)] + [x for k, v in argv.items() for x in (f"--{k}", str(v))]
        h, layers, seq, batch = (self.shape[k] for k in ("hidden_dim", "num_layers", "max_seq_len", "batch_size"))
        # qkv 3h², out h², MLP 8h² per layer, no LM head: the FLOPs of the model Ratel really runs. main.py lays
        # its input out [max_seq_len, batch_size] and the model reads [batch, seq], so attention spans
        # batch_size positions in each of max_seq_len rows (ratel.md, "Sequence layout")
        self.model_flops_per_step = model_flops(12 * h * h * layers, [(h, None)] * layers, [batch] * seq)
        self.rows: list[dict] | None = None
        self.taken = 0
        self.output_tail = ""
        self.compat_lines: list[str] = []
        self.stopped = False  # main.py killed once it had printed the spec's iterations

    # ---- validation: every refusal names what to change ----
    @staticmethod
    def _checkout(options) -> Path:
        given = options.get("checkout") or os.environ.get("RATEL_HOME")
        if not given:
            raise Unsupported(f"no Ratel checkout: set RATEL_HOME or options.checkout to a clone of {REPO} "
                              "(git clone it; the suite's compatibility layer adapts it to this torch at run time)")
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
        if spec.batch_size > spec.seq_len:
            raise Unsupported(f"batch_size {spec.batch_size} > seq_len {spec.seq_len}: Ratel's model reads "
                              "main.py's [max_seq_len, batch_size] input as [batch, seq] and embeds positions "
                              "0..batch_size-1 from a table of max_seq_len rows")
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
        diffs.append("causal attention over seq_len tokens; Ratel's attention is not causal (FlashAttention's "
                     f"default) and spans batch_size = {spec.batch_size} positions in each of seq_len = "
                     f"{spec.seq_len} rows (main.py's sequence layout)")
        if not spec.options.get("approximate_model"):
            raise Unsupported("Ratel's main.py trains only its own GPT-2-style model; this spec's differs: "
                              + "; ".join(diffs) + ". Set options.approximate_model=true to run Ratel's model "
                              "at the spec's hidden_size, num_hidden_layers, num_attention_heads, vocab_size, "
                              "seq_len and batch_size (a different model of about the same size)")
        shape = {"hidden_dim": hidden, "num_heads": heads, "num_layers": hf.num_hidden_layers,
                 "vocab_size": hf.vocab_size, "max_seq_len": spec.seq_len, "batch_size": spec.batch_size}
        return diffs, shape

    def _loop_count(self, spec) -> int | None:
        m = _LOOP.search((self.checkout / ENTRY).read_text(errors="replace"))
        count = int(m.group(1)) if m else None
        if count is not None and spec.total_steps > count:
            raise Unsupported(f"warmup {spec.warmup} + steps {spec.steps} = {spec.total_steps}: {self.checkout / ENTRY} "
                              f"runs {count} iterations (fixed in the script); lower warmup and steps")
        return count

    @staticmethod
    def _extra_args(args) -> dict:
        if not isinstance(args, dict):
            raise ValueError(f"ratel options.args: a mapping of main.py flags to values, not {args!r}")
        owned = sorted(set(args) & _SPEC_FLAGS)
        if owned:
            raise ValueError(f"ratel options.args: {owned} come from the spec (model, seq_len, batch_size) "
                             "or from options.offload and nvme_path; set them there")
        unknown = sorted(set(args) - set(RUN_SH_FLAGS))
        if unknown:
            raise ValueError(f"ratel options.args: unknown main.py flags {unknown}; known: {sorted(RUN_SH_FLAGS)}")
        return dict(args)

    def _swap(self, nvme_path) -> tuple[str | None, bool]:
        """The swap directory: options.nvme_path (which must exist), or one made under the temp dir."""
        if nvme_path is None:
            if self.offload == "disk":
                self._fits_on_disk(tempfile.gettempdir())
            return None, True
        if not Path(nvme_path).is_dir():
            raise Unsupported(f"options.nvme_path {nvme_path} is not a directory: Ratel offloads to NVMe there "
                              "(the artifact's make_raid.sh builds a RAID 0 of NVMe drives); leave it out to use "
                              "a directory under the temp dir")
        self._fits_on_disk(nvme_path)
        return str(nvme_path), False

    def _fits_in_host(self) -> None:
        """Refuse before anything runs where the host cannot hold the run, by the reading of Ratel's
        code in ratel_memory (its buffers at this shape and the checkout's config.json)."""
        if not self.spec.options.get("admission", True):
            return
        config = self.checkout / CONFIG
        try:
            need, how = ratel_memory.host_bytes(self.shape, json.loads(config.read_text()), self.offload)
        except (ValueError, KeyError, TypeError) as e:
            raise Unsupported(f"{config} is not the artifact's config.json ({type(e).__name__}: {e}); "
                              f"its zero_config sets the offload buffers (see {REPO})") from None
        have = host_available_bytes()  # as stated (MEGATRAIN_HOST_MEMORY_GB) where the OS under-reports
        if need > have:
            raise DoesNotFit("ratel", [Shortage("host", need, have, how)])

    def _fits_on_disk(self, path) -> None:
        if not self.spec.options.get("admission", True):
            return
        h, layers, vocab, seq = (self.shape[k] for k in ("hidden_dim", "num_layers", "vocab_size", "max_seq_len"))
        hf.require_disk("ratel", self.ratel_params(h, layers, vocab, seq), SWAP_BYTES_PER_PARAM, path)

    @staticmethod
    def ratel_params(h: int, layers: int, vocab: int, seq: int) -> int:
        return layers * (12 * h * h + 13 * h) + (vocab + seq) * h + 2 * h

    def _config(self) -> dict:
        """The checkout's config.json with this run's swap directory in every section; offload=cpu marks
        them `cpu`. Ratel's swappers read nvme_path only: the activation swapper is built (and makes its
        folder) in every mode, so even host memory needs the directory, where nothing is written."""
        config = json.loads((self.checkout / CONFIG).read_text())
        zero = config.setdefault("zero_config", {})
        for section in _SECTIONS:
            part = zero.setdefault(section, {})
            part["nvme_path"] = self.swap
            if self.offload == "cpu":
                part["device"] = "cpu"
        return config

    @staticmethod
    def _python(options) -> str:
        python = options.get("python") or _default_python()
        found = shutil.which(python)
        if not found:
            raise Unsupported(f"options.python: no interpreter {python}")
        return found

    def _probe(self) -> dict:
        """Refuse up front when Ratel's environment lacks what main.py needs (ratel_compat/ratel_probe.py)."""
        r = subprocess.run([self.python, str(COMPAT / "ratel_probe.py")], cwd=tempfile.gettempdir(),
                           env=self.env, capture_output=True, text=True)
        lines = r.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unsupported(f"Ratel's interpreter {self.python} could not run the environment probe: {last}")
        if report["missing"]:
            raise Unsupported(f"Ratel's environment ({self.python}, torch {report['torch']}) lacks: "
                              + "; ".join(report["missing"]))
        return report

    # ---- running ----
    def _run(self) -> list[dict]:
        # no timeout here: the runner kills the worker's whole process tree, Ratel's included. The working
        # directory is the run's own: SB_Init writes model_info.txt into it. Each line of Ratel's output
        # also goes to this worker's stderr, the point's log, so that a run the runner kills (its
        # timeout) still shows how far Ratel got in the result's log tail
        # main.py is stopped once it has printed the iterations the spec takes: its loop count is fixed,
        # and the disk route has been seen to hang in a later iteration's backward (baselines/ratel.md)
        lines, need, done = [], self.spec.total_steps, 0
        with subprocess.Popen(self.command, cwd=self.workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=self.env, text=True, errors="replace") as proc:
            for line in proc.stdout:
                lines.append(line)
                sys.stderr.write(f"ratel| {line}")
                done += bool(_BACKWARD.match(line.strip()))
                if done == need:
                    self.stopped = _stop(proc)
                    break
        code = 0 if self.stopped else proc.returncode
        text = "".join(lines)
        self.compat_lines = [line.strip() for line in text.splitlines() if line.startswith("[ratel_compat]")]
        self.output_tail = text[-4000:]
        tail = _without_info(text)[-2000:]
        if code:
            if any(s in text for s in _DEVICE_OOM):
                raise torch.cuda.OutOfMemoryError(f"Ratel ran out of device memory; last output:\n{tail}")
            raise RuntimeError(f"Ratel {_exit(code)}; last output:\n{tail}")
        iterations = parse_output(text)
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
            "torch": self.probe["torch"], "torch_cuda": self.probe["cuda"], "command": self.command,
            "offload": self.offload, "swap_dir": self.swap, "sb_config": self.sb_config,
            "main_py_iterations": self.iterations,
            "main_py_stopped": "after the spec's iterations" if self.stopped else None,
            "compat": {"path": str(COMPAT), "applied": self.compat_lines,
                       "attention": "flash_attn.flash_attention.FlashAttention from the suite's shim: torch "
                                    "scaled_dot_product_attention, not flash-attn 1.x's kernel",
                       "torch_extensions_dir": self.env["TORCH_EXTENSIONS_DIR"]},
            "model": "Ratel's GPT-2-style model at the spec's shape (options.approximate_model)",
            "differences_from_spec": self.differences,
            "ratel_params": self.ratel_params(h, layers, vocab, seq),
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
        shutil.rmtree(self.workdir, ignore_errors=True)  # the swap too, unless options.nvme_path named it
