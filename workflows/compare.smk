# Cross-hardware comparison: one experiment's points from several machines, side by side. Not part
# of `all`: it needs results from more than one machine. The machines come from the config,
#   snakemake plots/compare/scale.png --config 'compare={hardware: [h100, h200]}'
# each naming a results/<hardware>/points folder, or by default every machine whose results hold the
# experiment (and the profile's own). The profile's own machine's points are built as usual; the
# others' must already be there (copied from those machines).
from workflows.scripts import hardware_compare as hwcompare

COMPARE_HW = (config.get("compare") or {}).get("hardware")


rule compare_hardware:
    """One experiment's points on each machine compared -> grouped bars of model TFLOP/s."""
    input:
        lambda w: hwcompare.inputs(hwcompare.machines(COMPARE_HW, w.experiment, HW), w.experiment, HW, experiment_results(w)),
    output:
        png="plots/compare/{experiment}.png",
        pdf="plots/compare/{experiment}.pdf",
        record="plots/compare/{experiment}.inputs.json",  # its inputs' hashes (workflows/scripts/outputs.py)
    conda:
        "envs/megatrain.yaml"
    log:
        "logs/compare/{experiment}.log",
    params:
        folders=lambda w: hwcompare.folder_args(hwcompare.machines(COMPARE_HW, w.experiment, HW), w.experiment),
    shell:
        "python -m workflows.scripts.hardware_compare --title '{wildcards.experiment}: model TFLOP/s by hardware' "
        "--png {output.png} --pdf {output.pdf} {params.folders} > {log} 2>&1"
