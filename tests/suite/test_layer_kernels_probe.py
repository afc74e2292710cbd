"""experiments/probes/layer_kernels.py on the CPU, in this process (a check of the probe, not a
measurement): with --sites each variant's non-matmul time comes by operator and Python call site, or
for the backward's operators the autograd node that ran them; with --matmul-sites the products'."""
from __future__ import annotations

import json
import sys

from experiments.probes import layer_kernels


def eager_tiny_qwen2(tmp_path, monkeypatch, flag: str) -> dict:
    """The probe's eager variant of a tiny Qwen2 layer on the CPU with `flag`, every site kept (which
    rank in the top TOP by their time depends on the machine's load: on a loaded CPU no backward
    operator ranked there)."""
    out = tmp_path / "layer.json"
    monkeypatch.setattr(layer_kernels, "TOP", 1 << 20)
    monkeypatch.setattr(sys, "argv", ["layer_kernels.py", "--preset", "tiny-qwen2", "--seq", "32", "--batch", "2",
                                      "--device", "cpu", "--reps", "1", "--backends", "", "--variants", "eager",
                                      flag, "--out", str(out)])
    layer_kernels.main()
    return json.loads(out.read_text())["variants"]["eager"]


def test_call_sites_name_the_operators_and_their_callers(tmp_path, monkeypatch, capsys):
    sites = eager_tiny_qwen2(tmp_path, monkeypatch, "--sites")["call_sites"]
    assert sites and all(s["op"].startswith("aten::") and s["seconds"] > 0 for s in sites)
    assert not [s["op"] for s in sites if any(k in s["op"] for k in layer_kernels.MATMUL_OPS)]
    # the forward's operators carry their callers (the profiler records no Python stack unless told)
    assert any("modeling_qwen2.py" in frame for s in sites for frame in s["site"]), sites
    # the backward's, run by autograd's thread without a Python stack, carry the node that ran them
    assert any(frame.startswith("autograd: ") and frame.endswith("Backward0") for s in sites for frame in s["site"]), sites
    assert "aten::" in capsys.readouterr().out


def test_matmul_sites_list_the_products_by_their_shapes(tmp_path, monkeypatch):
    """--matmul-sites: the matrix products alone, each with its input shapes (the layer's projections)."""
    run = eager_tiny_qwen2(tmp_path, monkeypatch, "--matmul-sites")
    assert "call_sites" not in run
    sites = run["matmul_sites"]
    assert sites and all(any(k in s["op"] for k in layer_kernels.MATMUL_OPS) and s["seconds"] > 0 for s in sites)
    assert any(s["op"] == "aten::mm" and "[64, " in s["shapes"] for s in sites), sites  # 2 x 32 tokens' rows


def test_the_layer_picked_is_measured(tmp_path, monkeypatch):
    """--layer: Gemma 2's layer 1 attends to all 32 tokens before, layer 0 to a window of 6, so the
    FLOPs its ceiling counts are more."""
    flops = {}
    for layer in (0, 1):
        out = tmp_path / f"layer{layer}.json"
        monkeypatch.setattr(sys, "argv", ["layer_kernels.py", "--preset", "tiny-gemma2", "--seq", "32", "--batch", "2",
                                          "--device", "cpu", "--reps", "1", "--backends", "", "--variants", "eager",
                                          "--layer", str(layer), "--out", str(out)])
        layer_kernels.main()
        result = json.loads(out.read_text())
        assert result["layer"] == layer
        row = result["variants"]["eager"]["ceilings"]["default"]
        flops[layer] = row["model_tflops"] * row["seconds"]
    assert flops[1] > flops[0] * 1.01
