"""The host memory Ratel's main.py takes, read from its checkout's code (RC4ML/LoHan feb88fe) and
checked against its measured points (baselines/ratel.md, "Read from its code"): the admission of a
Ratel point before anything runs.

Most of it is pinned memory, which torch's host allocator rounds up to a power of two and keeps:
- the parameter and activation swappers' buffers, as config.json sizes them (built on both routes),
  and the fp16 buffer of the parameters held on the host (`max_in_cpu`);
- two checkpointed block inputs a layer (`gpt_model.set_training`: seq x batch x hidden fp16 each);
- the optimizer's side, sized by its largest sub-group G, not by the model: parameters go into
  sub-groups in the model's order, each closed once it reaches 700 M elements
  (`ratel_optimizer._create_fp16_sub_groups`).
On the disk route the optimizer side is the swap pool (config's `buffer_count`), the gradient buffer
and the fp16 swap buffer, each of G elements; its optimizer process (`--is_mp 1`) gets six pool
buffers and the gradient buffer through queues, which copy each into shared memory: 7 x 4G bytes
more. On the host-memory route the float32 master and both moments (12 bytes a parameter) stay in
host memory, beside pinned fp16 parameters, their fp16 flat copy, the gradient buffer and each
sub-group's gradient.
"""
from __future__ import annotations

from megatrain.units import GiB

SUB_GROUP = 700_000_000  # ratel_optimizer.py's sub_group_size default
SHARED_BUFFERS = 7  # pool buffers and the gradient buffer the optimizer process's queues share
# The processes themselves (Python, CUDA contexts, the harness's worker): fitted to the measured
# points, with the optimizer process's context on the disk route
BASE = {"disk": 3.3 * GiB, "cpu": 2.3 * GiB}


def _p2(n: float) -> int:
    """A pinned block of n bytes, as torch's host allocator rounds it."""
    return 1 << max(0, (int(n) - 1).bit_length())


def tensors(hidden: int, layers: int, vocab: int, seq: int) -> list[int]:
    """Elements of each parameter of Ratel's GPT in its registration order (gpt_model.py): the token
    and position embeddings, each block (LayerNorm, attention, LayerNorm, MLP, weights before biases),
    the final LayerNorm."""
    h = hidden
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    return [vocab * h, seq * h] + block * layers + [h, h]


def sub_groups(sizes: list[int]) -> list[int]:
    """Elements of each optimizer sub-group: consecutive parameters, closed at SUB_GROUP or more."""
    groups, current = [], 0
    for n in sizes:
        current += n
        if current >= SUB_GROUP:
            groups.append(current)
            current = 0
    return groups + ([current] if current else [])


def host_bytes(shape: dict, config: dict, offload: str) -> tuple[int, str]:
    """Physical host bytes of a run (shared pages once), and what they are made of. `shape`: main.py's
    model flags; `config`: the checkout's config.json; `offload`: disk or cpu."""
    h, layers, seq, batch = (shape[k] for k in ("hidden_dim", "num_layers", "max_seq_len", "batch_size"))
    zero = config["zero_config"]
    sizes = tensors(h, layers, shape["vocab_size"], seq)
    groups = sub_groups(sizes)
    g, n = max(groups), sum(sizes)
    param, act = zero["offload_param"], zero["offload_act"]
    swappers = _p2(act["buffer_count"] * act["buffer_size"] * 2)
    checkpoints = 2 * layers * _p2(2 * seq * batch * h)
    if offload == "disk":
        swappers += _p2(param["buffer_count"] * param["buffer_size"] * 2) + _p2(2 * param["max_in_cpu"])
        optimizer = (zero["offload_optimizer"]["buffer_count"] + 1) * _p2(4 * g) + _p2(2 * g)
        other = SHARED_BUFFERS * 4 * g
        what = f"{SHARED_BUFFERS} shared buffers"
    else:
        optimizer = _p2(2 * n) + _p2(4 * g) + sum(_p2(4 * x) for x in groups) + sum(_p2(2 * x) for x in sizes)
        other = 12 * n
        what = "float32 master and moments"
    parts = {"swap buffers": swappers, "checkpoints": checkpoints, "optimizer buffers": optimizer, what: other,
             "processes": BASE[offload]}
    total = int(sum(parts.values()))
    how = (f"Ratel's {offload} route at {n / 1e9:.2f} B parameters, largest optimizer sub-group {g / 1e9:.2f} B: "
           + ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in parts.items()))
    return total, how
