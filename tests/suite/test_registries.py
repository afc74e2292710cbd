"""The registries a new system or kernel touches: each is read where its facts are needed, so that
nothing else names the entries."""
from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from megatrain.config import EngineConfig, EngineSettings
from megatrain.kernels import KERNELS
from suite.system import SYSTEMS, System, load

ROOT = Path(__file__).resolve().parents[2]


def test_every_registered_system_is_a_system_with_a_colour_of_its_own():
    for name in SYSTEMS:
        assert issubclass(load(name), System)
    colors = [r.color for r in SYSTEMS.values()]
    assert len(set(colors)) == len(colors)


def test_the_paper_names_a_system_as_the_registry_does():
    """Every system a stated ratio of the paper names is registered under that paper name."""
    named = set()
    for path in (ROOT / "workflows" / "paper").glob("*.yaml"):
        for row in yaml.safe_load(path.read_text(encoding="utf-8")).get("rows", []):
            if isinstance(row, dict) and row.get("versus"):
                named |= {row["system"], row["versus"]}
    assert named and named <= {r.paper for r in SYSTEMS.values()}


def test_a_grid_point_of_an_unregistered_system_is_refused_by_name():
    pytest.importorskip("snakemake")
    from workflows.scripts import grid
    bad = copy.deepcopy(grid.load(ROOT / "workflows" / "grids" / "cpu.yaml"))
    bad["experiments"]["depth"]["points"][1]["system"] = "zero4"
    with pytest.raises(ValueError, match=r"grid point depth/L4: system: unknown 'zero4'; known: \['megatrain'"):
        grid.check(bad)


def test_every_kernel_setting_is_registered_with_the_values_its_fields_take():
    """A kernel setting of EngineConfig is a registered kernel, its values the kernel's own and
    library's (and auto); EngineSettings holds one of the two."""
    asked, resolved = typing.get_type_hints(EngineConfig), typing.get_type_hints(EngineSettings)
    settings = {f.name for f in dataclasses.fields(EngineConfig) if f.name.endswith("_kernel")}
    assert settings == {k.setting for k in KERNELS}
    for k in KERNELS:
        assert set(typing.get_args(asked[k.setting])) == {"auto", k.own, k.library}
        assert set(typing.get_args(resolved[k.setting])) == {k.own, k.library}
