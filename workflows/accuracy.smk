# Table 3: the accuracy experiment (suite/accuracy), when the grid has an `accuracy` section.
ACCURACY = GRID.get("accuracy")
ACCURACY_ARGS = " ".join(
    [f"--systems {','.join(ACCURACY['systems'])}"]
    + [f"--{key.replace('_', '-')} {ACCURACY[key]}" for key in
       ("model", "problems", "steps", "batch", "seq", "lr", "eval_limit", "eval_batch", "timeout") if key in ACCURACY]
) if ACCURACY else ""
ACCURACY_OUTPUTS = (
    expand(f"{RESULTS}/tables/table3_accuracy.{{ext}}", ext=("csv", "md"))
    + expand(f"{PLOTS}/table3_accuracy_losses.{{ext}}", ext=("png", "pdf", "inputs.json"))
) if ACCURACY else []


rule accuracy:
    """Train the same initial model with each system (one process each, through the harness), save
    and evaluate each: per-system results and summary.json. Data, the initial model and the trained
    checkpoints go to work/ (not results)."""
    output:
        f"{RESULTS}/accuracy/summary.json",
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/accuracy.log",
    params:
        args=ACCURACY_ARGS,
        out=lambda wildcards, output: os.path.dirname(output[0]),
        work=f"work/{HW}/accuracy",
    resources:
        gpu=1,
    shell:
        "python -m suite accuracy {params.args} --out {params.out} --work {params.work} > {log} 2>&1"


rule table3_accuracy:
    """The summary -> Table 3 (the paper's rows apart) and the overlaid loss curves."""
    input:
        f"{RESULTS}/accuracy/summary.json",
    output:
        csv=f"{RESULTS}/tables/table3_accuracy.csv",
        md=report(f"{RESULTS}/tables/table3_accuracy.md", caption="report/table3.rst",
                  category="Tables", subcategory=HW),
        png=report(f"{PLOTS}/table3_accuracy_losses.png", caption="report/accuracy.rst",
                   category="Figures", subcategory=HW),
        pdf=f"{PLOTS}/table3_accuracy_losses.pdf",
        record=f"{PLOTS}/table3_accuracy_losses.inputs.json",  # its inputs' hashes (workflows/scripts/outputs.py)
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/tables/table3_accuracy.log",
    params:
        hardware=HW,
    shell:
        "python -m workflows.scripts.accuracy_report --summary {input} --hardware {params.hardware} "
        "--csv {output.csv} --md {output.md} --png {output.png} --pdf {output.pdf} > {log} 2>&1"
