# The reproduction workflow: the grid's points (one job each), one table and one figure per
# experiment, and the engine's smoke run. The grid comes from the profile, or from `--config grid=`:
#   snakemake --profile profiles/cpu        # tiny models on the CPU, the whole DAG in minutes
#   snakemake --profile profiles/h100 -n    # the H100 grid (dry run)
#   snakemake --profile profiles/h100 targets --config grid=workflows/grids/h100-speed.yaml
# Sub-targets: `tables`, `figures`, `engine_smoke`, each experiment by its name (its points, table and
# figure, then the harness's table of its points printed), or one file such as plots/cpu/depth.png.
from snakemake.utils import min_version

min_version("8.0")

# Every job's shell ends, with all it started, when Snakemake dies, however it dies: no job runs on
# and writes after the workflow (workflows/job_shell.py).
shell.executable(f"{workflow.basedir}/workflows/job_shell")


include: "workflows/common.smk"
include: "workflows/points.smk"
include: "workflows/report.smk"
include: "workflows/engine.smk"
include: "workflows/hardware_tables.smk"
include: "workflows/compare.smk"
include: "workflows/accuracy.smk"


rule all:
    default_target: True
    input:
        all_points(),
        all_tables(),
        HARDWARE_TABLES,
        all_figures(),
        ACCURACY_OUTPUTS,
        rules.engine_smoke.output,


rule tables:
    input:
        all_points(),
        all_tables(),
        HARDWARE_TABLES,
        ACCURACY_OUTPUTS,


rule figures:
    input:
        all_points(),
        all_figures(),


# One target per experiment of the grid, named as the experiment.
for _experiment in EXPERIMENTS:

    rule:
        name:
            _experiment
        input:
            experiment_outputs(_experiment),
        conda:
            "workflows/envs/megatrain.yaml"
        log:
            f"{LOGS}/{_experiment}.log",
        params:
            experiment=_experiment,
        localrule: True
        shell:
            f"python -m suite table {RESULTS}/points/{{params.experiment}} 2>&1 | tee {{log}}"
