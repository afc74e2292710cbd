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
PROBE = f"{RESULTS}/probes/bandwidth.json"
# `--config partial=true` runs nothing but tables and figures: Table 1 only where this machine's
# probe has run (never a probe of the machine that draws the tables, filed under the grid's)
HARDWARE_TABLES = expand(
    f"{RESULTS}/tables/{{name}}.{{ext}}", ext=("csv", "md"),
    name=[n for n in ("table1_memory_hierarchy", "table2_models")
          if not (PARTIAL and n == "table1_memory_hierarchy" and not os.path.exists(PROBE))],
)


rule bandwidth:
    """Each memory tier's bandwidth on this machine (host, HBM, PCIe, disk): one JSON of tiers, a
    tier the machine lacks as a row with status "absent"."""
    output:
        PROBE,
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/probes/bandwidth.log",
    params:
        args=BANDWIDTH_ARGS,
    # All the cores: the probe runs alone, so no grid point competes for memory, PCIe or disk.
    threads: workflow.cores
    shell:
        "python -m experiments.probes.bandwidth {params.args} --out {output} > {log} 2>&1"


rule table1_memory_hierarchy:
    """The probe's tiers -> Table 1 (CSV + Markdown), the paper's vendor figures apart."""
    input:
        probe=PROBE,
        paper="workflows/paper/table1_memory_hierarchy.yaml",
    output:
        csv=f"{RESULTS}/tables/table1_memory_hierarchy.csv",
        md=f"{RESULTS}/tables/table1_memory_hierarchy.md",
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/tables/table1_memory_hierarchy.log",
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
        csv=f"{RESULTS}/tables/table2_models.csv",
        md=f"{RESULTS}/tables/table2_models.md",
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/tables/table2_models.log",
    shell:
        "python -m workflows.scripts.model_table --paper {input.paper} "
        "--csv {output.csv} --md {output.md} > {log} 2>&1"
