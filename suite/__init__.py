"""The measurement harness: one run spec for every system, one process per point, one JSON result.

    python -m suite run --system native --preset qwen2.5-3b --seq 4096 --batch 4 --out r.json
    python -m suite check --systems megatrain,native,fsdp2       # each system's loss tracks native's
"""
