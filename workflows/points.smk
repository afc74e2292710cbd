rule point:
    """One grid point in its own process (python -m suite run). A point that does not run (out of
    memory, timeout, unsupported) is still a result: with --workflow-job the harness exits 0 once
    it has written its JSON. The job's shell is replaced by the harness (exec), which ends as if
    interrupted when Snakemake dies, however it dies: no point trains on after the workflow.
    The worker's own log lands beside the JSON. `host_memory_gb` (the profile's config or
    `--config host_memory_gb=N`) states the host's size to every system's admission
    (MEGATRAIN_HOST_MEMORY_GB): a host whose MemTotal grows as memory is used reads too small at first.
    A grid that needs a GPU (`needs_gpu`) runs no point where there is none (gpu_guard).
    A point with `same_as` (the same run as another point of its grid: depth's L28 is scale's 7B) is
    not run again: its source is made first, and its result written as this point's (--same-as)."""
    input:
        point_source,  # a `same_as` point's: its source's result, copied (suite run --same-as)
    output:
        f"{RESULTS}/points/{{experiment}}/{{id}}.json",
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/points/{{experiment}}/{{id}}.log",
    priority: point_priority
    resources:
        gpu=point_gpus,  # a data-parallel point's ranks, one GPU each
        host=1,
    params:
        args=point_args,
        host=host_memory_env,
        gpu=gpu_guard,
    shell:
        "{params.gpu}{params.host}exec python -m suite run {params.args} --workflow-job --out {output} > {log} 2>&1"
