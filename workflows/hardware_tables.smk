# The paper's Table 1 (memory hierarchy, from this machine's bandwidth probe) and Table 2 (model
# configurations, computed from megatrain.presets). Table 2 does not depend on the machine; it sits
# beside each machine's other tables so that `tables` is one folder per machine.


# The probe's flags from the grid's optional `probes.bandwidth` (none given: its full sizes).
BANDWIDTH = GRID.get("probes", {}).get("bandwidth", {})
BANDWIDTH_ARGS = " ".join(
    (["--quick"] if BANDWIDTH.get("quick") else [])
    + [f"--{key.replace('_', '-')} {BANDWIDTH[key]}"
       for key in ("size_gib", "disk_gib", "disk_dir") if key in BANDWIDTH]
)
HARDWARE_TABLES = expand(
    f"results/{HW}/tables/{{name}}.{{ext}}", name=("table1_memory_hierarchy", "table2_models"), ext=("csv", "md")
)


rule bandwidth:
    """Each memory tier's bandwidth on this machine (host, HBM, PCIe, disk): one JSON of tiers, a
    tier the machine lacks as a row with status "absent"."""
    output:
        f"results/{HW}/probes/bandwidth.json",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/probes/bandwidth.log",
    params:
        args=BANDWIDTH_ARGS,
    # All the cores: the probe runs alone, so no grid point competes for memory, PCIe or disk.
    threads: workflow.cores
    shell:
        "python -m experiments.probes.bandwidth {params.args} --out {output} > {log} 2>&1"


rule table1_memory_hierarchy:
    """The probe's tiers -> Table 1 (CSV + Markdown), the paper's vendor figures apart."""
    input:
        probe=f"results/{HW}/probes/bandwidth.json",
        paper="workflows/paper/table1_memory_hierarchy.yaml",
    output:
        csv=f"results/{HW}/tables/table1_memory_hierarchy.csv",
        md=f"results/{HW}/tables/table1_memory_hierarchy.md",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/tables/table1_memory_hierarchy.log",
    params:
        hardware=HW,
    shell:
        "python -m workflows.scripts.memory_table --hardware {params.hardware} --paper {input.paper} "
        "--csv {output.csv} --md {output.md} {input.probe} > {log} 2>&1"


rule table2_models:
    """The paper's models -> their shapes and parameter counts from our presets (Table 2), the
    paper's printed rows apart."""
    input:
        presets="megatrain/presets.py",
        paper="workflows/paper/table2_models.yaml",
    output:
        csv=f"results/{HW}/tables/table2_models.csv",
        md=f"results/{HW}/tables/table2_models.md",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/tables/table2_models.log",
    shell:
        "python -m workflows.scripts.model_table --paper {input.paper} "
        "--csv {output.csv} --md {output.md} > {log} 2>&1"
