"""The ColossalAI Gemini runner on CPU: its refusals (no colossalai, no CUDA, bad options), before
anything is built."""
import re
import sys
import types

import pytest
import torch

from suite.spec import RunSpec
from baselines.gemini import Gemini
from suite.system import Unsupported

CPU = torch.device("cpu")


def spec(**options) -> RunSpec:
    return RunSpec(system="gemini", model={"preset": "tiny-qwen2"}, seq_len=32, options=options)


def test_without_colossalai_unsupported_names_versions(monkeypatch):
    monkeypatch.setitem(sys.modules, "colossalai", None)  # `import colossalai` now raises ImportError
    with pytest.raises(Unsupported) as e:
        Gemini(spec(), CPU)
    message = str(e.value)
    assert "colossalai cannot be imported: ModuleNotFoundError" in message
    assert f"installed: torch {torch.__version__}" in message
    assert re.search(r"requires torch[<>=]", message), message  # colossalai's own torch pin


def test_importable_colossalai_without_cuda_unsupported(monkeypatch):
    # stand-ins for the four names the runner imports: the refusal must come before any is used
    for name, attr in [("colossalai", None), ("colossalai.booster", "Booster"),
                       ("colossalai.booster.plugin", "GeminiPlugin"), ("colossalai.nn", None),
                       ("colossalai.nn.optimizer", "HybridAdam")]:
        module = types.ModuleType(name)
        if attr:
            setattr(module, attr, object())
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["colossalai"].__version__ = "0.0-stub"
    with pytest.raises(Unsupported, match="needs a CUDA device.*got cpu"):
        Gemini(spec(), CPU)


@pytest.mark.parametrize("options, setting", [
    ({"placement": "static"}, "unknown"),
    ({"placement_policy": "cuda"}, "placement_policy"),
    ({"placement_policy": "auto", "offload_param_frac": 0.5}, "offload_param_frac"),
    ({"offload_optim_frac": 1.5}, "offload_optim_frac"),
    ({"enable_async_reduce": "no"}, "enable_async_reduce"),
])
def test_bad_options_rejected(options, setting):
    with pytest.raises(ValueError, match=setting):
        Gemini(spec(**options), CPU)


def test_settings_reach_the_plugin_as_given():
    from baselines.gemini import _settings
    assert _settings({}) == {"placement_policy": "static", "offload_optim_frac": 1.0, "offload_param_frac": 1.0,
                             "enable_async_reduce": False}  # not ColossalAI's default: it races on one rank
    assert _settings({"placement_policy": "auto", "enable_async_reduce": True}) == {
        "placement_policy": "auto", "enable_async_reduce": True}
