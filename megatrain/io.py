"""Atomic writes: a file or folder appears complete or not at all, whatever kills the writer; and
the check, before any work, that a folder can be written.

A write goes to a temporary beside its target, named `.<target>.<pid>@<host>.<random>`: a writer
killed outright (SIGKILL, the OOM killer) leaves it, as large as what it was writing, and the next
write beside that target (or `remove_stale`) removes it once its writer is gone; a live writer's,
and another host's (a shared file system), are left alone."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
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
def atomic_dir(target: str | Path, keep_previous: bool = False):
    """Yield a temporary directory that replaces `target` only if the block completes. At every
    instant a complete copy exists: `target`, or (a kill between the swap's two renames) its
    `.old`, which `complete_dir` finds and the next save restores first. `keep_previous`: the
    replaced copy is kept as `.<target>.previous` (one, the last), for `roll_back`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    complete_dir(target)
    remove_stale(target.parent, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = _old(target)
            os.replace(target, old)
            os.replace(tmp, target)
            if keep_previous:
                if previous(target).exists():
                    shutil.rmtree(previous(target))
                os.replace(old, previous(target))
            else:
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
    if not target.exists() and previous(target).exists():  # a roll_back cut short
        os.replace(previous(target), target)
    return target if target.exists() else None


def previous(target: str | Path) -> Path:
    """Where atomic_dir(keep_previous=True) keeps the copy it replaced."""
    target = Path(target)
    return target.with_name(f".{target.name}.previous")


def drop_previous(target: str | Path) -> None:
    """The copy kept by atomic_dir(keep_previous=True) is no longer needed: remove it."""
    if previous(target).exists():
        shutil.rmtree(previous(target))


def roll_back(target: str | Path) -> None:
    """Replace `target` by the copy its last atomic_dir(keep_previous=True) replaced, or remove it
    where there was none. A kill at any point leaves that copy (complete_dir puts it back) or none:
    the copy rolled back from is first renamed to a temporary's name, which remove_stale removes."""
    target = Path(target)
    if not target.exists():
        return
    if previous(target).exists():
        doomed = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
        os.replace(target, doomed)  # an empty folder: replaced
        os.replace(previous(target), target)
        shutil.rmtree(doomed)
    else:
        remove_dir(target)


def remove_dir(target: str | Path) -> None:
    """Remove a folder so that no part of it is left under its name, whatever kills the remover:
    renamed first to a temporary's name (which remove_stale removes), then removed."""
    target = Path(target)
    doomed = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    os.replace(target, doomed)  # an empty folder: replaced
    shutil.rmtree(doomed)


def _old(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _host() -> str:
    """This host's name as a temporary's name carries it: letters, digits and dashes only."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.{os.getpid()}@{_host()}."


# `.<target>.<pid>@<host>.<tempfile's 8 characters>[.suffix]`: atomic_dir's and atomic_file's
_TEMP = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)\.[a-z0-9_]{8}(?:\.[A-Za-z0-9]+)?")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(folder: str | Path, target: str | None = None) -> list[Path]:
    """Remove the temporaries in `folder` (of `target` only, if given) whose writer, a process of
    this host, is gone: what a kill during a write left. Returns what was removed."""
    folder, removed = Path(folder), []
    if not folder.is_dir():
        return removed
    host = _host()
    for path in folder.iterdir():
        m = _TEMP.fullmatch(path.name)
        if (m is None or m["host"] != host or (target is not None and m["target"] != target)
                or int(m["pid"]) == os.getpid() or _alive(int(m["pid"]))):
            continue
        try:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        except FileNotFoundError:  # removed meanwhile by another run's clean-up
            continue
        removed.append(path)
    return removed


@contextmanager
def atomic_file(path: str | Path):
    """Yield a temporary path beside `path`, with its suffix (so writers that infer a format from
    the name still do), that replaces `path` only if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.with_suffix("")), suffix=path.suffix, dir=path.parent)
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
