rule point:
    """One grid point in its own process (python -m suite run). A point that does not run (out of
    memory, timeout, unsupported) is still a result: the harness writes its JSON and exits 1, and
    the job succeeds as long as that JSON exists. The worker's own log lands beside the JSON."""
    output:
        f"results/{HW}/points/{{experiment}}/{{id}}.json",
    conda:
        "envs/megatrain.yaml"
    log:
        f"logs/{HW}/points/{{experiment}}/{{id}}.log",
    params:
        args=point_args,
    shell:
        "python -m suite run {params.args} --out {output} > {log} 2>&1 || test -s {output}"
