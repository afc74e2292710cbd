rule point:
    """One grid point in its own process (python -m suite run). A point that does not run (out of
    memory, timeout, unsupported) is still a result: with --workflow-job the harness exits 0 once
    it has written its JSON. The job's shell is replaced by the harness (exec), which ends as if
    interrupted when Snakemake dies, however it dies: no point trains on after the workflow.
    The worker's own log lands beside the JSON."""
    output:
        f"results/{HW}/points/{{experiment}}/{{id}}.json",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/points/{{experiment}}/{{id}}.log",
    params:
        args=point_args,
    shell:
        "exec python -m suite run {params.args} --workflow-job --out {output} > {log} 2>&1"
