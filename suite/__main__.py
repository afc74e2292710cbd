"""Command line of the harness: `python -m suite run | check | table | compare | accuracy | project`."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import signal
import sys
from pathlib import Path

from megatrain.cli import parse_with_settings
from megatrain.config import parse_overrides, set_dotted
from megatrain.io import check_writable, write_json
from megatrain.units import GiB
from suite.accuracy.experiment import Settings
from suite.check import check
from suite.compare import DEFAULT_METRICS, METRICS
from suite.spec import RunSpec
from suite.system import SYSTEMS, check_spec_options


def _default(owner, name: str):
    """The default of a dataclass field or a function's parameter: the command line shows it and
    never writes it a second time."""
    if dataclasses.is_dataclass(owner):
        f = {f.name: f for f in dataclasses.fields(owner)}[name]
        return f.default_factory() if f.default is dataclasses.MISSING else f.default
    return inspect.signature(owner).parameters[name].default


def _options(items: list[str]) -> dict:
    tree: dict = {}
    for dotted, value in parse_overrides(items):
        set_dotted(tree, dotted, value)
    return tree


def _run(args) -> int:
    from suite.runner import die_with_parent, run_point
    if args.workflow_job:
        die_with_parent(signal.SIGTERM)  # unwinds as an interruption: the worker goes, the point is recorded
    # the spec's checks count the GPUs with NVML, not CUDA: the worker is forked from this process,
    # which must not have touched CUDA (suite.launch)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    model = {"preset": args.preset} if args.preset else {"config": args.config}
    try:
        overrides = dict(parse_overrides(args.override))
        if args.layers is not None:
            if args.layers < 1:
                raise ValueError(f"--layers must be at least 1 (decoder layers), not {args.layers}")
            overrides["num_hidden_layers"] = args.layers
        if overrides:
            model["overrides"] = overrides
        spec = RunSpec(system=args.system, model=model, seq_len=args.seq, batch_size=args.batch,
                       grad_accum=args.accum, steps=args.steps, warmup=args.warmup, seed=args.seed,
                       lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=args.weight_decay,
                       timeout_s=args.timeout, options=_options(args.option), gpus=args.gpus,
                       max_steps=args.max_steps, steady_spread=args.steady_spread, smoke=args.smoke)
        check_spec_options(spec.system, spec.options)
        check_writable(Path(args.out).parent, "--out")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.same_as:
        return _same_as(spec, Path(args.same_as), Path(args.out))
    log = Path(args.out).with_suffix(".log")
    if _writes_to(log):
        print(f"error: the worker's log is written to {log}, and so is this command's output: the two would "
              f"overwrite each other's bytes; send the command's output elsewhere", file=sys.stderr)
        return 2
    r = run_point(spec, args.out, python=args.python or sys.executable, fork=True)
    med = r.get("median", {})
    print(f"{args.out}: {r['status']} {med.get('model_tflops') or 0:.1f} TFLOP/s "
          f"host {r['peak']['host_rss_bytes'] / GiB:.1f} GiB {r.get('reason') or ''}", file=sys.stderr)
    return 0 if r["status"] == "ok" or args.workflow_job else 1


def _same_as(spec: RunSpec, source: Path, out: Path) -> int:
    """`spec` measured once already, as the point whose result is `source` (a grid's `same_as`):
    that result written as this point's, with this point's spec and the source named."""
    try:
        result = json.loads(source.read_text())
        other = RunSpec.from_dict(RunSpec.stored(result["spec"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --same-as {source}: not a point's result ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if not spec.runs_as(other):
        print(f"error: --same-as {source}: that point runs something else ({other.to_dict()}), not this one "
              f"({spec.to_dict()})", file=sys.stderr)
        return 2
    write_json(out, {**result, "spec": spec.to_dict(), "same_as": str(source)})
    print(f"{out}: the result of {source} (the same run)", file=sys.stderr)
    return 0


def _writes_to(path: Path) -> bool:
    """Whether this process's standard output or error is the file at `path` (`> point.log`)."""
    try:
        target = path.stat()
    except OSError:
        return False
    for fd in (1, 2):
        try:
            if os.path.samestat(os.fstat(fd), target):
                return True
        except OSError:  # a closed descriptor
            pass
    return False


def _check(args) -> int:
    from suite.check import passed, refuse
    try:
        refuse(args.systems.split(","), args.steps, args.tolerance)
        check_writable(args.out_dir, "--out-dir")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = check(args.systems.split(","), args.out_dir, steps=args.steps, tolerance=args.tolerance,
                    timeout_s=args.timeout)
    print(f"{'system':<14} {'status':<12} {'max gap':>8}  losses")
    for r in summary["systems"]:
        gap = f"{r['max_relative_gap']:.4f}" if "max_relative_gap" in r else "-"
        losses = " ".join(f"{x:.3f}" for x in r["losses"])
        print(f"{r['system']:<14} {r['status']:<12} {gap:>8}  {losses or r.get('reason') or ''}")
    return 0 if passed(summary) else 1


def _accuracy(args) -> int:
    from suite.accuracy.experiment import run
    options: dict = {}
    try:
        for item in args.system_options:
            system, colon, setting = item.partition(":")
            if not system or not colon:
                raise ValueError(f"--option {item!r} is not of the form SYSTEM:KEY=VALUE")
            options.setdefault(system, {}).update(_options([setting]))  # refuses all but key.sub=value
        settings = Settings(out=args.out, work=args.work, systems=args.systems.split(","), model=args.model,
                            pretrained=args.pretrained, metamath=args.metamath, problems=args.problems,
                            seed=args.seed, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                            eval_limit=args.eval_limit or None, eval_batch=args.eval_batch,
                            timeout_s=args.timeout, options=options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = run(settings)
    print(f"{'system':<14} {'status':<12} {'accuracy':>9} {'max loss gap':>13}")
    for system, row in summary["systems"].items():
        gap = summary["loss_gap_to_native"].get(system, {}).get("max_abs")
        acc = f"{100 * row['accuracy']:.1f}%" if "accuracy" in row else "-"
        gap = "-" if gap is None else f"{gap:.4f}"
        print(f"{system:<14} {row['status']:<12} {acc:>9} {gap:>13}")
    return 0 if all(r["status"] == "ok" for r in summary["systems"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    # a SIGTERM (a scheduler's or `timeout`'s) unwinds like Ctrl-C, so a running worker is killed too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    p = argparse.ArgumentParser(prog="python -m suite", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one point in its own process -> one JSON result")
    r.add_argument("--system", required=True, choices=SYSTEMS)
    r.add_argument("--preset", help="model shape (megatrain.presets)")
    r.add_argument("--config", help="a transformers config.json instead of a preset")
    r.add_argument("--layers", type=int, help="override the number of decoder layers")
    r.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a model config field to change, repeatable (e.g. --override hidden_size=7168)")
    r.add_argument("--seq", type=int, default=_default(RunSpec, "seq_len"))
    r.add_argument("--batch", type=int, default=_default(RunSpec, "batch_size"), help="sequences per micro-batch")
    r.add_argument("--accum", type=int, default=_default(RunSpec, "grad_accum"), help="micro-batches per step")
    r.add_argument("--steps", type=int, default=_default(RunSpec, "steps"),
                   help="measured steps at least, after the warm-up (the window the medians are of)")
    r.add_argument("--max-steps", type=int, default=_default(RunSpec, "max_steps"),
                   help="measured steps at most, taken until the last --steps agree within --steady-spread "
                        "(default: 4 x --steps; --steps where the run fixes its count)")
    r.add_argument("--steady-spread", type=float, default=_default(RunSpec, "steady_spread"),
                   help="the window's range over its median that counts as steady")
    r.add_argument("--smoke", action="store_true",
                   help="a check that the point runs: its timing is never judged by `suite compare`")
    r.add_argument("--warmup", type=int, default=_default(RunSpec, "warmup"))
    r.add_argument("--seed", type=int, default=_default(RunSpec, "seed"))
    r.add_argument("--lr", type=float, default=_default(RunSpec, "lr"))
    r.add_argument("--betas", type=float, nargs=2, default=_default(RunSpec, "betas"), metavar=("BETA1", "BETA2"))
    r.add_argument("--eps", type=float, default=_default(RunSpec, "eps"))
    r.add_argument("--weight-decay", type=float, default=_default(RunSpec, "weight_decay"),
                   help="AdamW's decoupled decay, on matrices only (not norms and biases)")
    r.add_argument("--timeout", type=float, default=_default(RunSpec, "timeout_s"),
                   help="seconds before the point is killed")
    r.add_argument("--gpus", type=int, default=_default(RunSpec, "gpus"),
                   help="data-parallel ranks, one per GPU, under torchrun (megatrain, fsdp2, zero3, zero_infinity); "
                        "--batch is the global micro-batch")
    r.add_argument("--python", help="interpreter of the worker (a system's own environment)")
    r.add_argument("--workflow-job", action="store_true",
                   help="as the workflow's point rule runs it (exec'd by its job): end as if interrupted when "
                        "the process that started this one dies, and exit 0 whenever a result is written")
    r.add_argument("--same-as", metavar="RESULT",
                   help="a result of this same run (a grid's `same_as`): written as this point's, nothing run")
    r.add_argument("--out", required=True, help="result JSON (the worker's log goes beside it, .log)")
    r.add_argument("option", nargs="*", help="system options as key.sub=value (e.g. engine.checkpoint_every=1)")
    c = sub.add_parser("check", help="each system's loss on a tiny model tracks native's")
    c.add_argument("--systems", default="megatrain,native")
    c.add_argument("--out-dir", required=True)
    c.add_argument("--steps", type=int, default=_default(check, "steps"))
    c.add_argument("--tolerance", type=float, default=_default(check, "tolerance"),
                   help="largest relative loss gap to native")
    c.add_argument("--timeout", type=float, default=_default(check, "timeout_s"),
                   help="seconds before a system's point is killed")
    t = sub.add_parser("table", help="the table of folders of results")
    t.add_argument("folders", nargs="+")
    d = sub.add_parser("compare", help="two folders of results point by point; exit 1 on a regression")
    d.add_argument("base", help="folder of the reference results (searched recursively)")
    d.add_argument("new", help="folder of the results to check against it")
    d.add_argument("--threshold", type=float, default=0.05,
                   help="the floor: a change counts beyond it and beyond the pair's measured noise (0.05 = 5%%)")
    d.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help=f"comma-separated, of {','.join(METRICS)}")
    d.add_argument("--out", help="also write the comparison as JSON here")
    j = sub.add_parser("project", help="the step model (suite/projection.py) against every measured point, "
                                         "and its predictions for the paper's rows")
    j.add_argument("folders", nargs="+", help="result folders to check against (searched recursively)")
    j.add_argument("--out", default="results/projection", help="where projection.md and .json go")
    a = sub.add_parser("accuracy", help="Table 3: train one model with each system, exact-match accuracy of each")
    a.add_argument("--out", required=True, help="results: per-system JSON, summary.json")
    a.add_argument("--work", required=True, help="scratch: data, the initial model, the trained checkpoints")
    a.add_argument("--systems", default=",".join(_default(Settings, "systems")),
                   help="comma-separated; native is always included")
    a.add_argument("--model", default=_default(Settings, "model"), help="llama shape for the generated task: tiny or 100m")
    a.add_argument("--pretrained", help="a local checkpoint directory (with its tokenizer) instead")
    a.add_argument("--metamath", help="a local MetaMathQA json/jsonl (query, response) instead of generated problems")
    a.add_argument("--problems", type=int, default=_default(Settings, "problems"),
                   help="generated problems before the 70/30 split")
    a.add_argument("--seed", type=int, default=_default(Settings, "seed"))
    a.add_argument("--steps", type=int, default=_default(Settings, "steps"))
    a.add_argument("--batch", type=int, default=_default(Settings, "batch"), help="sequences per step")
    a.add_argument("--seq", type=int, default=_default(Settings, "seq"))
    a.add_argument("--lr", type=float, default=_default(Settings, "lr"))
    a.add_argument("--eval-limit", type=int, default=_default(Settings, "eval_limit"),
                   help="test problems evaluated (0: all)")
    a.add_argument("--eval-batch", type=int, default=_default(Settings, "eval_batch"), help="problems generated at once")
    a.add_argument("--timeout", type=float, default=_default(Settings, "timeout_s"),
                   help="seconds before a system's training is killed")
    a.add_argument("--option", dest="system_options", action="append", default=[], metavar="SYSTEM:KEY=VALUE",
                   help="a system option, repeatable (e.g. megatrain:engine.checkpoint_every=1)")
    args = parse_with_settings(p, argv, "option")
    if args.command == "run" and bool(args.preset) == bool(args.config):
        p.error("run: give exactly one of --preset and --config")
    if args.command in ("table", "project") and (missing := [f for f in args.folders if not os.path.isdir(f)]):
        p.error(f"{args.command}: not a folder of results: {', '.join(missing)}")
    if args.command == "table":
        from suite.table import main as table
        return table(args.folders)
    if args.command == "project":
        from suite.projection import write_report
        try:
            check_writable(args.out, "--out")
        except ValueError as e:
            p.error(f"project: {e}")
        print(write_report([Path(f) for f in args.folders], Path(args.out)), end="")
        return 0
    if args.command == "compare":
        from suite.compare import main as compare
        try:
            if args.out:
                check_writable(Path(args.out).parent, "--out")
            return compare(args.base, args.new, args.threshold, tuple(filter(None, args.metrics.split(","))), args.out)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return {"run": _run, "check": _check, "accuracy": _accuracy}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
