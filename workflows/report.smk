# Tables and figures of the experiments, and the HTML report (`snakemake --report report.html`):
# every figure, and each table's Markdown, with its caption from workflows/report/.
import shlex

from workflows.scripts.aggregate import EXPERIMENTS as KNOWN_EXPERIMENTS


report: "report/workflow.rst"


rule table:
    """One experiment's points -> a tidy CSV and a Markdown table, the paper's rows apart."""
    input:
        points=experiment_results,
        moe=moe_results,
        code="workflows/scripts/aggregate.py",  # a table made by older code is made again
    output:
        csv=f"{RESULTS}/tables/{{experiment}}.csv",
        md=report(f"{RESULTS}/tables/{{experiment}}.md", caption="report/table.rst",
                  category="Tables", subcategory=HW),
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/tables/{{experiment}}.log",
    params:
        # the arguments the check of the committed tables makes them with (workflows/scripts/outputs.py)
        args=lambda wildcards, input: shlex.join(outputs.table_argv(GRID_FILE, GRID, wildcards.experiment, RESULTS,
                                                                    list(input.points), list(input.moe))),
    shell:
        "python -m workflows.scripts.aggregate {params.args} --csv {output.csv} --md {output.md} > {log} 2>&1"


# One figure rule per experiment, so that each figure carries its own caption (a caption's path
# takes no wildcards); an experiment without a caption of its own gets report/generic.rst.
for _experiment in EXPERIMENTS:

    rule:
        name:
            f"figure_{_experiment}"
        input:
            table=f"{RESULTS}/tables/{_experiment}.csv",
            # a figure drawn by older code is drawn again (its record names the code's hashes)
            code=["workflows/scripts/plot.py", "workflows/scripts/aggregate.py"],
        output:
            png=report(f"{PLOTS}/{_experiment}.png",
                       caption=f"report/{_experiment if _experiment in KNOWN_EXPERIMENTS else 'generic'}.rst",
                       category="Figures", subcategory=HW),
            pdf=f"{PLOTS}/{_experiment}.pdf",
            record=f"{PLOTS}/{_experiment}.inputs.json",  # its inputs' hashes (workflows/scripts/outputs.py)
        conda:
            "envs/megatrain.yaml"
        log:
            f"{LOGS}/figures/{_experiment}.log",
        params:
            hardware=HW,
            experiment=_experiment,
            smoke="--smoke-test" if GRID.get("smoke_test") else "",
        shell:
            "python -m workflows.scripts.plot --csv {input.table} --experiment {params.experiment} "
            "--hardware {params.hardware} {params.smoke} --png {output.png} --pdf {output.pdf} > {log} 2>&1"
