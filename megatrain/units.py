"""Byte units, one definition for the engine, the harness and the workflow."""
GiB = 1 << 30
GB_PER_GiB = GiB / 1e9
