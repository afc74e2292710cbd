"""The table of a folder of results: `python -m suite table DIR [DIR ...]`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megatrain.units import GiB
from suite.timing import relative_noise

COLUMNS = (f"{'point':34} {'system':13} {'status':11} {'batch':>6} {'step s':>7} {'+-%':>5} {'steps':>5} {'TFLOP/s':>8} {'ratio':>6} "
           f"{'busy':>5} {'opt exp':>7} {'idle un':>7} {'issuing':>7} {'dev GiB':>7} {'host GiB':>8} {'B/param':>7} "
           f"{'setup s':>7} {'wall s':>6}")  # set-up and the whole point's wall: what packs a GPU call


def rows(folders: list[str | Path]) -> list[tuple[str, dict]]:
    """Each folder's results, by name; a file that is not one is named on stderr and left out."""
    found = []
    for folder in folders:
        for f in sorted(Path(folder).glob("*.json")):
            try:
                r = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                print(f"{f}: skipped, unreadable ({e})", file=sys.stderr)
                continue
            if isinstance(r, dict) and "spec" in r and "status" in r:
                found.append((f.stem, r))
    return found


def _number(values: dict, key: str, width: int, places: int) -> str:
    """A measured value, or '-' where the run did not record it (a run before the metric existed)."""
    v = values.get(key)
    return f"{v:{width}.{places}f}" if v is not None else f"{'-':>{width}}"


def line(name: str, r: dict) -> str:
    spec, med, peak = r["spec"], r.get("median", {}), r.get("peak", {})
    exposed = med.get("exposed") or {}
    host, params = peak.get("host_rss_bytes"), r.get("params")
    batch = f"{spec['batch_size']}x{spec['grad_accum']}"
    noise = relative_noise(r) if r.get("steps") else None
    timing = r.get("timing") or {}
    steps = f"{timing['measured_steps']}{'' if timing.get('steady', True) else '!'}" if timing else "-"
    return (f"{name:34} {r['system']:13} {r['status']:11} {batch:>6} {med.get('step_time_s') or 0:7.2f} "
            f"{f'{100 * noise:5.1f}' if noise is not None else '    -'} {steps:>5} "
            f"{med.get('model_tflops') or 0:8.1f} {r.get('ratio_to_ceiling') or 0:6.3f} "
            f"{_number(exposed, 'gpu_busy_frac', 5, 2)} {_number(exposed, 'optimizer_exposed_s', 7, 3)} "
            f"{_number(exposed, 'idle_unattributed_s', 7, 3)} {_number(exposed, 'idle_while_issuing_s', 7, 3)} "
            f"{(peak.get('device_allocated_bytes') or 0) / GiB:7.1f} {(host or 0) / GiB:8.1f} "
            f"{host / params if host and params else 0:7.2f} {_number(r, 'setup_s', 7, 0)} {_number(r, 'wall_s', 6, 0)}")


def main(folders: list[str]) -> int:
    """The table; `+-%` is the half-width of the median step's interval over the median (suite/timing.py),
    `steps` the measured steps after the warm-up, `!` where their last window never steadied."""
    print(COLUMNS)
    for name, r in rows(folders):
        print(line(name, r))
        if r["status"] != "ok":
            partial = f"(medians of the {r['partial_samples']} steps measured before it) " if "partial_samples" in r else ""
            print("    " + partial + (r.get("reason") or "")[:300].replace("\n", " "))
    return 0
