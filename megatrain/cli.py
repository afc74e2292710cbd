"""`megatrain train --config run.yaml [key.sub=value ...]`: a thin entry point."""
from __future__ import annotations

import argparse
import sys

from megatrain.config import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain", description="Layer-streaming full-precision LLM training")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a YAML run file")
    train.add_argument("--config", help="YAML run file (see configs/)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("overrides", nargs="*", help="settings as key.sub=value, applied after the file")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from megatrain.trainer import Trainer  # heavy imports only once the config is valid
        trainer = Trainer(cfg)
    except ValueError as e:
        print(f"megatrain: error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.fit(progress=not args.no_progress)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
