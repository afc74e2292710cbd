"""Faults on a GPU machine (issue 74, item 9), each done to a real run and recorded as it behaved:

  kill9        `megatrain train` killed outright (SIGKILL to its process group) in the middle of a
               step after its first save: what is left behind (processes, /dev/shm files, device
               memory held, the inductor cache's locks), then the same command with resume=true
  device_full  another process takes the device's free memory while a run trains: the run's exit
               code and message, and whether output_dir/state still holds the last good save
  device_taken another process holds all but 256 MiB of the device before a run starts: the run's
               exit code and message (admission should refuse it, naming the device memory)
  truncated    a run's saved state with one file cut to half its size, then resumed: the exit code
               and the message (it should name the file)
  worker_kill  a harness point whose worker is killed by SIGKILL as the OOM killer would: the
               result's status and reason

    python experiments/probes/gpu_faults.py OUT_DIR [--preset qwen2.5-1.5b] [--steps 10] [--only kill9 ...]

OUT_DIR gets faults.json (one entry per fault) and each run's output. Nothing here is a test: the
behaviour found is what the log records, and what a test then holds where the CPU can show it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def gpu_used_mib() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


SEQ = 4096  # tokens a sequence (--seq)
STEPS = 10  # a killed or crowded run's steps, saved every 2 (--steps)


def train_args(preset: str, out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatrain.cli", "train", "--no-progress", f"model.preset={preset}",
            "data.source=synthetic", f"data.seq_len={SEQ}", "data.batch_size=4", f"steps={steps}",
            f"output_dir={out}", "save_every=2", *extra]


def run(args: list[str], log: Path, timeout: float = 300) -> dict:
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text()
    return {"rc": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "last_lines": text.strip().splitlines()[-4:], "traceback": "Traceback" in text}


def kill9(preset: str, out: Path) -> dict:
    before_shm, before_gpu = shm(), gpu_used_mib()
    log, start = out / "kill9_train.log", time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(train_args(preset, out / "kill9", STEPS), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    state = out / "kill9" / "state"
    deadline = time.time() + 400
    while not state.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(1.5)  # into the next step
    killed_at = time.time()
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(3)
    left = subprocess.run(["pgrep", "-f", str(out / "kill9")], capture_output=True, text=True).stdout.split()
    locks = [str(q) for q in Path("/tmp").glob("torchinductor_*/**/*.lock")]
    entry = {"saved_before_kill": state.exists(), "killed_after_start_s": round(killed_at - start, 1),
             "processes_left": left, "shm_added": sorted(shm() - before_shm), "gpu_used_mib_before": before_gpu,
             "gpu_used_mib_after": gpu_used_mib(), "inductor_locks": locks[:20]}
    entry["resume"] = run(train_args(preset, out / "kill9", STEPS, "resume=true"), out / "kill9_resume.log")
    return entry


def device_full(preset: str, out: Path) -> dict:
    """Another process takes what the device has free once the run has trained two steps."""
    log = out / "device_full_train.log"
    with open(log, "w") as f:
        p = subprocess.Popen(train_args(preset, out / "device_full", STEPS), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.time() + 400
    while p.poll() is None and time.time() < deadline and not (out / "device_full" / "state").exists():
        time.sleep(0.5)
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    took = hog.stdout.readline().strip()
    try:
        rc = p.wait(timeout=600)
    finally:
        hog.kill()
        hog.wait()
    text = log.read_text()
    state = out / "device_full" / "state"
    return {"hog": took, "rc": rc, "last_lines": text.strip().splitlines()[-4:], "traceback": "Traceback" in text,
            "state_left": sorted(q.name for q in state.iterdir()) if state.is_dir() else None}


HOG = ("import torch, time; free, _ = torch.cuda.mem_get_info();"
       "x = torch.empty(free - (256 << 20), dtype=torch.uint8, device='cuda');"
       "print('took', free >> 20, 'MiB', flush=True); time.sleep(600)")


def device_taken(preset: str, out: Path) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    try:
        took = hog.stdout.readline().strip()
        entry = run(train_args(preset, out / "device_taken", 2), out / "device_taken_train.log")
    finally:
        hog.kill()
        hog.wait()
    return {"hog": took, **entry, "output_left": sorted(q.name for q in (out / "device_taken").iterdir())
            if (out / "device_taken").is_dir() else None}


def truncated(preset: str, out: Path) -> dict:
    first = run(train_args(preset, out / "truncated", 2), out / "truncated_train.log")
    files = sorted((q for q in (out / "truncated" / "state").rglob("*") if q.is_file()), key=lambda q: -q.stat().st_size)
    if not files:
        return {"train": first, "cut": None}
    cut = files[0]
    size = cut.stat().st_size
    os.truncate(cut, size // 2)
    return {"train": first, "cut": f"{cut.relative_to(out)} {size} -> {size // 2} bytes",
            "resume": run(train_args(preset, out / "truncated", 4, "resume=true"), out / "truncated_resume.log")}


def worker_kill(preset: str, out: Path) -> dict:
    result = out / "worker_kill.json"
    p = subprocess.Popen([sys.executable, "-m", "suite", "run", "--system", "megatrain", "--preset", preset,
                          "--seq", str(SEQ), "--batch", "4", "--steps", "20", "--warmup", "1", "--out", str(result)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    log = result.with_suffix(".log")
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline and "step" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.5)
    worker = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    for pid in worker:
        os.kill(int(pid), signal.SIGKILL)
    rc = p.wait(timeout=300)
    r = json.loads(result.read_text()) if result.exists() else {}
    return {"killed": worker, "rc": rc, "status": r.get("status"), "reason": r.get("reason")}


FAULTS = {"kill9": kill9, "device_full": device_full, "device_taken": device_taken, "truncated": truncated, "worker_kill": worker_kill}


def main() -> None:
    global SEQ, STEPS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--only", nargs="*", choices=list(FAULTS), default=list(FAULTS))
    a = ap.parse_args()
    SEQ, STEPS = a.seq, a.steps
    a.out.mkdir(parents=True, exist_ok=True)
    found = {}
    for name in a.only:
        try:
            found[name] = FAULTS[name](a.preset, a.out)
        except Exception as e:  # a fault that broke the probe itself is recorded, and the others still run
            found[name] = {"probe_error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(found[name])[:400], flush=True)
        (a.out / "faults.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
