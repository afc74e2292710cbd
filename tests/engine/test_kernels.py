"""The layer kernels against the library's modules: the chunked MLP, the lean and compiled norms, the
compiled SiLU-gated product and what it keeps for the backward; each compiled kernel built once, in
this process."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import shape_of
from megatrain.config import DataConfig, EngineConfig, ModelConfig, OptimConfig
from megatrain.memory import plan
from megatrain.resolve import Machine, resolve
from megatrain.shapes import load_hf_config


def test_chunked_mlp_equals_the_whole_mlp():
    """Forward and every gradient of the chunked MLP equal the unchunked module's (float32, a chunk
    that does not divide the tokens); an MLP of another kind is refused by name."""
    from megatrain.chunked_mlp import chunk_tokens
    from transformers.models.llama.modeling_llama import LlamaMLP
    cfg = load_hf_config(ModelConfig(preset="tiny-llama"))
    torch.manual_seed(0)
    whole, chunked = LlamaMLP(cfg), LlamaMLP(cfg)
    chunked.load_state_dict(whole.state_dict())
    chunk_tokens(chunked, 7, cfg.hidden_act)
    x = torch.randn(2, 19, cfg.hidden_size)
    dy = torch.randn(2, 19, cfg.hidden_size)
    outs = []
    for mlp in (whole, chunked):
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        grads = torch.autograd.grad(y, [xi, *mlp.parameters()], dy)
        outs.append([y.detach(), *grads])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not a bias-free SiLU-gated MLP"):
        chunk_tokens(LlamaMLP(cfg), 7, "gelu")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 7])
def test_lean_norm_is_the_library_norm(monkeypatch, family, dtype, chunk):
    """The decoder layers' RMSNorm keeping only its input: the same output and gradients as the
    library's module, to the bit (the same ops, run again in the backward). Over token chunks (30
    tokens in chunks of 7) rows are independent, so the output and the input gradient stay exact;
    the weight gradient sums the chunks' (each rounded to the weight's dtype) in float32: a few bf16
    roundings apart, where a chunk lost would be whole units off."""
    import megatrain.lean_norm as lean_norm
    from megatrain.shapes import FAMILIES, modeling
    if chunk:
        monkeypatch.setattr(lean_norm, "CHUNK", chunk)
        monkeypatch.setattr(lean_norm, "NARROW", 1)  # chunks of rows, whatever their width
    cls = getattr(modeling(family), f"{FAMILIES[family]}RMSNorm")
    scale = "one_plus" if family.startswith("gemma") else "input"  # Gemma's (1 + weight) in float32
    (y, dx, dw), (lean_y, lean_dx, lean_dw) = library_and_lean(cls, dtype, scale=scale)
    assert torch.equal(y, lean_y) and torch.equal(dx, lean_dx)
    tol = 0 if not chunk else 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(lean_dw, dw, rtol=tol, atol=tol)


@pytest.mark.parametrize("width,calls", [(16, 2), (64, 8)])
def test_lean_norm_takes_narrow_rows_in_larger_chunks(monkeypatch, width, calls):
    """Rows narrower than NARROW (Qwen3's head norms) go in chunks of as many elements as CHUNK rows
    of NARROW: 30 rows of 16 in one chunk of up to 32 (8 rows of 64) each way (the forward, and the
    backward's forward run again), 30 of 64 in four of 8; the output and the input gradient the
    library's to the bit either way."""
    import megatrain.lean_norm as lean_norm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    monkeypatch.setattr(lean_norm, "CHUNK", 8)
    monkeypatch.setattr(lean_norm, "NARROW", 64)
    ran = []
    monkeypatch.setattr(lean_norm, "_rms_norm", lambda *a, norm=lean_norm._rms_norm: ran.append(1) or norm(*a))
    (y, dx, _), (lean_y, lean_dx, _) = library_and_lean(Qwen3RMSNorm, torch.float32, width=width)
    assert len(ran) == calls and torch.equal(y, lean_y) and torch.equal(dx, lean_dx)


def library_and_lean(cls, dtype, width=64, **lean):
    """A library RMSNorm of `width` and its copy made lean (`lean`: make_lean's options), each run
    forward and backward on the same input and output gradient: their (output, input gradient,
    weight gradient)."""
    import megatrain.lean_norm as lean_norm
    norms = cls(width, eps=1e-6).to(dtype), cls(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norms[0].weight.normal_(1.0, 0.3)
        norms[1].weight.copy_(norms[0].weight)
    lean_norm.make_lean(norms[1], **lean)
    x = torch.randn(3, 10, width, dtype=dtype)
    dy = torch.randn_like(x)
    out = []
    for norm in norms:
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        out.append((y.detach(), xi.grad, norm.weight.grad))
    return out


@pytest.mark.parametrize("scale", ["input", "float32", "one_plus"], ids=["qwen2", "gpt-oss-scale", "gemma2-one-plus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 7])
def test_compiled_norm_is_the_library_norm_to_rounding(monkeypatch, scale, dtype, chunk):
    """engine.norm_kernel: compiled, the forward and the written-out backward built by
    torch.compile: the library's output and gradients to float32 rounding, and in bf16 to about one
    bf16 rounding (its products stay in float32 where the library's round to bf16)."""
    import megatrain.lean_norm as lean_norm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    if chunk:
        monkeypatch.setattr(lean_norm, "CHUNK", chunk)
        monkeypatch.setattr(lean_norm, "NARROW", 1)  # chunks of rows, whatever their width
    cls = {"input": Qwen2RMSNorm, "float32": GptOssRMSNorm, "one_plus": Gemma2RMSNorm}[scale]
    library, fused = library_and_lean(cls, dtype, scale=scale, compiled=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(fused, library):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def _rotary_run(fn, q, k, cos, sin, grads) -> tuple[torch.Tensor, ...]:
    """A rotary's queries and keys out, and the gradients of q and k given theirs."""
    out = fn(q, k, cos, sin)
    return (*out, *torch.autograd.grad(out, (q, k), grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rotary_is_the_library_rotary_to_rounding(dtype):
    """engine.rotary_kernel: compiled, on the queries and keys as the library's attention gives them
    (transposed views, fewer key heads): the library's output and gradients to float32 rounding, and
    in bf16 to one rounding of the result (the library rounds each product and the sum)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as library
    from megatrain import rotary
    torch.manual_seed(0)
    B, S, D = 2, 8, 16
    q = torch.randn(B, S, 4, D, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, 2, D, dtype=dtype).transpose(1, 2).requires_grad_()
    angles = torch.randn(B, S, D // 2).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grads = torch.randn(B, 4, S, D, dtype=dtype), torch.randn(B, 2, S, D, dtype=dtype)
    runs = [_rotary_run(fn, q, k, cos, sin, grads) for fn in (library, rotary.apply_rotary_pos_emb)]
    # |x cos + R(x) sin| <= 2 max|x|, so one rounding of the result is that times the dtype's epsilon
    ulp = torch.finfo(dtype).eps * 2 * max(q.abs().max().item(), k.abs().max().item(), *(g.abs().max().item() for g in grads))
    for got, want in zip(runs[1], runs[0]):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=2 * ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_gpt_oss_rotary_is_the_library_rotary_to_the_bit(dtype):
    """engine.rotary_kernel: compiled on GPT-OSS's form (each half rotated by the other, cos and sin of
    half the head's width), on the queries and keys as the library's attention gives them: the
    library's output and gradients to the bit (its ops, each result rounded where the library rounds
    it)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as library
    from megatrain import rotary
    torch.manual_seed(0)
    B, S, D = 2, 8, 16
    q = (3 * torch.randn(B, S, 4, D)).to(dtype).transpose(1, 2).requires_grad_()
    k = (3 * torch.randn(B, S, 2, D)).to(dtype).transpose(1, 2).requires_grad_()
    angles = torch.randn(B, S, D // 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grads = torch.randn(B, 4, S, D, dtype=dtype), torch.randn(B, 2, S, D, dtype=dtype)
    runs = [_rotary_run(fn, q, k, cos, sin, grads) for fn in (library, rotary.apply_rotary_halves)]
    for got, want in zip(runs[1], runs[0]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("form", ["llama", "halves"])
def test_compiled_rotary_keeps_the_projections_layout(form):
    """The compiled rotary's queries and keys, and their gradients given in the same layout (as
    attention returns them), stay (batch, heads, tokens, width) views of (batch, tokens, heads,
    width) memory: the library's transposes around attention and the projections' gradients'
    reshapes are then views; the numbers are those of the contiguous inputs."""
    from megatrain import rotary
    torch.manual_seed(0)
    B, S, D = 2, 8, 16
    fn = rotary.apply_rotary_pos_emb if form == "llama" else rotary.apply_rotary_halves
    q = torch.randn(B, S, 4, D).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, 2, D).transpose(1, 2).requires_grad_()
    angles = torch.randn(B, S, D // 2 if form == "halves" else D)
    cos, sin = angles.cos(), angles.sin()
    grads = torch.randn(B, S, 4, D).transpose(1, 2), torch.randn(B, S, 2, D).transpose(1, 2)
    plain = [t.detach().contiguous().requires_grad_() for t in (q, k)]
    runs = [_rotary_run(fn, *plain, cos, sin, [g.contiguous() for g in grads]), _rotary_run(fn, q, k, cos, sin, grads)]
    for got, want in zip(runs[1], runs[0]):
        assert got.transpose(1, 2).is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_sinks_product_is_the_broadcast_product(dtype):
    """engine.sinks_kernel: compiled's product of the attention output (batch, queries, heads,
    width) with each query's factor (a transposed (batch, heads, queries, 1) view): the broadcast
    product's output and the output's gradient to the bit, the factor's gradient (the products,
    each rounded, summed over the width) within float32 summation and one rounding of the exact sum."""
    from megatrain import sinks
    torch.manual_seed(0)
    B, S, H, D = 2, 8, 4, 64
    out = (3 * torch.randn(B, S, H, D)).to(dtype).requires_grad_()
    factor = torch.rand(B, H, S, 1).to(dtype).transpose(1, 2).detach().requires_grad_()
    grad = torch.randn(B, S, H, D, dtype=dtype)
    results = []
    for fn in (lambda o, f: o * f, sinks._Scaled.apply):
        o, f = out.detach().clone().requires_grad_(), factor.detach().clone().requires_grad_()
        y = fn(o, f)
        y.backward(grad)
        results.append((y, o.grad, f.grad))
    (want_y, want_out, want_f), (got_y, got_out, got_f) = results
    assert torch.equal(got_y, want_y) and torch.equal(got_out, want_out)
    products = (grad * out.detach()).double()  # each product as the dtype rounds it
    exact, magnitude = products.sum(-1, keepdim=True), products.abs().sum(-1, keepdim=True)
    ulp = {torch.float32: 2**-24, torch.bfloat16: 2**-8}[dtype]
    bound = (exact.abs() + D * 2**-24 * magnitude) * ulp + D * 2**-24 * magnitude
    assert got_f.shape == want_f.shape and ((got_f.double() - exact).abs() <= bound).all()


def test_sink_factor_renormalises_by_the_sink():
    """The factor is exp(lse) / (exp(lse) + exp(sink)): the softmax's share of the scores once the
    sink joins its denominator (float32 here, where the library's ops round little)."""
    from megatrain import sinks
    torch.manual_seed(0)
    lse, sink = torch.randn(2, 4, 8), torch.randn(4)
    want = lse.exp() / (lse.exp() + sink.view(1, -1, 1).exp())
    torch.testing.assert_close(sinks.sink_factor(lse, sink).squeeze(-1), want)


def test_the_sinks_kernel_stands_in_only_while_a_layer_runs():
    """sinks.applied puts its attention over the library's flex attention in the shared interface
    for the block and gives the library's back, even when the block raises."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from megatrain import sinks
    library = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    with pytest.raises(RuntimeError, match="inside"):
        with sinks.applied():
            assert ALL_ATTENTION_FUNCTIONS["flex_attention"] is sinks.attention
            raise RuntimeError("inside")
    assert ALL_ATTENTION_FUNCTIONS["flex_attention"] is library


def test_the_rotary_kernel_stands_in_only_while_a_layer_runs():
    """rotary.applied swaps the modeling module's function for its form's kernel for the block and
    gives it back, even when the block raises; Llama's form and GPT-OSS's are taken, Phi-3's partial
    rotary is not."""
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.phi3 import modeling_phi3
    from transformers.models.qwen2 import modeling_qwen2
    from megatrain import rotary
    library = modeling_qwen2.apply_rotary_pos_emb
    with pytest.raises(RuntimeError, match="inside"):
        with rotary.applied(modeling_qwen2):
            assert modeling_qwen2.apply_rotary_pos_emb is rotary.apply_rotary_pos_emb
            raise RuntimeError("inside")
    assert modeling_qwen2.apply_rotary_pos_emb is library
    with rotary.applied(modeling_gpt_oss):
        assert modeling_gpt_oss.apply_rotary_pos_emb is rotary.apply_rotary_halves
    assert (rotary.form(modeling_qwen2), rotary.form(modeling_gpt_oss), rotary.form(modeling_phi3)) == \
        ("llama", "halves", None)


def test_compiled_kernels_are_built_once_whatever_their_callers_shapes():
    """Dynamo builds a function at most recompile_limit times a process and then runs its library
    ops instead (kernel_build): the norm's and the MLP's kernels see inputs of every rank, with gradients or
    without, in one form, so these twelve calls add one build each (before: six a forward, three a
    backward)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    import megatrain.lean_norm as lean_norm
    from megatrain import swiglu
    kernels = (lean_norm._rms_norm, lean_norm._backward, swiglu._product, swiglu._grads)
    before = [len(entries(k.__code__)) for k in kernels]
    weight = torch.ones(16, requires_grad=True)
    for shape in ((2, 3, 16), (2, 3, 4, 16), (5, 16)):
        for grad in (False, True):
            x, up = torch.randn(shape, requires_grad=grad), torch.randn(shape, requires_grad=grad)
            y = lean_norm._LeanRMSNorm.apply(x, weight, 0.123, False, True) + swiglu.swiglu(x, up)  # a new eps
            if grad:
                y.sum().backward()
    built = [len(entries(k.__code__)) - b for k, b in zip(kernels, before)]
    assert max(built) <= 1, built


def test_kernels_are_built_for_their_widths_and_any_rows():
    """kernel_build: each input's last dimension fixed in a build, the others free (a vector's one
    too): the MLP's product and the loss (logits by a chunk's tokens, a target per token) build once
    for any number of rows, and once more at another width."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    from megatrain import loss, swiglu
    kernels = (swiglu._product, loss._cross_entropy_and_grad)
    before = [len(entries(k.__code__)) for k in kernels]
    scale = torch.ones(())
    for rows, width in ((5, 13), (9, 13), (300, 13), (5, 29), (17, 29)):  # widths no other test builds
        swiglu.swiglu(torch.randn(rows, width), torch.randn(rows, width))
        loss._compiled_cross_entropy(torch.randn(rows, width), torch.randint(0, width, (rows,)), scale)
    assert [len(entries(k.__code__)) - b for k, b in zip(kernels, before)] == [2, 2]


def test_norm_kernels_are_built_once_a_row_width():
    """A norm kernel's reduction is configured at its build for the width it was built at (lean_norm):
    Qwen3's head norms (128 wide) beside its hidden-size norms get a kernel of their own, and more
    rows at a width build nothing. The process's recompile limit leaves room for every model's widths."""
    import torch._dynamo.config as dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    import megatrain.kernel_build as kernel_build
    import megatrain.lean_norm as lean_norm
    kernels = (lean_norm._rms_norm, lean_norm._backward)
    before = [len(entries(k.__code__)) for k in kernels]
    for rows, width in ((6, 24), (11, 24), (6, 8), (40, 8), (3, 24)):
        x = torch.randn(rows, width, requires_grad=True)
        lean_norm._LeanRMSNorm.apply(x, torch.ones(width, requires_grad=True), 0.321, False, True).sum().backward()
    assert [len(entries(k.__code__)) - b for k, b in zip(kernels, before)] == [2, 2]
    assert dynamo.recompile_limit >= kernel_build.RECOMPILE_LIMIT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_swiglu_is_the_library_product_to_rounding(dtype):
    """engine.mlp_kernel: compiled, silu(gate) * up and its written-out backward built by
    torch.compile: the library's values and gradients to float32 rounding, and in bf16 to about one
    bf16 rounding (silu(gate) is not rounded to bf16 before the product)."""
    import torch.nn.functional as F
    from megatrain.swiglu import swiglu
    gate, up = torch.randn(3, 10, 96, dtype=dtype), torch.randn(3, 10, 96, dtype=dtype)
    gates = [gate.clone().requires_grad_() for _ in range(2)]
    ups = [up.clone().requires_grad_() for _ in range(2)]
    ys = [F.silu(gates[0]) * ups[0], swiglu(gates[1], ups[1])]
    dy = torch.randn_like(ys[0])
    for y in ys:
        y.backward(dy)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for got, want in ((ys[1], ys[0]), (gates[1].grad, gates[0].grad), (ups[1].grad, ups[0].grad)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_compiled_mlp_keeps_one_ffn_tensor_less_and_the_plan_counts_it():
    """What the SiLU-gated MLP saves for its backward, through saved-tensor hooks: the library's
    keeps four tokens x FFN tensors (gate, silu(gate), up, the product: ModelShape.mlp_kept), the
    compiled product three (gate, up, the product); the memory plan's activations differ by one."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP
    from megatrain.unread_mlp import skip_unread_down
    config = Qwen2Config(hidden_size=32, intermediate_size=80, hidden_act="silu")
    x = torch.randn(2, 5, 32, requires_grad=True)
    counts = {}
    for compiled in (False, True):
        mlp = Qwen2MLP(config)
        skip_unread_down(mlp, compiled=compiled)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            mlp(x).sum().backward()
        counts[compiled] = saved.count(2 * 5 * 80)  # tokens x FFN (the down projection's input as 10 x 80)
    assert counts == {False: 4, True: 3}
    shape = shape_of("qwen2.5-7b")
    assert shape.mlp_kept == 4 * shape.ffn
    s = resolve(EngineConfig(device="cpu", no_recompute_layers=2), DataConfig(seq_len=4096, batch_size=2), OptimConfig(),
                shape, Machine(False, None, 1 << 50))
    eager, fused = (plan(shape, replace(s, mlp_kernel=k)).detail for k in ("eager", "compiled"))
    ffn_tensor = s.tokens * shape.ffn * 4  # float32 compute on the CPU
    assert eager["device.block_activations"] - fused["device.block_activations"] == s.checkpoint_every * ffn_tensor
    assert eager["device.kept_graphs"] - fused["device.kept_graphs"] == 2 * ffn_tensor


def test_engine_kernels_build_in_this_process():
    """kernel_build.compiled: the function's own result, and inductor set to build in this process
    (compile_threads 1: no pool of compile workers; the GPU test counts the processes)."""
    import torch._inductor.config as inductor
    from megatrain.kernel_build import compiled
    x = torch.randn(8, 16)
    with inductor.patch(compile_threads=4):
        assert torch.equal(compiled(lambda t: t * 2 + 1)(x), x * 2 + 1)
        assert inductor.compile_threads == 1


@pytest.mark.parametrize("attn, builds", [("flex_attention", 1), ("sdpa", 4)])
def test_a_model_of_flex_attention_builds_in_process(monkeypatch, attn, builds):
    """The library compiles flex attention's masks and attention (GPT-OSS, Gemma on a GPU) before any
    kernel of the engine's runs: the templates of such a model set inductor to build in this process
    first (kernel_build.in_process), so no pool of compile workers starts; other models leave it."""
    import torch._inductor.config as inductor
    from megatrain.templates import Architecture
    shape = shape_of("tiny-gpt-oss")
    monkeypatch.setattr(shape.config, "_attn_implementation", attn)
    monkeypatch.setattr(inductor, "compile_threads", 4)
    Architecture(shape)
    assert inductor.compile_threads == builds

