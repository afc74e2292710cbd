"""Helpers of the Snakemake workflow: grid points, result tables and figures (testable alone)."""
