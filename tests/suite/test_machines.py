"""The machines' descriptions (machines/*.yaml, suite/machines.py): every probe file they name is
committed and holds the named field, each probed machine's constants are those files' figures, and
none of them is written in the step model's code."""
import ast
import json
from pathlib import Path

import pytest
import yaml

from megatrain.shapes import FAMILIES
from suite.machines import D2H, FOLDER, H2D, HOST_COPY, MACHINES, ROOT, Probe, gpu, load

DESCRIPTIONS = sorted(FOLDER.glob("*.yaml"))
PROBED = [m for m in MACHINES.values() if m.match is not None]


def test_every_description_is_a_machine_and_every_probed_one_is_matched_once():
    assert {p.stem for p in DESCRIPTIONS} == set(MACHINES)
    assert len({m.match for m in PROBED}) == len(PROBED)  # a result's env names one machine
    assert {"h100", "h100x2", "h200", "h200-single", "h200x4"} <= {m.name for m in PROBED}
    for m in MACHINES.values():
        assert (m.match is None) == m.source.startswith("assumed"), m.name


@pytest.mark.parametrize("path", DESCRIPTIONS, ids=lambda p: p.stem)
def test_a_description_names_committed_probes_that_hold_its_fields(path):
    desc = yaml.safe_load(path.read_text())
    m = load(path)  # raises, naming the file and field, where one is missing
    for key in ("results", "profile"):
        if key in desc:
            assert (ROOT / desc[key]).is_dir(), (path.name, key)
    if "profile" in desc and "cores" in desc:  # the profile runs Snakemake on the machine's cores
        assert yaml.safe_load((ROOT / desc["profile"] / "config.yaml").read_text())["cores"] == desc["cores"]
    if m.match is not None:
        bandwidth = Probe(desc["bandwidth"], path.name)
        assert (m.h2d_gbps, m.d2h_gbps, m.host_copy_gbps) == tuple(bandwidth.tier(*row) for row in (H2D, D2H, HOST_COPY))
        assert bandwidth.get("env", "gpu") == m.match[0] and bandwidth.get("env", "cpu_cores") == m.match[1]


@pytest.mark.parametrize("name", sorted(p.stem for p in (FOLDER / "gpus").glob("*.yaml")))
def test_a_gpus_layer_probes_ran_on_it(name):
    g = gpu(name)
    assert g.layer[0] > 0 and (g.compiled_saving is None or g.compiled_saving[0] > 0)
    desc = yaml.safe_load((FOLDER / "gpus" / f"{name}.yaml").read_text())
    for family, variants in (desc.get("moe_layers") or {}).items():
        assert family in FAMILIES and set(variants) <= {"library", "lean", "lean_gate"}  # projection.experts_variant
        for ref in variants.values():
            assert Probe(ref["probe"], name).get("gpu") == g.env


def _numbers(path: Path) -> list[float]:
    return [n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, float | int) and not isinstance(n.value, bool)]


def test_no_probed_constant_is_written_in_the_step_models_code():
    """Each probed machine is built from its description, and none of its figures (rounded as a
    hand copy would be) is a literal of the step model's code."""
    for module, builders in (("suite/projection.py", []), ("suite/machines.py", ["load"])):
        tree = ast.parse((ROOT / module).read_text())
        # every MachineModel built, at module level (the hand-written table) or in a function: only
        # by the loader of a description
        def builds(node) -> int:
            return sum(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "MachineModel" for n in ast.walk(node))
        assert builds(tree) == len(builders)
        assert [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and builds(f)] == builders
        literals = _numbers(ROOT / module)
        for m in PROBED:
            assert m == load(FOLDER / f"{m.name}.yaml")
            figures = [m.h2d_gbps, m.d2h_gbps, m.host_copy_gbps, m.layer_tflops, m.compiled_saving[0]]
            figures += [rate for variants in m.moe_layers.values() for rate, _ in variants.values()]
            for f in figures:
                assert not [x for x in literals if x == pytest.approx(f, rel=1e-3)], (module, m.name, f)


def test_a_missing_probe_file_or_field_is_named(tmp_path):
    desc = yaml.safe_load((FOLDER / "h100.yaml").read_text())
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**desc, "bandwidth": "results/h100/probes/no_such.json"}))
    with pytest.raises(ValueError, match=r"m\.yaml: cannot read the probe file results/h100/probes/no_such\.json"):
        load(path)
    probe = tmp_path / "bandwidth.json"
    probe.write_text(json.dumps({"tiers": [{"tier": "pcie", "direction": "h2d-pinned", "status": "ok", "gbps": 50.0}]}))
    path.write_text(yaml.safe_dump({**desc, "bandwidth": str(probe)}))
    with pytest.raises(ValueError, match=r"bandwidth\.json has no measured row tiers\[pcie d2h-pinned\]\.gbps"):
        load(path)
    with pytest.raises(ValueError, match=r"14b\.json has no field variants\.fused\.ceilings\.default\.model_tflops"):
        Probe("results/h200/probes/compiled_saving/14b.json", "x.yaml").layer("fused")
