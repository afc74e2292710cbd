"""Atomic writes: a file or folder appears complete or not at all, whatever kills the writer; and
the check, before any work, that a folder can be written."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def check_writable(folder: str | Path, what: str) -> None:
    """Raise ValueError naming `what` unless `folder` exists or can be made, and a folder can be made
    in it: tried (made and removed) on its nearest existing parent, since the permission bits say
    nothing for root, a read-only mount or /proc. Nothing is left behind."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise ValueError(f"{what} {folder}: {existing} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatrain-probe-", dir=existing))
    except OSError as e:
        raise ValueError(f"{what} {folder}: {existing} cannot be written (a folder made there: {e.strerror})") from None


@contextmanager
def atomic_dir(target: str | Path):
    """Yield a temporary directory that replaces `target` only if the block completes. At every
    instant a complete copy exists: `target`, or (a kill between the swap's two renames) its
    `.old`, which `complete_dir` finds and the next save restores first."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    complete_dir(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = _old(target)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def complete_dir(target: str | Path) -> Path | None:
    """The last complete copy that atomic_dir saves left at `target`, put back in place: `target`
    itself, or its `.old` where a kill came between the two renames; None if there is none."""
    target = Path(target)
    old = _old(target)
    if old.exists():
        if target.exists():  # the kill came after the swap: the old copy is stale
            shutil.rmtree(old)
        else:
            os.replace(old, target)
    return target if target.exists() else None


def _old(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


@contextmanager
def atomic_file(path: str | Path):
    """Yield a temporary path beside `path`, with its suffix (so writers that infer a format from
    the name still do), that replaces `path` only if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str | Path, data) -> None:
    """Write JSON atomically (no half file, whatever kills the writer)."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))


def write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def save_figure(fig, *paths: str | Path, dpi: int = 150) -> None:
    """A matplotlib figure to each path atomically (the format from each path's suffix). A PDF carries
    no creation date, so that the same figure drawn again is the same file."""
    for path in paths:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=dpi, metadata={"CreationDate": None} if tmp.suffix == ".pdf" else None)
