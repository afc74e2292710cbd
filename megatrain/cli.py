"""`megatrain train --config run.yaml [key.sub=value ...]`, `megatrain plan` and `megatrain data`: a thin
entry point.

`train` and `plan` go through the one planner (planning.plan_run), so `plan` refuses what `train` refuses, with
the same message. Exit status: 0 done (`plan`: the run fits); 2 refused before anything was built
(a setting, a file, output_dir, or the memory plan: `plan` prints its report first); 3 a step's
loss was non-finite or diverged; 130 interrupted."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megatrain.config import load_config, settings_help
from megatrain.launch import refuse

REFUSED = 2  # the exit status of a run refused before anything is built, by `plan` and `train` alike


def parse_with_settings(parser: argparse.ArgumentParser, argv: list[str] | None, dest: str) -> argparse.Namespace:
    """`parser.parse_args`, with `key.sub=value` settings taken wherever they stand among the flags
    (argparse takes a positional list in one run only: `--steps 3 a.b=1` would be refused)."""
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or dest not in vars(args)]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(args, dest, [*(getattr(args, dest, None) or []), *extra])
    return args


def count(text: str) -> int:
    """A whole number of at least 1, for a flag (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def saved_where(output_dir: str | None) -> str:
    """What an interrupted run leaves to resume from, in words (the last complete save, put back in
    place where the interruption came between a save's two renames)."""
    from megatrain.checkpoint import saved_state
    if not output_dir:
        return "nothing was saved (no output_dir)"
    state = saved_state(Path(output_dir) / "state")
    if state is None:
        return f"no training state saved yet in {output_dir}"
    step = json.loads((state / "state.json").read_text())["step"]
    return f"{output_dir}/state holds step {step}: resume=true continues from it"


def rank_arguments(args: argparse.Namespace) -> list[str]:
    """`megatrain train` as each rank of `--gpus` runs it: the same flags and settings, --gpus aside."""
    return ["train", *(["--config", args.config] if args.config else []), *(args.overrides or []),
            *(["--debug"] if args.debug else []), *(["--no-progress"] if args.no_progress else []),
            *([] if args.json is None else ["--json" if args.json else "--no-json"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain", description="Layer-streaming full-precision LLM training")
    sub = parser.add_subparsers(dest="command", required=True)
    keys = "settings (YAML keys, or key.sub=value overrides):\n" + settings_help()
    train = sub.add_parser("train", help="train a model from a YAML run file", epilog=keys,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    plan = sub.add_parser("plan", help="print what a run would do and the memory it needs, without training",
                          description=f"Print what `megatrain train` would do with these settings and the memory it\n"
                                      f"needs, without training; exit {REFUSED}, with train's message, where train\n"
                                      f"would refuse the run.",
                          epilog=keys, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = sub.add_parser("data", help="read and tokenise the data and print an example with its targets marked",
                          epilog=keys, formatter_class=argparse.RawDescriptionHelpFormatter)
    data.add_argument("--example", type=int, default=0, help="which training example to print (default: 0)")
    for p in (train, plan, data):
        p.add_argument("--config", help="YAML run file (see configs/)")
        p.add_argument("overrides", nargs="*", help="settings as key.sub=value, applied after the file")
        p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    plan.add_argument("--gpus", type=count, default=1,
                      help="plan for this many data-parallel ranks on the host (torchrun --nproc-per-node)")
    train.add_argument("--gpus", type=count, default=1,
                       help="train on this many data-parallel ranks of this host, one per GPU (torchrun started "
                            "by this command; on the CPU, ranks through gloo)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--json", action=argparse.BooleanOptionalAction, default=None,
                       help="every step's metrics as a JSON line on stdout (default: when stdout is not a "
                            "terminal, e.g. redirected to a file; output_dir/metrics.jsonl has them either way)")
    args = parse_with_settings(parser, argv, "overrides")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "train" and args.gpus > 1:
            if int(os.environ.get("WORLD_SIZE", 1)) > 1:
                raise ValueError("--gpus starts the ranks itself: run `megatrain train --gpus N` without torchrun")
            from megatrain.launch import launch
            return launch(args.gpus, rank_arguments(args))
        if args.command == "data":
            from megatrain.data.show import show
            print(show(cfg, args.example))
            return 0
        from megatrain.distributed import Ranks  # heavy imports only once the config is valid
        from megatrain.planning import plan_run
        from megatrain.trainer import Trainer
        if args.command == "plan":  # as one host's rank 0 of --gpus ranks: the store once, the rest per rank
            run = plan_run(cfg, Ranks(0, args.gpus, 0, args.gpus), elsewhere=True)
            print(run.describe())
            if run.optimizer_note:
                print(run.optimizer_note)
            run.check()
            print(f"fits {run.where}")
            return 0
        trainer = Trainer(cfg, progress=not args.no_progress)  # planned by plan_run, as `plan` is
    except ValueError as e:  # a setting, a file or the memory plan refused the run: nothing was built
        if args.debug:
            raise
        if not refuse(str(e)):  # under `megatrain train --gpus`, the command says it once for every rank
            print(f"megatrain: error: {e}", file=sys.stderr)
        return REFUSED
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("megatrain: interrupted before training began; nothing was written", file=sys.stderr)
        return 130
    try:
        json_lines = args.json if args.json is not None else not sys.stdout.isatty()
        trainer.fit(log=sys.stdout if json_lines else None, progress=not args.no_progress)
    except FloatingPointError as e:  # a non-finite or diverged step: nothing of it was applied or saved
        if args.debug:
            raise
        from megatrain.trainer import Diverged
        where = "" if isinstance(e, Diverged) else f" at step {trainer.step + 1}"  # a divergence names its step
        print(f"megatrain: error{where}: {e}; {saved_where(cfg.output_dir)}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:  # Ctrl-C: a save cut short leaves the last complete one (io.atomic_dir)
        if args.debug:
            raise
        from megatrain.trainer import Interrupted
        model = f"; the model of step {e.step} is in {e.model}" if isinstance(e, Interrupted) else ""
        print(f"megatrain: interrupted after step {trainer.step} of {trainer.total_steps}; "
              f"{saved_where(cfg.output_dir)}{model}", file=sys.stderr)
        return 130
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
