rule engine_smoke:
    """The tiny CPU run of the engine: one JSON line of metrics per step."""
    input:
        "configs/tiny-cpu.yaml",
    output:
        f"{RESULTS}/engine/tiny-cpu.jsonl",
    conda:
        "envs/megatrain.yaml"
    log:
        f"{LOGS}/engine_smoke.log",
    shell:
        "megatrain train --config {input} --no-progress > {output} 2> {log}"
