"""Saving: a standard `transformers` checkpoint, and the full training state to resume from.

Both are written tile by tile into a temporary directory beside the target and renamed into
place at the end, so an interrupted save leaves the previous one intact and no half directory.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.exports import META
from megatrain.io import atomic_dir, complete_dir
from megatrain.progress import Advance, nothing
from megatrain.shapes import ModelShape
from megatrain.store import HostStore, Layout

SHARD_BYTES = 4 << 30


def save_pretrained(store: HostStore, shape: ModelShape, path: str | Path, dtype: torch.dtype = torch.float32,
                    tokenizer=None, advance: Advance = nothing, meta: dict | None = None) -> None:
    """Write config.json, generation_config.json, safetensors shards in `dtype` and the tokenizer
    (if given): a folder that `AutoModelForCausalLM.from_pretrained` loads and generates from;
    `meta`, if given, as exports.META beside them (which step, which evaluation).

    Shards are written as they fill, so at most one shard is held in host memory besides the store.
    """
    from transformers import GenerationConfig
    with atomic_dir(path) as tmp:
        config = copy.deepcopy(shape.config)  # the run's config stays as it is
        config.dtype = dtype
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if meta is not None:
            (tmp / META).write_text(json.dumps(meta, indent=1))
        files: list[tuple[Path, list[str]]] = []
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            file = tmp / f"shard-{len(files)}.safetensors"
            save_file(shard, file, metadata={"format": "pt"})
            files.append((file, list(shard)))
            shard.clear()

        def add(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
            nonlocal size, total
            nbytes = tensor.numel() * dtype.itemsize
            if shard and size + nbytes > SHARD_BYTES:
                flush()
                size = 0
            shard[name] = tensor.to("cpu", dtype).contiguous()
            size += nbytes
            total += nbytes

        for tile in store.tiles:
            for name, view in shape.checkpoint_tensors(tile.name, tile.master_views()):
                add(name, view, dtype)
                advance(view.numel())
        for name, buffer in store.named_buffers():  # float32 whatever `dtype`, as the library saves them
            add(name, buffer, torch.float32)
        flush()
        if len(files) == 1:
            os.replace(files[0][0], tmp / "model.safetensors")
            return
        weight_map = {}
        for k, (file, names) in enumerate(files):
            final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(file, tmp / final)
            weight_map.update({name: final for name in names})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


_STATE = ("master", "exp_avg", "exp_avg_sq")
BUFFERS = "buffers.safetensors"  # the layers' buffers (store.HostStore.buffers), where the model has any


def save_state(store: HostStore, path: str | Path, meta: dict, advance: Advance = nothing,
               keep_previous: bool = False) -> None:
    """Master weights and both moments of every tile, plus `meta` (step, data position, config).
    `keep_previous`: the state it replaces is kept until `io.drop_previous` or `io.roll_back`."""
    with atomic_dir(path, keep_previous) as tmp:
        for tile in store.tiles:
            with tile.plain_state() as state:
                save_file({k: state[k].cpu() for k in _STATE}, tmp / f"{tile.name}.safetensors")
            advance(tile.layout.params)
        if buffers := store.named_buffers():
            save_file({name: b.cpu() for name, b in buffers}, tmp / BUFFERS)
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))


def saved_state(path: str | Path) -> Path | None:
    """The last complete training state saved at `path` (complete_dir), or None."""
    path = complete_dir(path)
    return path if path is not None and (path / "state.json").is_file() else None


_META = ("step", "updates_done", "data_position", "config")


def check_state(shape: ModelShape, path: Path) -> dict:
    """The training state saved at `path` read without loading it: state.json whole, and every
    tile's file there with its moments and master at the tile's size (their headers only). A
    damaged, partial or other model's state is refused by name before anything is allocated.
    Returns the saved meta."""
    meta_file = path / "state.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"resume: {meta_file} is not readable JSON ({e}): the saved state is damaged") from None
    missing = [k for k in _META if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"resume: {meta_file} lacks {missing}: the saved state is damaged")
    for name, specs in shape.units():
        file, numel = path / f"{name}.safetensors", Layout.of(specs).numel
        if not file.is_file():
            raise ValueError(f"resume: {file} is missing: the saved state is incomplete")
        try:
            with safe_open(str(file), framework="pt") as f:
                found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # a truncated or garbage file: safetensors' own error type
            raise ValueError(f"resume: {file} is not a readable safetensors file ({e}): "
                             f"the saved state is damaged") from None
        if any(found.get(k) != (numel,) for k in _STATE):
            raise ValueError(f"resume: {file} holds {found}, where this model's {name} holds {_STATE} of ({numel},): "
                             f"a state of another model, or a damaged one")
    buffers = {n: b.shape for i in range(shape.num_layers)
               for n, b in zip(shape.buffer_names(i), shape.buffer_specs(i), strict=True)}
    if buffers:
        file = path / BUFFERS
        try:
            with safe_open(str(file), framework="pt") as f:
                found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # missing, truncated or garbage
            raise ValueError(f"resume: {file} is not a readable safetensors file ({e}): "
                             f"the saved state is damaged or incomplete") from None
        if found != buffers:
            raise ValueError(f"resume: {file} does not hold this model's layer buffers: a state of another model")
    return meta


def load_state(store: HostStore, path: str | Path, only: list | None = None, advance: Advance = nothing) -> dict:
    """The saved state into the store's tiles (`only`: into these; a shared store's other ranks
    read their device tiles alone), every tile's version bumped; returns the saved meta."""
    found = saved_state(path)
    if found is None:
        raise ValueError(f"resume: no training state at {path}")
    path = found
    for tile in store.tiles:
        if only is not None and tile not in only:
            tile.version += 1  # its shadow changed under the device buffers all the same
            continue
        with safe_open(str(path / f"{tile.name}.safetensors"), framework="pt") as f:
            # one tensor at a time; the moments first: a split tile's master write flags in exp_avg_sq
            for k in ("exp_avg", "exp_avg_sq", "master"):
                t = f.get_tensor(k)
                dtype = tile.master_dtype if k == "master" else torch.float32
                if tuple(t.shape) != (tile.layout.numel,) or t.dtype != dtype:
                    raise ValueError(f"resume: {tile.name}.{k} in {path} is {t.dtype}{tuple(t.shape)}, "
                                     f"this run has {dtype}{(tile.layout.numel,)}")
                if k == "master":
                    tile.write_master(t)
                else:
                    getattr(tile, k).copy_(t)
        tile.version += 1
        tile.ready.set()
        advance(tile.layout.params)
    if buffers := store.named_buffers():  # every rank's own
        with safe_open(str(path / BUFFERS), framework="pt") as f:
            for name, buffer in buffers:
                buffer.copy_(f.get_tensor(name))
    return json.loads((path / "state.json").read_text())
