"""Probe: the library's compiled flex attention on GPT-OSS-20B's sliding window (128 tokens; 8 x 4096
tokens, 64 query and 8 key-value heads of 64, bf16) over block masks of other block sizes.

A block mask of 128 x 128 blocks (create_block_mask's default, the library's) makes a query block
visit two key blocks, 256 keys a query for a window of 128; 64 x 64 blocks visit three of 64, 192.
Each mask's forward and forward-with-backward milliseconds (median of REPS, with the range), under
kernel blocks that divide its blocks (flex refuses others; an error is recorded as such), and each
output's and gradient's largest difference from a float32 computation of the same attention, beside
the default's (so a difference between the block sizes is read against the rounding both carry).

    python experiments/probes/flex_blocks.py   # writes $OUT/flex_blocks.json (OUT: the working directory if unset)
"""
import json
import os
import types

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.integrations.flex_attention import flex_attention_forward

B, S, H, KV, D, WINDOW = 8, 4096, 64, 8, 64, 128
REPS = 20
CONTIGUOUS = {"BLOCKS_ARE_CONTIGUOUS": True}
RUNS = {  # name: ((query block, key block) of the mask, kernel options)
    "128x128": ((128, 128), CONTIGUOUS),
    "64x64_fwd64_bwd64": ((64, 64), {**CONTIGUOUS, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64,
                                     "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}),
    "64x64_fwd64_bwd32": ((64, 64), {**CONTIGUOUS, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 32,
                                     "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}),
    "64x64_fwd64x32_bwd32": ((64, 64), {**CONTIGUOUS, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32, "bwd_BLOCK_M1": 32,
                                        "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}),
    "64x64_w4": ((64, 64), {**CONTIGUOUS, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4,
                            "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                            "bwd_num_warps": 4}),
    "32x32": ((32, 32), {**CONTIGUOUS, "fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "bwd_BLOCK_M1": 32,
                         "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 32}),
}


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv < WINDOW)


def main() -> None:
    torch._dynamo.config.recompile_limit = 64  # each run is a compile of its own
    out_path = os.path.join(os.environ.get("OUT", "."), "flex_blocks.json")
    module = types.SimpleNamespace(training=True)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rows(h):  # the engine's layout: (B, H, S, D) over (B, S, H, D) memory
        return torch.randn(B, S, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    base = [rows(H), rows(KV), rows(KV)]
    grad = torch.randn(B, H, S, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def step(mask, options, dtype=torch.bfloat16, backward=True):
        q, k, v = (t.detach().to(dtype).requires_grad_(backward) for t in base)  # no grad: the forward's compile alone
        out, lse = flex_attention_forward(module, q, k, v, mask, scaling=0.125, kernel_options=options or None)
        if backward:
            out.backward(grad.to(dtype))
            return out, lse, q.grad, k.grad, v.grad
        return out, lse

    exact = [t.detach() for t in step(create_block_mask(sliding, None, None, S, S, device="cuda"), {}, torch.float32)]
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "shape": [B, S, H, KV, D],
              "window": WINDOW, "reps": REPS, "runs": {}}
    for name, (blocks, options) in RUNS.items():
        mask = create_block_mask(sliding, None, None, S, S, device="cuda", BLOCK_SIZE=blocks)
        row = report["runs"][name] = {"blocks": blocks, "options": options}
        for kind in ("forward", "forward_backward"):  # apart: flex may build a forward it has no backward for
            backward = kind == "forward_backward"
            try:
                for _ in range(2):
                    got = step(mask, options, backward=backward)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                samples = []
                for _ in range(REPS):
                    start.record()
                    step(mask, options, backward=backward)
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end))
            except Exception as e:  # a kernel block the template refuses (shared memory, a block size)
                row[kind + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                continue
            samples.sort()
            row[kind + "_ms"], row[kind + "_range_ms"] = samples[REPS // 2], [samples[0], samples[-1]]
            row[kind + "_max_abs_diff_from_float32"] = [float((a.detach().float() - b.float()).abs().max())
                                                        for a, b in zip(got, exact)]
        print(name, {k: v for k, v in row.items() if k not in ("blocks", "options")})
        with open(out_path, "w") as f:  # after each: a run cut short keeps what it measured
            json.dump(report, f, indent=1)

if __name__ == "__main__":
    main()
