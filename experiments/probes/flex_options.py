"""Probe: the library's compiled flex attention at GPT-OSS-20B's attention shape (8 x 4096 tokens, 64
query and 8 key-value heads of 64, bf16, the log-sum-exp returned as the library asks for it) under
kernel options (torch.nn.attention.flex_attention.FlexKernelOptions, passed as the library passes
`kernel_options`): each option set's forward and forward-with-backward milliseconds on the sliding
(128-token window) and the causal block masks, and whether its output and gradients equal the
default's bit for bit (else the largest difference), and its own a second time. BLOCKS_ARE_CONTIGUOUS
holds for both masks (a query block's visited blocks are consecutive); ROWS_GUARANTEED_SAFE for the
causal one alone (a window's first visited block holds none of its last queries' keys).

    python experiments/probes/flex_options.py   # writes $OUT/flex_options.json (OUT: the working directory if unset)
"""
import json
import os
import types

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.integrations.flex_attention import flex_attention_forward

B, S, H, KV, D = 8, 4096, 64, 8, 64
REPS = 10
SAFE = {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}
BWD_64 = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4,
          "bwd_num_stages": 3}
OPTIONS = {
    "default": {},
    "safe": SAFE,
    "contiguous": {"BLOCKS_ARE_CONTIGUOUS": True},
    "bwd_64_w4": BWD_64,
    "contiguous_bwd_64_w4": {"BLOCKS_ARE_CONTIGUOUS": True, **BWD_64},
    "safe_fwd_128x64": {**SAFE, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64},
    "safe_bwd_64_w4": {**SAFE, **BWD_64},
    "safe_bwd_128_w4": {**SAFE, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
}
MASKS = {"sliding": lambda b, h, q, kv: (q >= kv) & (q - kv < 128), "causal": lambda b, h, q, kv: q >= kv}


def main() -> None:
    torch._dynamo.config.recompile_limit = 64  # an option set is a compile of its own
    out_path = os.path.join(os.environ.get("OUT", "."), "flex_options.json")
    module = types.SimpleNamespace(training=True)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rows(h):  # the engine's layout: (B, H, S, D) over (B, S, H, D) memory
        return torch.randn(B, S, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    base = [rows(H), rows(KV), rows(KV)]
    grad = torch.randn(B, H, S, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D)
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "shape": [B, S, H, KV, D], "runs": {}}
    for mask_name, mask_mod in MASKS.items():
        mask = create_block_mask(mask_mod, None, None, S, S, device="cuda")
        reference = None
        for name, options in OPTIONS.items():
            def step(backward=True):
                q, k, v = (t.detach().requires_grad_() for t in base)
                out, lse = flex_attention_forward(module, q, k, v, mask, scaling=0.125, kernel_options=options or None)
                if backward:
                    out.backward(grad)
                    return out, lse, q.grad, k.grad, v.grad
                return out, lse

            try:
                for _ in range(2):
                    got = step()
                times = {}
                for kind in ("forward", "forward_backward"):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    samples = []
                    for _ in range(REPS):
                        start.record()
                        step(kind == "forward_backward")
                        end.record()
                        end.synchronize()
                        samples.append(start.elapsed_time(end))
                    times[kind + "_ms"] = sorted(samples)[REPS // 2]
            except Exception as e:  # an option set the template refuses (shared memory, a block size)
                report["runs"][f"{mask_name}/{name}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                print(mask_name, name, "error", report["runs"][f"{mask_name}/{name}"]["error"])
                continue
            got = [t.detach().float() for t in got]
            again = all(torch.equal(a.detach().float(), b) for a, b in zip(step(), got))  # the same numbers a second time
            if reference is None:
                reference = got
            same = [bool(torch.equal(a, b)) for a, b in zip(got, reference)]
            diff = [float((a - b).abs().max()) for a, b in zip(got, reference)]
            row = {"options": options, **times, "repeats_to_the_bit": again, "equal_to_default": same, "max_abs_diff": diff}
            report["runs"][f"{mask_name}/{name}"] = row
            print(f"{mask_name:8s} {name:18s} fwd {times['forward_ms']:6.3f} ms  fwd+bwd {times['forward_backward_ms']:6.3f} ms"
                  f"  again {again}  equal {same}  max diff {[f'{d:.1e}' for d in diff]}")
            with open(out_path, "w") as f:  # after each: a run cut short keeps what it measured
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
