# The reproduction workflow. This first part runs the engine's smoke point; the paper's grids,
# tables and figures are added by the workflow issue (rules in workflows/).
from snakemake.utils import min_version

min_version("8.0")


include: "workflows/engine.smk"


rule all:
    input:
        rules.engine_smoke.output,
