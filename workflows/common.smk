# The grid (config["grid"], a workflows/grids/*.yaml chosen by the profile or by `--config grid=`),
# validated by schema, and the input functions of the target rules.
import os
import sys

import psutil

from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)  # workflows.scripts and megatrain's suite, from the repo root
from workflows.scripts import grid as gridlib, outputs, settings  # noqa: E402

settings.checked(config)
GRID_FILE = config.get("grid", "workflows/grids/cpu.yaml")
GRID = gridlib.load(GRID_FILE)
validate(GRID, "schemas/grid.schema.yaml")
gridlib.check(GRID)
HW = GRID["hardware"]
# `--config run=FOLDER`: this run's points, tables, figures and logs go to a folder of their own
# (`make run` names one by machine and commit: workflows/scripts/runs.py), the committed
# results/<hardware> staying the baseline they are compared with; without it, the committed tree
# itself (a maintainer's redraw, e.g. with partial=true, or a promoted run's points).
RUN = config.get("run")
RESULTS = RUN or f"results/{HW}"
PLOTS = f"{RUN}/plots" if RUN else f"plots/{HW}"
LOGS = f"{RUN}/logs" if RUN else f"logs/{HW}"
POINTS = gridlib.points(GRID)
EXPERIMENTS = list(GRID["experiments"])


_stated = config.get("host_memory_gb")
if _stated and _stated * 2**30 > 1.05 * psutil.virtual_memory().total:
    print(f"warning: host_memory_gb={_stated} is stated, and the OS reads {psutil.virtual_memory().total / 2**30:.0f} GiB: "
          "every admission takes the statement (right on a host whose MemTotal grows as it is used, wrong on a "
          "smaller one, where a point the statement admits is ended by the OOM killer)", file=sys.stderr)

for _path, _why in [] if RUN else gridlib.stale_results(GRID):  # never deleted: their tables mark them `stale`
    print(f"warning: stale result, kept: {_path}: {_why}; run it again with --forcerun", file=sys.stderr)


wildcard_constraints:
    experiment="|".join(EXPERIMENTS),
    id=r"[A-Za-z0-9][A-Za-z0-9_.-]*",


def point_source(wildcards):
    """A `same_as` point's source result (made first, and once); none for a point that runs. None
    with partial=true, which runs no point, so that nothing of a source can make a partial drawing
    run its copy again (one did, h200's depth/L28_zero3 on a machine without the grid's GPU: the job
    failed and Snakemake deleted the committed result)."""
    same_as = POINTS[(wildcards.experiment, wildcards.id)].get("same_as")
    return [f"{RESULTS}/points/{same_as}.json"] if same_as and not PARTIAL else []


def point_args(wildcards):
    source = point_source(wildcards)
    smoke = ["--smoke"] if GRID.get("smoke_test") else []  # a check that it runs: never judged on speed
    return " ".join(gridlib.argv(POINTS[(wildcards.experiment, wildcards.id)]) + smoke + [f"--same-as {s}" for s in source])


ORDER = {key: n for n, key in enumerate(POINTS)}


def point_priority(wildcards):
    """Of the points ready at once (one at a time on a GPU host), the one first in the grid runs
    first: the grids list each experiment's cheapest first, so a session's run cut short by its
    time has made the most points (left to itself, Snakemake chooses in an order of its own)."""
    return len(ORDER) - ORDER[(wildcards.experiment, wildcards.id)]


def point_gpus(wildcards):
    return POINTS[(wildcards.experiment, wildcards.id)].get("gpus", 1)


def host_memory_env(wildcards):
    """The host's size as the profile or the user states it (GiB), for every system's admission."""
    stated = config.get("host_memory_gb")  # a positive number where given (schemas/config.schema.yaml)
    return "" if stated is None else f"MEGATRAIN_HOST_MEMORY_GB={stated} "


def gpu_guard(wildcards):
    """A grid that needs a GPU (`needs_gpu`): its point's job stops, saying why, where this machine
    has none, before the harness would measure the CPU (its result filed under the grid's hardware)."""
    if not GRID.get("needs_gpu"):
        return ""
    found = "[ -e /dev/nvidia0 ] || nvidia-smi -L 2>/dev/null | grep -q '^GPU '"
    why = (f"grid {HW} needs an NVIDIA GPU and this machine has none: its point is not run (--config "
           "partial=true draws the tables without running points; --profile profiles/cpu runs the CPU grid)")
    return f"{{ {found}; }} || {{ echo '{why}' >&2; exit 1; }}; "


# `--config partial=true`: tables and figures from the points that have a result, without running
# the others (their rows say not_run): a grid measured over several sessions, figures on the way.
PARTIAL = config.get("partial", False)


def experiment_results(wildcards):
    return outputs.point_files(GRID, wildcards.experiment, RESULTS, PARTIAL)


def moe_results(wildcards):
    return outputs.moe_files(wildcards.experiment, RESULTS)


def experiment_points(experiment):
    """An experiment's point results, every one asked for by name: a table or figure already there
    (drawn with partial=true and committed) would otherwise let Snakemake skip the points it lacks,
    since a missing input of an existing output reruns nothing. None with partial=true."""
    return [] if PARTIAL else outputs.point_files(GRID, experiment, RESULTS, partial=False)


def all_points():
    return [f for experiment in EXPERIMENTS for f in experiment_points(experiment)]


def all_tables():
    return expand(f"{RESULTS}/tables/{{experiment}}.{{ext}}", experiment=EXPERIMENTS, ext=("csv", "md"))


def all_figures():
    """Every experiment's figure; with partial=true, only those of experiments with a point that ran
    (a figure of nothing measured is not drawn, so not committed)."""
    drawn = EXPERIMENTS if not PARTIAL else [e for e in EXPERIMENTS if e in outputs.measured_experiments(RESULTS)]
    return expand(f"{PLOTS}/{{experiment}}.{{ext}}", experiment=drawn, ext=("png", "pdf", "inputs.json"))


def experiment_outputs(experiment):
    """One experiment's points, table and figure: the input of its target rule (`snakemake ... depth`)."""
    return (experiment_points(experiment)
            + expand(f"{RESULTS}/tables/{experiment}.{{ext}}", ext=("csv", "md"))
            + expand(f"{PLOTS}/{experiment}.{{ext}}", ext=("png", "pdf", "inputs.json")))
