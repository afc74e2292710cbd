"""From files to tokenised examples held unpadded in compact arrays.

Rows load through `datasets` (a file, a folder of shards of one type, a `save_to_disk` folder, a
dataset repository's folder, or a Hub dataset id: megatrain/hub.py) and are tokenised by
`datasets.map`: batched, in `data.num_proc` processes, into datasets' on-disk cache under a fingerprint of the rows, the format settings, the tokenizer and this code's
version, so the next run with the same data and tokenizer reads the cache instead of tokenising.
The examples then become three flat arrays: every token id (uint16 when the vocabulary allows,
else int32), a target flag per token (bool), and each example's start and length: about 3-5 bytes a
token, where padding every example to seq_len as int64 took 16 bytes a position. `Examples.nbytes`
is what the memory plan counts for the data. `Examples.dropped` counts the examples left out, by
reason: `unmaskable` (with data.unmaskable: drop), `overlong` (with data.overlong: drop),
`no_target` (nothing to learn: a chat without an assistant message) and `cut_off` (its targets
all past seq_len); `Examples.truncated` counts those kept but cut to seq_len; the start-up summary
prints them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrain import hub
from megatrain.config import DataConfig
from megatrain.data import formats

LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
VERSION = "megatrain-data-5"  # part of the cache key: change it when an encoding changes
PARALLEL_ROWS = 20_000  # below this many rows one process tokenises faster than several start


@dataclass
class Examples:
    """Tokenised examples: example k is tokens[starts[k]: starts[k] + lengths[k]] with its targets."""
    tokens: np.ndarray  # [T] uint16 or int32
    targets: np.ndarray  # [T] bool: the loss learns this token
    starts: np.ndarray  # [N] int64
    lengths: np.ndarray  # [N] int32
    dropped: dict[str, int]  # examples left out, by reason
    truncated: int = 0  # examples kept but cut to seq_len (data.overlong: truncate)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens, self.targets, self.starts, self.lengths))

    def subset(self, index: np.ndarray) -> Examples:
        """Some of the examples, sharing the token arrays."""
        return Examples(self.tokens, self.targets, self.starts[index], self.lengths[index], self.dropped, self.truncated)


def load_rows(path: str | Path, setting: str = "data.path", subset: str | None = None, split: str | None = None):
    """A `datasets.Dataset` of the raw rows of `path` (the value of `setting`): its `split` (None:
    train, or the only split there is) and, for a Hub dataset or a repository folder, its `subset`."""
    import datasets
    if hub.is_hub_id(str(path)):
        return hub.load_dataset(setting, str(path), subset, split or "train")
    path = Path(path)
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split is not None and split not in ds:
                raise ValueError(f"{setting} {path} has no split {split!r}; it holds {sorted(ds)}")
            if split is None and "train" not in ds and len(ds) != 1:
                raise ValueError(f"{setting} {path} holds the splits {sorted(ds)}; name one with data.split")
            ds = ds[split or ("train" if "train" in ds else next(iter(ds)))]
        elif split is not None:
            raise ValueError(f"{setting} {path} is one dataset without splits (split {split!r} asked for)")
        return ds
    if _repository(path):
        return hub.load_folder(setting, str(path), subset, split or "train")
    if split is not None or subset is not None:
        raise ValueError(f"{setting} {path} is data files, without the subsets and splits of a Hub dataset, a "
                         f"dataset repository's folder or a save_to_disk folder (data.subset, data.split, data.eval_split)")
    files = _files(path)
    kinds = {LOADERS.get(p.suffix) for p in files}
    if not files or None in kinds:
        raise ValueError(f"{setting} {path}: no data files; use {sorted(LOADERS)} files, a folder of them, "
                         "a save_to_disk folder or a Hub dataset id")
    if len(kinds) > 1:
        raise ValueError(f"{setting} {path} mixes file types {sorted(p.suffix for p in files)}; keep one")
    empty = [str(p) for p in files if p.stat().st_size == 0]
    if empty:
        raise ValueError(f"data: {', '.join(empty)} is empty")
    kind = kinds.pop()
    try:
        return datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train")
    except Exception as e:  # datasets wraps the parser's error: name the file and, for JSON lines, the line
        raise ValueError(f"data: cannot read {_first_bad(files, kind) or path}: {type(e).__name__}: {e}") from None


def _repository(path: Path) -> bool:
    """Whether `path` is laid out as a dataset repository (a clone, or a Hub snapshot): a dataset
    card (README.md with a YAML header, which may name subsets and splits) or a `data` folder, the
    layouts datasets reads splits from; else a folder is its data files, all one split."""
    card = path / "README.md"
    return path.is_dir() and ((path / "data").is_dir() or card.is_file() and card.read_text(errors="replace").startswith("---"))


def _first_bad(files: list[Path], kind: str) -> str | None:
    """`file:line` of the first line of a JSON-lines file that is not JSON, if there is one."""
    if kind != "json":
        return None
    for file in files:
        if file.suffix != ".jsonl":
            continue
        with open(file, errors="replace") as f:
            for number, line in enumerate(f, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{file} line {number} ({e.msg})"
    return None


def tokenize(rows, cfg: DataConfig, tok, path: str):
    """`rows` (read from `path`) mapped to input_ids, targets and problem, or read from the cache
    of an earlier run."""
    import datasets
    from datasets.fingerprint import Hasher
    needed = formats.columns(cfg)
    missing = [c for c in needed if c not in rows.column_names]
    if missing:
        raise ValueError(f"data: {path} lacks column(s) {missing} needed by format {cfg.format!r}; "
                         f"it has {rows.column_names}")
    if len(rows) == 0:
        raise ValueError(f"data: {path} holds no examples")
    if cfg.format == "text":
        _check_text(rows, cfg.text_field, path)
    optional = {"chat": [cfg.tools_field], "alpaca": list(formats.ALPACA_CONTEXT),
                "sharegpt": list(formats.SHAREGPT_CONTEXT)}.get(cfg.format, [])
    needed = [*needed, *(c for c in optional if c in rows.column_names)]  # read where the data has them
    settings = {k: getattr(cfg, k) for k in ("format", "text_field", "prompt_field", "response_field",
                                             "messages_field", "tools_field", "template", "separator", "targets")}
    key = Hasher.hash([VERSION, rows._fingerprint, settings, tok.backend_tokenizer.to_str(), tok.chat_template,
                       tok.bos_token, tok.eos_token])
    num_proc = cfg.num_proc or (min(os.cpu_count() or 1, 16) if len(rows) >= PARALLEL_ROWS else None)
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "targets": datasets.List(datasets.Value("bool")),
                                  "problem": datasets.Value("string"), "row": datasets.Value("int64")})
    try:
        return rows.select_columns(needed).map(
            _encode, fn_kwargs={"cfg": cfg, "tok": tok}, with_indices=True, batched=True, batch_size=1000,
            num_proc=num_proc, remove_columns=needed, features=features, new_fingerprint=key, desc="tokenising")
    except UnicodeDecodeError as e:  # Arrow keeps the bytes as read; they fail once decoded, unnamed
        where = _first_undecodable(_files(path)) or f"{path} ({e})"
        raise ValueError(f"data: {where} is not UTF-8 text: save it as UTF-8 (iconv -t utf-8)") from None


def _encode(rows: dict[str, list], indices: list[int], cfg: DataConfig, tok) -> dict[str, list]:
    return formats.encode(rows, cfg, tok, indices)  # datasets passes the indices second


def _files(path: str | Path) -> list[Path]:
    """The data files at `path` in the order load_rows reads them (none for a save_to_disk folder)."""
    path = Path(path)
    return sorted(p for p in path.iterdir() if p.suffix in LOADERS) if path.is_dir() else [path]


def _first_undecodable(files: list[Path]) -> str | None:
    """`file line N (byte B)` of the first line of `files` that is not UTF-8, if there is one."""
    for file in files:
        if not file.is_file():
            continue
        with open(file, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"{file} line {number} (byte {e.start + 1} of the line)"
    return None


def _check_text(rows, field: str, path: str) -> None:
    """Every row's `field` is a string (the text format tokenises it as one): the first that is not
    is named by its file and line (JSON lines) or row, where the tokenizer's own error names none."""
    import datasets
    if rows.features[field] == datasets.Value("string"):
        return
    for k, value in enumerate(rows[field]):
        if not isinstance(value, str):
            raise ValueError(f"data: {_place(path, k)}: {field} is {value!r}, not a string (the text format's "
                             f"data.text_field)")


def _place(path: str, index: int) -> str:
    """Where row `index` (0-based, across the files in order) stands: `file line N` in JSON lines
    files (blank lines are no rows), else `path row N`."""
    files = _files(path)
    if files and all(f.suffix == ".jsonl" and f.is_file() for f in files):
        for file in files:
            with open(file, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        if index == 0:
                            return f"{file} line {number}"
                        index -= 1
    return f"{path} row {index + 1}"


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """A list column of an Arrow table as its values and per-row offsets [N+1]."""
    import pyarrow as pa
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]: offsets[-1]], offsets - offsets[0]


def examples(encoded, cfg: DataConfig, vocab: int, path: str) -> Examples:
    """The tokenised dataset (of `path`) as compact arrays, after the format's rules for what to keep."""
    table = encoded.data.table if hasattr(encoded.data, "table") else encoded.data
    tokens, offsets = _flat(table.column("input_ids"))
    targets, _ = _flat(table.column("targets"))
    if tokens.size and int(tokens.max()) >= vocab:
        raise ValueError(f"data: token id {int(tokens.max())} is outside the model's vocabulary of {vocab}")
    tokens = tokens.astype(np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32)
    targets = targets.astype(bool)
    n = cfg.seq_len
    if cfg.format == "text":  # one stream of documents, cut into full sequences of seq_len
        count = len(tokens) // n
        if count == 0:
            raise ValueError(f"data: {path} yields no sequence of {n} tokens")
        return Examples(tokens, targets, np.arange(count, dtype=np.int64) * n, np.full(count, n, np.int32), {})
    starts, lengths = offsets[:-1], np.diff(offsets).astype(np.int32)
    problems = np.asarray(table.column("problem").to_numpy(zero_copy_only=False), dtype=object)
    bad = np.flatnonzero(problems != "")
    if len(bad) and cfg.unmaskable == "error":
        row = table.column("row").to_numpy()
        shown = "; ".join(f"example {row[k]}: {problems[k]}" for k in bad[:5])
        raise ValueError(f"data: {len(bad)} example(s) of {path} cannot be labelled exactly ({shown}); "
                         "fix them, or set data.unmaskable: drop to leave them out")
    keep = problems == ""
    dropped = {"unmaskable": int(len(bad))}
    too_long = lengths > n
    if cfg.overlong == "drop":
        dropped["overlong"] = int((too_long & keep).sum())
        keep &= ~too_long
    # targets each example has, whole and cut to seq_len (its first token is never predicted): a
    # running count in int32 (no dataset here has 2^31 tokens a file; int64 would double this temporary)
    running = np.concatenate([[0], np.cumsum(targets, dtype=np.int64 if len(targets) >= 2**31 else np.int32)])

    def learned(length: np.ndarray) -> np.ndarray:
        return running[starts + length] - running[np.minimum(starts + 1, starts + length)]
    whole = learned(lengths) > 0
    lengths = np.minimum(lengths, n).astype(np.int32)
    cut = learned(lengths) > 0
    dropped["no_target"] = int((~whole & keep).sum())  # nothing to learn: no assistant message, an empty reply
    dropped["cut_off"] = int((whole & ~cut & keep).sum())  # its targets all past seq_len
    keep &= cut
    truncated = int((too_long & keep).sum())
    if not keep.any():
        why = {"unmaskable": "cannot be labelled exactly",
               "overlong": "are longer than data.seq_len (data.overlong: drop)",
               "no_target": "have nothing to learn (a chat without an assistant message, an empty response)",
               "cut_off": f"have their targets only past data.seq_len {n} (raise it)"}
        raise ValueError(f"data: no example of {path} is left to learn from: "
                         + "; ".join(f"{count} {why[k]}" for k, count in dropped.items() if count))
    return Examples(tokens, targets, starts[keep], lengths[keep], dropped, truncated)


def concat(parts: list[Examples]) -> Examples:
    """The examples of several datasets as one (their tokens copied once into one array)."""
    tokens = np.concatenate([p.tokens for p in parts])
    offsets = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
    dropped: dict[str, int] = {}
    for p in parts:
        for k, v in p.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
    return Examples(tokens, np.concatenate([p.targets for p in parts]),
                    np.concatenate([p.starts + o for p, o in zip(parts, offsets)]),
                    np.concatenate([p.lengths for p in parts]), dropped, sum(p.truncated for p in parts))


def mix(parts: list[Examples], weights: list[float], stopping: str, seed: int) -> Examples:
    """Examples drawn from `parts` in proportion to `weights` (data.mix): dataset i gives p_i N of
    the N examples, N as large as no dataset runs out (first_exhausted) or as small as every
    example is used (all_exhausted), as `datasets.interleave_datasets` stops. An example taken
    more than once is referenced again, never copied.

    Mixed here, after each dataset is tokenised alone, rather than by interleave_datasets on the
    rows: that needs one schema across the datasets (their message structs differ), and a change
    of weights would tokenise everything again."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    sizes = np.asarray([len(p) for p in parts], dtype=np.float64)
    total = (sizes / share).min() if stopping == "first_exhausted" else (sizes / share).max()
    rng = np.random.default_rng(seed)
    whole = concat(parts)
    first = np.cumsum([0] + [len(p) for p in parts[:-1]])
    chosen = []
    for p, n, begin in zip(parts, np.rint(share * total).astype(np.int64), first):
        n = min(n, len(p)) if stopping == "first_exhausted" else max(n, len(p))  # rounding aside
        rest = rng.choice(len(p), n % len(p), replace=False)  # no dataset is empty (examples() refuses one)
        chosen.append(begin + np.concatenate([np.tile(np.arange(len(p)), n // len(p)), np.sort(rest)]))
    return whole.subset(np.concatenate(chosen))
