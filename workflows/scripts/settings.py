"""The workflow's config (a profile's workflow.yaml, with `--config key=value` over it), checked
against workflows/schemas/config.schema.yaml before the grid is read: a misspelt key or a value of
the wrong kind stops the workflow with the key named, instead of running the whole grid."""
from __future__ import annotations

from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"


def checked(config: dict) -> dict:
    """`config`, validated (snakemake.utils.validate raises naming the key), its boolean keys made
    booleans: `--config partial=true` arrives as the string "true" (Snakemake makes booleans of
    True and False only), which the schema would refuse and `bool()` would read as true even for "false"."""
    from snakemake.utils import validate
    schema = yaml.safe_load(SCHEMA.read_text())
    for key, spec in schema["properties"].items():
        if spec.get("type") == "boolean" and str(config.get(key)).lower() in ("true", "false"):
            config[key] = str(config[key]).lower() == "true"
    validate(config, str(SCHEMA))
    return config
