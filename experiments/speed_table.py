"""Print the table of a folder of bench.py results: python3 experiments/speed_table.py DIR"""
import json
import sys
from pathlib import Path

GiB = 2 ** 30
print(f"{'point':32} {'status':8} {'step s':>7} {'TFLOP/s':>8} {'ceiling':>8} {'ratio':>6} {'busy':>6} "
      f"{'w_wts s':>7} {'opt exp s':>9} {'dev GiB':>8} {'host GiB':>8} {'B/param':>7}")
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    if f.name.endswith(".trace.json"):
        continue
    r = json.loads(f.read_text())
    med, peak, exp = r.get("median", {}), r.get("peak", {}), r.get("median", {}).get("exposed", {})
    ceil = r.get("ceiling", {}).get("model_tflops")
    params = r.get("params")
    host = peak.get("peak_host_bytes")
    print(f"{f.stem:32} {r['status']:8} {med.get('step_time_s') or 0:7.2f} {med.get('model_tflops') or 0:8.1f} "
          f"{ceil or 0:8.1f} {r.get('ratio_to_ceiling') or 0:6.3f} {exp.get('gpu_busy_frac') or 0:6.3f} "
          f"{exp.get('wait_weights_s') or 0:7.3f} {exp.get('optimizer_exposed_s') or 0:9.3f} "
          f"{(peak.get('peak_device_allocated_bytes') or 0) / GiB:8.1f} {(host or 0) / GiB:8.1f} "
          f"{(host / params) if host and params else 0:7.2f}")
    if r["status"] != "ok":
        print("   ", r.get("reason", "")[:300])
