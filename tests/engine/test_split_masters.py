"""Split float32 masters (docs/host-store.md): the bf16 shadow that streams is the master's high half
and only the low 16 bits are kept apart, with a flag for the halfway masters rounded down. The
masters come back exactly, the shadow is the cast a whole master's load makes on the device, and
training is bit for bit what it is with whole float32 masters (engine.split_masters true or false)."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

import pinned_numerics
from megatrain import adamw
from megatrain.config import OptimConfig, load_config
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Storage, Tile, _ties, join, split
from megatrain.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "tiny_cpu_bf16_split.json"


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def as_float(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int64).to(torch.int32).view(torch.float32)  # low 32 bits of each


def rne(b: torch.Tensor) -> torch.Tensor:
    """Round to nearest even of float32 bit patterns (int64) to bf16's 16 bits, in integers."""
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def edge_patterns() -> torch.Tensor:
    """Every low half under high halves at the edges: zeros and subnormals, the smallest normals,
    around 1.0 (a round up carries into the exponent), the largest finite (rounds up to inf),
    both signs; plus a large random sample with 1 in 16 pushed onto an exact halfway point."""
    highs = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F]
    highs += [h | 0x8000 for h in highs]
    low = torch.arange(1 << 16, dtype=torch.int64)
    crafted = torch.cat([(h << 16) | low for h in highs] + [torch.tensor([0x7F800000, 0xFF800000])])
    gen = torch.Generator().manual_seed(0)
    sample = torch.randint(0, 1 << 32, (1 << 20,), generator=gen, dtype=torch.int64)
    halfway = torch.rand(sample.shape, generator=gen) < 1 / 16
    sample[halfway] = (sample[halfway] & ~0xFFFF) | 0x8000
    return torch.cat([crafted, sample])


def test_split_and_join_are_exact_for_every_finite_float32():
    b = edge_patterns()
    master = as_float(b).contiguous()
    number = ~torch.isnan(master)  # NaN comes back as a NaN, not as the same one
    n = master.numel()
    gen = torch.Generator().manual_seed(1)
    v = torch.rand(n, generator=gen) * torch.logspace(-30, 0, n)  # AdamW's second moments: never negative
    v[::7] = 0.0
    v_bits = bits(v)
    shadow, low, exp_avg_sq = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16), v.clone()
    split(master, shadow, low, exp_avg_sq)
    # the shadow is the cast the stream always had, which is round to nearest even
    assert torch.equal(shadow.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    h = shadow.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(h[number], rne(b)[number])
    # only the halfway masters rounded down are flagged, and only in the sign of exp_avg_sq
    down = ((b & 0xFFFF) == 0x8000) & ((b >> 16) == h) & number
    assert int(down.sum()) > 20_000
    assert torch.equal((bits(exp_avg_sq) >> 31 == 1)[number], down[number]) and torch.equal(bits(exp_avg_sq.abs()), v_bits)
    # the two halves alone cannot tell such a master from the one 2^16 below (also halfway, rounded up)
    pair = as_float(torch.tensor([0x3F808000, 0x3F7F8000]))
    assert torch.equal(pair.to(torch.bfloat16).view(torch.int16), torch.tensor([0x3F80, 0x3F80], dtype=torch.int16))
    assert torch.equal(pair.view(torch.int32).to(torch.int16), torch.tensor([-(1 << 15)] * 2, dtype=torch.int16))
    # join reads them back exactly; `take` leaves exp_avg_sq as it was before the split
    out = join(shadow, low, exp_avg_sq, torch.empty(n))
    assert torch.equal(bits(out)[number], b[number]) and bool(torch.isnan(out[~number]).all())
    out = join(shadow, low, exp_avg_sq, torch.empty(n), torch.empty(n, dtype=torch.int32), take=True)
    assert torch.equal(bits(out)[number], b[number]) and torch.equal(bits(exp_avg_sq), v_bits)


def test_a_split_tile_is_written_in_chunks_exactly(monkeypatch):
    """Tile.write_master into a split tile goes through float32 chunks of store._DRAW elements (here
    1000: chunk edges off the tie search's rows), from a bf16 or a float32 tensor, at an offset:
    the masters read back are the values written, halfway ones rounded down included."""
    import megatrain.store as store
    monkeypatch.setattr(store, "_DRAW", 1000)
    widened = []
    monkeypatch.setattr(store, "split", lambda master, *rest: (widened.append(master.numel()), split(master, *rest)))
    b = edge_patterns()[-(1 << 14):]  # random patterns, 1 in 16 halfway
    values = as_float(b)
    values = torch.where(torch.isnan(values), torch.zeros(()), values)
    n = values.numel()
    assert int(((b & 0xFFFF) == 0x8000).sum()) > 500
    tile = Tile("t", Layout.of([ParamSpec("w", (7 + n,))]), torch.float32, torch.bfloat16, pinned=False, grad=False,
                split=True)
    tile.reset()
    tile.write_master(values, 7)
    tile.write_master(values[:7].to(torch.bfloat16), 0)
    assert max(widened) == 1000 and sum(widened) == n + 7  # no float32 copy larger than a chunk
    with tile.plain_state() as state:
        assert torch.equal(bits(state["master"][7: 7 + n]), bits(values))
        assert torch.equal(state["master"][:7], values[:7].to(torch.bfloat16).float())
    assert torch.equal(tile.shadow[7: 7 + n], values.to(torch.bfloat16))


def test_ties_found_in_rows_and_tail():
    low = torch.zeros(5 * 1024 + 37, dtype=torch.int16)
    at = [0, 63, 64, 1023, 1024, 3000, 3001, 5 * 1024, 5 * 1024 + 36]  # row and sub-row edges, two in one
    low[at] = -(1 << 15)
    assert _ties(low).tolist() == at and _ties(low[:10]).tolist() == [0]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_split_tile_updates_as_a_whole_float32_master(monkeypatch, compiled):
    """AdamW on a split tile, in pieces and chunks across the decayed and undecayed parts, leaves
    the master and moments bit for bit those of a whole float32 master, the shadow its cast;
    `compiled`: the split tile's update is the one pass (fused_adamw.py), the whole one eager."""
    monkeypatch.setattr(adamw, "CHUNK", 4096)
    specs = [ParamSpec("w", (600, 400)), ParamSpec("norm", (7000,))]
    split_tile = Tile("t", Layout.of(specs), torch.float32, torch.bfloat16, pinned=False, grad=False, split=True)
    whole = Tile("t", Layout.of(specs), torch.float32, torch.float32, pinned=False, grad=False)
    assert split_tile.storage is Storage.SPLIT and whole.storage is not Storage.SPLIT
    n = whole.layout.numel
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen) * 0.02
    start[::97] = as_float((bits(start[::97]) & ~0xFFFF) | 0x8000)  # some start exactly halfway
    for tile in (split_tile, whole):
        tile.reset()
        tile.write_master(start)
    flagged = [int((split_tile.exp_avg_sq.view(torch.int32) < 0).sum())]  # the halfway starts rounded down
    assert flagged[0] > 100
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    for step in range(1, 5):
        grad = torch.randn(n, generator=gen) * 1e-2
        for lo, hi in ((0, 25_000), (25_000, 241_111), (241_111, n)):
            for tile in (split_tile, whole):
                adamw.adamw(tile, lo, hi, grad[lo:hi].clone(), adamw.Update(step, 1e-3, cfg), 1.0,
                            compiled=compiled and tile.storage is Storage.SPLIT)
        flagged.append(int((split_tile.exp_avg_sq.view(torch.int32) < 0).sum()))
        with split_tile.plain_state() as state:
            for k in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(bits(state[k]), bits(getattr(whole, k))), (step, k)
        assert torch.equal(split_tile.shadow, whole.master.to(torch.bfloat16))
        assert torch.equal(bits(split_tile.read_master()), bits(whole.master))
    assert sum(flagged[1:]) > 0, flagged  # updates landed halfway too


def digest(trainer) -> str:
    """Every master and moment of a run (exp_avg_sq by magnitude: the split's flags aside), and what
    each host tile's load streams in bf16 (a split tile's shadow, a whole master as the load casts
    it: the bits the 14-byte store's shadows held)."""
    h = hashlib.sha256()
    for tile in trainer.store.tiles:
        for name, view in zip(trainer.shape.hf_names(tile.name), tile.master_views()):
            h.update(name.encode())
            h.update(view.float().contiguous().numpy().tobytes())
        h.update(tile.exp_avg.numpy().tobytes())
        h.update(tile.exp_avg_sq.abs().numpy().tobytes())
        if not tile.on_device:
            h.update(tile.source.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def bf16_run(overrides: list[str]) -> dict:
    """The tiny bf16 run with `overrides`, in this process (the pinned child's)."""
    pinned_numerics.check()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # float reductions depend on the thread count
    trainer = Trainer(load_config(ROOT / "configs" / "tiny-cpu.yaml",
                                  ["engine.device=cpu", "engine.compute_dtype=bfloat16", *overrides]))
    try:
        losses = [trainer.train_step(trainer.next_microbatches())["loss"] for _ in range(trainer.total_steps)]
        trainer.optimizer.flush()
        return {"losses": losses, "sha256": digest(trainer)}
    finally:
        trainer.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pinned_runs() -> dict[tuple[str, str], dict]:
    """Every (run, split) of the test below, one after the other in one pinned child: one Python's
    start and imports instead of four. Each run sets its threads and builds its trainer from its seed,
    so a run's bits do not depend on the runs before it in the process (the recorded ones were made
    one process each: a leak from one run into the next fails the comparison)."""
    recorded = json.loads(GOLDEN.read_text())
    pinned_numerics.skip_unless_recorded_torch(recorded)
    cases = [(run, split) for run in recorded["runs"] for split in ("true", "false")]
    runs = [[*recorded["runs"][run]["overrides"], f"engine.split_masters={split}"] for run, split in cases]
    return dict(zip(cases, pinned_numerics.run(Path(__file__), "--runs", json.dumps(runs))))


@pytest.mark.parametrize("split", ["true", "false"])
@pytest.mark.parametrize("run", ["no-clipping", "clipping-device-tiles"])
def test_bf16_training_is_the_recorded_runs(pinned_runs, run, split):
    """The tiny run with bf16 compute on the CPU, float32 masters split on the host or whole (cast
    as a load casts them): the losses, masters, moments and bf16 weights recorded with the 14-byte
    store (a whole master beside its bf16 shadow), to the bit."""
    golden = json.loads(GOLDEN.read_text())["runs"][run]
    got = pinned_runs[run, split]
    assert got["losses"] == golden["losses"] and got["sha256"] == golden["sha256"]


if __name__ == "__main__":  # the pinned child of the test; --write: record each run with whole masters
    if sys.argv[1:] == ["--write"]:
        golden = json.loads(GOLDEN.read_text())
        for run in golden["runs"].values():
            run.update(pinned_numerics.run(Path(__file__), *run["overrides"], "engine.split_masters=false"))
        golden.update(torch=torch.__version__, pins=pinned_numerics.PINS)
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    elif sys.argv[1:2] == ["--runs"]:  # several runs, each a list of overrides, in this one pinned process
        print(json.dumps([bf16_run(overrides) for overrides in json.loads(sys.argv[2])]))
    else:
        print(json.dumps(bf16_run(sys.argv[1:])))
