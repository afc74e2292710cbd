"""The paper's Table 2 (model configurations), computed from our model configs, the paper's rows apart.

    python -m workflows.scripts.model_table --csv OUT.csv --md OUT.md

For each model the paper lists, the preset of the same name (megatrain.presets, matched case
blind on the name's first word: "Qwen2.5-7B" -> qwen2.5-7b) is built into a
`megatrain.shapes.ModelShape`, which gives the shape and the parameter counts. A listed model we
have no preset for is still a row, with status "paper_only" and the reason. Computed rows carry
source="computed", the paper's printed rows source="paper"; they are never merged.
"""
from __future__ import annotations

import argparse

import pandas as pd

from megatrain.io import atomic_file, write_text
from workflows.scripts.aggregate import md_table

ARTEFACT = "table2_models"
COMPUTED_COLUMNS = ["source", "model", "preset", "status", "reason", "model_type", "layers", "hidden_size",
                    "heads", "kv_heads", "head_dim", "ffn_size", "vocab_size", "tied_embeddings",
                    "total_params", "total_params_B", "matmul_params", "matmul_params_B"]
INTEGER_COLUMNS = ["layers", "hidden_size", "heads", "kv_heads", "head_dim", "ffn_size", "vocab_size",
                   "total_params", "matmul_params"]


def preset_for(model: str) -> str | None:
    """Our preset of a model name as the paper prints it, or None."""
    from megatrain.presets import PRESETS

    name = model.split()[0].lower()
    return name if name in PRESETS else None


def computed_row(model: str) -> dict:
    """One model's shape and parameter counts from its preset (status "paper_only" without one)."""
    name = preset_for(model)
    if name is None:
        from megatrain.shapes import FAMILIES
        return {"source": "computed", "model": model, "preset": None, "status": "paper_only",
                "reason": f"no preset in megatrain.presets (layer adapters exist for {sorted(FAMILIES)} only)"}
    from megatrain.shapes import ModelShape, load_hf_config
    from megatrain.config import ModelConfig

    shape = ModelShape(load_hf_config(ModelConfig(preset=name)))
    c = shape.config
    total, matmul = shape.total_params(), shape.matmul_params(active=False)
    return {"source": "computed", "model": model, "preset": name, "status": "ok", "reason": None,
            "model_type": c.model_type, "layers": shape.num_layers, "hidden_size": shape.hidden,
            "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or shape.hidden // c.num_attention_heads,
            "ffn_size": getattr(c, "moe_intermediate_size", None) or c.intermediate_size, "vocab_size": shape.vocab, "tied_embeddings": shape.tied,
            "total_params": total, "total_params_B": total / 1e9,
            "matmul_params": matmul, "matmul_params_B": matmul / 1e9}


def table(paper: str = ARTEFACT) -> pd.DataFrame:
    """Computed rows (one per model the paper lists, in its order), then the paper's printed rows."""
    from workflows.paper import rows

    ref = rows(paper)
    df = pd.DataFrame([computed_row(m) for m in ref["model"]], columns=COMPUTED_COLUMNS)
    df = df.astype({c: "Int64" for c in INTEGER_COLUMNS})
    return pd.concat([df, ref], ignore_index=True, sort=False)


def markdown(df: pd.DataFrame) -> str:
    """Computed and paper rows as two separate Markdown tables."""
    ours = df[df["source"] == "computed"][COMPUTED_COLUMNS].drop(columns="source")
    ref = df[df["source"] == "paper"]
    ref_cols = [c for c in ref.columns if c not in ("source", "artefact") and ref[c].notna().any()]
    return "\n".join([
        "# Table 2: model configurations", "",
        "## Computed (megatrain.presets -> megatrain.shapes.ModelShape)", "", md_table(ours), "",
        f"## Paper ({ref['artefact'].iloc[0]}, as printed)", "", md_table(ref[ref_cols], printed=True),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.model_table", description=__doc__)
    p.add_argument("--paper", default=ARTEFACT, help="workflows/paper artefact (file stem) listing the models")
    p.add_argument("--csv", required=True)
    p.add_argument("--md", required=True)
    a = p.parse_args(argv)
    df = table(a.paper)
    with atomic_file(a.csv) as tmp:
        df.to_csv(tmp, index=False)
    write_text(a.md, markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
