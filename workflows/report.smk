rule table:
    """One experiment's points -> a tidy CSV and a Markdown table, the paper's rows apart."""
    input:
        experiment_results,
    output:
        csv=f"results/{HW}/tables/{{experiment}}.csv",
        md=f"results/{HW}/tables/{{experiment}}.md",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/tables/{{experiment}}.log",
    params:
        paper=paper_option,
        hardware=HW,
    shell:
        "python -m workflows.scripts.aggregate --experiment {wildcards.experiment} "
        "--hardware {params.hardware} {params.paper} --csv {output.csv} --md {output.md} {input} > {log} 2>&1"


rule figure:
    """One experiment's table -> a figure, measured points and the paper's drawn apart."""
    input:
        f"results/{HW}/tables/{{experiment}}.csv",
    output:
        png=f"plots/{HW}/{{experiment}}.png",
        pdf=f"plots/{HW}/{{experiment}}.pdf",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/figures/{{experiment}}.log",
    params:
        hardware=HW,
    shell:
        "python -m workflows.scripts.plot --csv {input} --experiment {wildcards.experiment} "
        "--hardware {params.hardware} --png {output.png} --pdf {output.pdf} > {log} 2>&1"
