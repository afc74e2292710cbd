"""engine.experts_kernel: lean (megatrain/lean_experts.py) against the library's grouped-GEMM
experts, module by module on the CPU: the forward bit for bit, the gradients of the hidden states,
routing weights, stacked weights and biases within float32 summation order, experts no row reaches
included. The engine's training with it is in tests/engine/test_engine_reference.py."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

from megatrain import lean_experts
from megatrain.config import ModelConfig
from megatrain.shapes import ModelShape, load_hf_config


def _experts(preset: str):
    hf = load_hf_config(ModelConfig(preset=preset), cuda=False)
    modeling = importlib.import_module(f"transformers.models.{hf.model_type}.modeling_{hf.model_type}")
    cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("Experts"))
    torch.manual_seed(0)
    library = cls(hf).float()
    for p in library.parameters():
        torch.nn.init.normal_(p, std=0.1)
    lean = copy.deepcopy(library)
    lean_experts.make_lean(lean)
    return hf, library, lean


def _run(module, x, index, weights, grad):
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(x, index, weights)
    out.backward(grad)
    return out, x.grad, weights.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("tokens", [37, 1], ids=["every-expert", "most-experts-idle"])
def test_lean_experts_compute_the_library_experts(preset, tokens):
    hf, library, lean = _experts(preset)
    assert lean_experts.is_experts(library) and library.has_bias == (preset == "tiny-gpt-oss")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hf.hidden_size, generator=gen)
    weights, index = torch.topk(torch.randn(tokens, library.num_experts, generator=gen).softmax(-1),
                                hf.num_experts_per_tok)
    grad = torch.randn(tokens, hf.hidden_size, generator=gen)
    ref, got = _run(library, x, index, weights, grad), _run(lean, x, index, weights, grad)
    assert torch.equal(got[0], ref[0])  # the forward: the same arithmetic
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-7)
    assert set(got[3]) == set(ref[3])
    for name, g in ref[3].items():
        torch.testing.assert_close(got[3][name], g, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    if tokens == 1:  # experts no row reaches: zero gradients, their biases' too
        idle = sorted(set(range(library.num_experts)) - set(index.flatten().tolist()))
        assert idle and not got[3]["down_proj"][idle].any()
        if library.has_bias:
            assert not got[3]["down_proj_bias"][idle].any()


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-qwen3-moe", "tiny-mixtral"])
def test_compiled_gates_compute_the_library_gates(preset):
    """engine.mlp_kernel: compiled with the lean experts: GPT-OSS's clamped gate and Qwen3-MoE's and
    Mixtral's SiLU gate as one compiled kernel each way, and the router's weighting with the sum back
    to token order (and its gradients, and the gather's) each one compiled pass, against the library's experts in float32 within
    rounding, at weights large enough that GPT-OSS's clamps cut (their gradients masked)."""
    hf, library, lean = _experts(preset)
    for p in library.parameters():
        torch.nn.init.normal_(p, std=1.5)
    lean = copy.deepcopy(library)
    kind = lean_experts.gate_kind(hf.model_type, hf.hidden_act)
    assert kind == {"tiny-gpt-oss": "clamped", "tiny-qwen3-moe": "silu", "tiny-mixtral": "silu"}[preset]
    lean_experts.make_lean(lean, kind)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, hf.hidden_size, generator=gen)
    weights, index = torch.topk(torch.randn(37, library.num_experts, generator=gen).softmax(-1), hf.num_experts_per_tok)
    grad = torch.randn(37, hf.hidden_size, generator=gen)
    if kind == "clamped":  # the clamps bind on some rows, both ways
        up = torch.einsum("th,hf->tf", x, library.gate_up_proj[0]) + library.gate_up_proj_bias[0]
        assert (up[:, ::2] > library.limit).any() and (up[:, 1::2].abs() > library.limit).any()
    calls = []
    kernel = lean_experts._GATES[kind]
    fused = ("_compiled_combine", "_compiled_grad_inputs", "_compiled_sum_picks",
             *(("_compiled_add_bias", "_compiled_grad_rows_biased") if library.has_bias else ("_compiled_grad_rows",)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(lean_experts._GATES, kind, tuple(lambda *a, k=k: calls.append(k) or k(*a) for k in kernel))
        for name in fused:
            patch.setattr(lean_experts, name, lambda *a, k=getattr(lean_experts, name), n=name: calls.append(n) or k(*a))
        ref, got = _run(library, x, index, weights, grad), _run(lean, x, index, weights, grad)
    # the compiled gate and weighting, forward and backward, and GPT-OSS's two bias additions (the
    # down bias's part of the weights' gradient in the rows' gradient's pass)
    assert len(calls) == 6 + 2 * library.has_bias and set(fused) <= set(calls)
    # at these magnitudes the products cancel: float32 rounding compared over each whole tensor
    for a, b in [(got[0], ref[0]), (got[1], ref[1]), (got[2], ref[2]), *((got[3][n], ref[3][n]) for n in ref[3])]:
        assert (a - b).norm() <= 1e-6 * b.norm()


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-qwen3-moe"])
@pytest.mark.parametrize("tokens", [37, 1], ids=["every-expert", "most-experts-idle"])
def test_unread_output_leaves_the_down_projection_out(preset, tokens):
    """With the gate compiled, the experts whose output nothing reads (unread_mlp.output_unused)
    run one grouped GEMM fewer (the down projection's) and compute no output, and their gradients
    are those of the run that computed it, to the bit: the weighting's backward never reads it."""
    from transformers.integrations import moe

    from megatrain.unread_mlp import output_unused
    hf, library, _ = _experts(preset)
    lean = copy.deepcopy(library)
    lean_experts.make_lean(lean, lean_experts.gate_kind(hf.model_type, hf.hidden_act))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hf.hidden_size, generator=gen)
    weights, index = torch.topk(torch.randn(tokens, library.num_experts, generator=gen).softmax(-1), hf.num_experts_per_tok)
    grad = torch.randn(tokens, hf.hidden_size, generator=gen)
    gemms = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "_grouped_mm", lambda *a, f=moe._grouped_mm, **kw: gemms.append(1) or f(*a, **kw))
        computed = _run(lean, x, index, weights, grad)
        forward = len(gemms)
        gemms.clear()
        lean.zero_grad()
        with output_unused():
            unread = _run(lean, x, index, weights, grad)
        assert len(gemms) == forward - 1
    for got, want in [*zip(unread[1:3], computed[1:3]), *((unread[3][n], computed[3][n]) for n in computed[3])]:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_bias_addition_is_the_library_addition(dtype):
    """The experts' biases added by the compiled pass that reads each row's bias through its expert:
    the library's gathered copy added in place, to the bit; the rows' gradient passed as it comes,
    the biases' each expert's rows summed in float32 and rounded once (zero for an expert no row
    reaches): float32 within its summation order of the gather's backward; bf16 the exact sums
    rounded, to the bit (a few bf16 rows add exactly in float32; the gather's backward adds in bf16
    and parts from them)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([0, 0, 0, 2, 2, 3, 5, 5, 5, 5, 5])  # sorted: experts 1 and 4 reach no row
    counts = torch.bincount(ids, minlength=6)
    out = torch.randn(len(ids), 24, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(6, 24, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(len(ids), 24, generator=gen).to(dtype)
    want = out.clone()
    want.add_(bias[ids])
    got = lean_experts._ExpertBias.apply(out, bias, ids, counts, True)
    assert torch.equal(got, want)
    (want_out, want_bias), (got_out, got_bias) = (torch.autograd.grad(y, (out, bias), grad) for y in (want, got))
    assert torch.equal(got_out, want_out) and not got_bias[[1, 4]].any()
    if dtype == torch.float32:
        torch.testing.assert_close(got_bias, want_bias, rtol=1e-6, atol=1e-6)
    else:
        exact = torch.zeros(bias.shape, dtype=torch.float64).index_add_(0, ids, grad.double())
        assert torch.equal(got_bias, exact.to(dtype))


def test_lean_experts_leave_the_library_experts_class_as_it_was():
    """make_lean changes the one module (a template's), never the library's class."""
    _, library, lean = _experts("tiny-qwen3-moe")
    assert "forward" in vars(lean) and "forward" not in vars(library)


def kept_per_pick(preset: str, width: int, device: str) -> tuple[ModelShape, dict[bool, float]]:
    """What the experts save for their backward, through saved-tensor hooks (bf16, hidden 256, 2048
    tokens; the inputs and weights not counted), in bf16 elements a pick: the library's (False) and
    the lean ones with their compiled gate (True); and the shape the memory plan counts them by."""
    from tests.helpers import shape_of
    widths = {"intermediate_size" if preset == "tiny-gpt-oss" else "moe_intermediate_size": width}
    hf = load_hf_config(ModelConfig(preset=preset, overrides={"hidden_size": 256, **widths}), cuda=False)
    modeling = importlib.import_module(f"transformers.models.{hf.model_type}.modeling_{hf.model_type}")
    cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("Experts"))
    tokens, k = 2048, hf.num_experts_per_tok
    kept = {}
    for lean in (False, True):
        torch.manual_seed(0)
        module = cls(hf).to(device=device, dtype=torch.bfloat16)
        if lean:
            lean_experts.make_lean(module, lean_experts.gate_kind(hf.model_type, hf.hidden_act))
        x = torch.randn(tokens, 256, dtype=torch.bfloat16, device=device, requires_grad=True)
        weights = torch.rand(tokens, k, device=device).softmax(-1).to(torch.bfloat16).requires_grad_()
        given = {t.untyped_storage().data_ptr() for t in (x, weights, *module.parameters())}
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in given:
                saved[storage.data_ptr()] = storage.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x, torch.rand(tokens, module.num_experts, device=device).topk(k).indices, weights)
        out.float().sum().backward()
        kept[lean] = sum(saved.values()) / 2 / (tokens * k)
    return shape_of(preset, hidden_size=256, **widths), kept


@pytest.mark.parametrize("preset,width", [("tiny-gpt-oss", 256), ("tiny-qwen3-moe", 128)])
def test_the_memory_plan_counts_what_the_experts_keep(preset, width):
    """Per pick, what the experts keep (kept_per_pick): the library's within ModelShape.mlp_kept's
    count, the lean ones with their compiled gate within mlp_kept_compiled's and less than one element
    below it (the gathered input, the gate's input and output, the routing's indices)."""
    shape, kept = kept_per_pick(preset, width, "cpu")
    k = shape.top_k
    assert kept[False] <= shape.mlp_kept / k
    assert shape.mlp_kept_compiled / k - 1 < kept[True] <= shape.mlp_kept_compiled / k
