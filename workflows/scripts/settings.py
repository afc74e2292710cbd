"""The workflow's config (a profile's workflow.yaml, with `--config key=value` over it), checked
against workflows/schemas/config.schema.yaml before the grid is read: a misspelt key or a value of
the wrong kind stops the workflow with the key named, instead of running the whole grid."""
from __future__ import annotations

from pathlib import Path

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"


def checked(config: dict) -> dict:
    """`config`, its `partial` a boolean, validated (snakemake.utils.validate raises naming the key)."""
    from snakemake.utils import validate
    # `--config partial=true` arrives as the string "true": Snakemake makes booleans of True and False only
    if str(config.get("partial")).lower() in ("true", "false"):
        config["partial"] = str(config["partial"]).lower() == "true"
    validate(config, str(SCHEMA))
    return config
