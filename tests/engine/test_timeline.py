"""The timeline (megatrain/timeline.py): the exposed-time breakdown and the trace of a step, a step that
holds only its own spans while the optimizer's thread ends spans across steps; the layer ceiling."""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from helpers import ROOT, random_batches
from megatrain.config import load_config
from megatrain.trainer import Trainer


def test_timeline_breakdown_and_trace(tmp_path):
    from megatrain import timeline as tl
    assert tl._union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert tl._complement([(1, 2), (3, 4)], 0, 5) == [(0, 1), (2, 3), (4, 5)]
    assert tl._intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    # compute busy (a gradient reduction at 2.9-3 among it) but for a wait on weights (1-1.2), a gap
    # with the host blocked on the optimizer for part of it (2-2.5, blocked 2.1-2.3) and the step's
    # tail (3-3.5): 0.8 s idle unattributed
    t = tl.Timeline(type("CPU", (), {"is_cuda": False})(), enabled=True)
    t.begin_step()
    for track, kind, start, end in ((tl.Track.COMPUTE, tl.Kind.FORWARD, 0.0, 1.0), (tl.Track.COMPUTE, tl.Kind.WAIT_WEIGHTS, 1.0, 1.2),
                                    (tl.Track.COMPUTE, tl.Kind.BACKWARD, 1.2, 2.0), (tl.Track.HOST, tl.Kind.WAIT_OPTIMIZER, 2.1, 2.3),
                                    (tl.Track.COMPUTE, tl.Kind.BACKWARD, 2.5, 2.9), (tl.Track.COMPUTE, tl.Kind.REDUCE, 2.9, 3.0),
                                    # the main thread issuing ops: one around the blocked wait, one in the tail
                                    (tl.Track.ISSUE, tl.Kind.ISSUE, 1.9, 2.4), (tl.Track.ISSUE, tl.Kind.ISSUE, 3.2, 3.3),
                                    # the optimizer's thread: one update across the step's end, one after it
                                    (tl.Track.OPTIMIZER, tl.Kind.UPDATE, 3.4, 3.7), (tl.Track.OPTIMIZER, tl.Kind.UPDATE, 3.6, 3.8)):
        t._add(track, kind, "", start, end)
    t._step_end = 3.5
    got = t.summary()
    assert got["optimizer_busy_s"] == pytest.approx(0.1)  # within the step only; none negative
    ran = [e["dur"] for e in t.chrome_trace()["traceEvents"] if e.get("cat") == "update"]
    assert ran == pytest.approx([0.3e6, 0.2e6])  # the trace shows both as they ran
    assert (got["wait_weights_s"], got["optimizer_exposed_s"]) == pytest.approx((0.2, 0.2))
    assert got["idle_unattributed_s"] == pytest.approx(0.8) and got["gpu_busy_s"] == pytest.approx(2.3)
    assert got["reduce_s"] == pytest.approx(0.1)  # the gradient's reduction among ranks: busy, and apart
    # idle and issuing, outside the wait: 2.0-2.1, 2.3-2.4 and 3.2-3.3
    assert got["idle_while_issuing_s"] == pytest.approx(0.3)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["steps=2", "data.grad_accum=2"])
    trainer = Trainer(cfg)
    try:
        for _ in range(2):
            m = trainer.train_step(trainer.next_microbatches())
        e = m["exposed"]
        assert 0 < e["gpu_busy_frac"] <= 1 and e["optimizer_busy_s"] > 0 and e["h2d_busy_s"] >= 0
        # each layer's passes, every micro-batch's: within the compute stream's busy time
        per_layer = {k: v for k, v in e.items() if k.startswith("layer_s.")}
        assert set(per_layer) == {f"layer_s.L{i}" for i in range(trainer.shape.num_layers)}
        assert min(per_layer.values()) > 0 and sum(per_layer.values()) <= e["gpu_busy_s"] + 1e-9
        trainer.write_trace(tmp_path / "trace.json")
    finally:
        trainer.close()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    layers = trainer.shape.num_layers
    assert {f"forward L{layers - 1}", "head", "recompute L0", "backward L0", "load layer.0"} <= names
    issued = {e["name"] for e in events if e.get("cat") == "issue"}  # every op, as the main thread issued it
    assert {"issue Embed", f"issue Forward L{layers - 1}", "issue Head", "issue Recompute L0", "issue Backward L0"} <= issued
    updates = {e["name"] for e in events if e.get("cat") == "update"}
    assert any(n.startswith("update layer.0 [") for n in updates)  # the optimizer's update of layer 0


def test_timeline_step_holds_only_its_own_spans():
    """The optimizer's thread ends spans all the time, across step boundaries: a span that ended
    before a step began (the last step's, let in late) or the part after it ended is not the step's,
    so the timeline's step is never longer than the step. A span timed against the wrong step's
    origin makes a 0.2 ms step as long as the 20 ms step before it, or longer."""
    from megatrain import timeline as tl
    t = tl.Timeline(type("CPU", (), {"is_cuda": False})(), enabled=True)
    t.begin_step()
    stop = threading.Event()

    def optimizer():
        while not stop.is_set():
            with t.host(tl.Track.OPTIMIZER, tl.Kind.UPDATE, "tile"):
                pass
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches everywhere, inside a span's recording too
    worker = threading.Thread(target=optimizer)
    worker.start()
    long = []
    try:
        for i in range(60):  # a long step, then a short one
            start = time.perf_counter()  # the wall holds the step whole
            t.begin_step()
            time.sleep(0.02 if i % 2 else 0.0)
            t.end_step()
            wall = time.perf_counter() - start
            if (got := t.summary()["step_s"]) > wall + 0.005:
                long.append((i, got, wall))
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)
    assert not long, long[:3]


def test_the_layer_ceiling_runs_before_and_after_steps(monkeypatch):
    """Engine.layer_ceiling (the suite's `ceiling` option, the layer-kernel probe) times one layer's
    forward, recompute and backward whether or not a step has run: it opens its own timeline step.
    With keep_attention, the recompute reuses the forward's attention once a repetition."""
    import megatrain.kept_attention as kept_attention
    reused = []
    forward = kept_attention._Reused.forward
    monkeypatch.setattr(kept_attention._Reused, "forward", staticmethod(lambda *a: reused.append(1) or forward(*a)))
    cfg = load_config(base={"model": {"preset": "tiny-qwen2"}, "engine": {"device": "cpu", "keep_attention_layers": 2},
                            "data": {"source": "synthetic", "seq_len": 16, "batch_size": 2}, "steps": 1})
    trainer = Trainer(cfg)
    try:
        before = trainer.engine.layer_ceiling(2, 16, reps=1)
        assert not reused
        trainer.train_step(random_batches(1, 1, 2, 16, trainer.shape.vocab, pad=False)[0])
        reused.clear()
        after = trainer.engine.layer_ceiling(2, 16, reps=1, keep_attention=True)
        assert len(reused) == 2  # the warm-up and the one repetition
    finally:
        trainer.close()
    for row in (before, after):
        assert row["seconds"] > 0 and row["model_tflops"] > 0 and row["tokens"] == 32


def test_the_ceiling_of_a_model_of_two_attention_kinds_is_taken_per_kind(monkeypatch):
    """Trainer.layer_ceiling: GPT-OSS alternates sliding-window and full layers; each kind's ceiling is
    taken on its first layer, and every layer is timed by its own kind's."""
    cfg = load_config(base={"model": {"preset": "tiny-gpt-oss"}, "engine": {"device": "cpu"},
                            "data": {"source": "synthetic", "seq_len": 16, "batch_size": 2}, "steps": 1})
    trainer = Trainer(cfg)
    taken = []
    ceiling = trainer.engine.layer_ceiling
    monkeypatch.setattr(trainer.engine, "layer_ceiling", lambda *a, **k: taken.append(k["index"]) or ceiling(*a, **k))
    try:
        row = trainer.layer_ceiling(reps=1)
    finally:
        trainer.close()
    kinds = [trainer.shape.layer_type(i) for i in range(trainer.shape.num_layers)]
    assert len(set(kinds)) == 2 and taken == [kinds.index(k) for k in dict.fromkeys(kinds)]
    assert set(row["by_layer_type"]) == set(kinds)
    assert row["seconds_by_layer"] == {f"L{i}": row["by_layer_type"][k]["seconds"] for i, k in enumerate(kinds)}
    assert row["seconds"] == sum(row["seconds_by_layer"].values()) / len(kinds) and row["model_tflops"] > 0
