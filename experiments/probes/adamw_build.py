"""Probe: where the compiled host AdamW's set-up time goes (`setup_s.optimizer_kernel` of a point,
35-55 s per point on the GPU hosts even with TORCHINDUCTOR_CACHE_DIR kept across points, against
2.3 s from the cache on the CPU machine). Run it twice in fresh processes with one cache:

    for i in 1 2; do TORCHINDUCTOR_CACHE_DIR=/tmp/ind CUDA=1 python -m experiments.probes.adamw_build; done

CUDA=1 first touches the GPU, as the trainer has by then. WRAPPER=0 builds the kernel without
`cpp_wrapper` (the engine's has it, to release the GIL: fused_adamw.py), to tell whether the C++
wrapper is what takes the time or misses the cache. Prints the seconds of inductor's check of the
CPU's vector instruction sets (on torch 2.11 on the CPU machine 13 of a 14 s build from the cache:
a compile and a Python that imports torch for each; the engine's way, every set's check at once,
kernel_build.check_vector_isas; ISA_CHECK=inductor: inductor's, one set after another), of the build
(fused_adamw.probe), of the timing (optim.rates) and inductor's FX graph cache counters (a hit: the
build was loaded, not compiled).
"""
import json
import os
import time

start = time.perf_counter()
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from megatrain import fused_adamw  # noqa: E402
from megatrain.config import OptimConfig  # noqa: E402
from megatrain.kernel_build import check_vector_isas  # noqa: E402
from megatrain.optim import rates  # noqa: E402

out = {"import_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
       "cpp_wrapper": os.environ.get("WRAPPER") != "0"}
if not out["cpp_wrapper"]:
    from megatrain.kernel_build import compiled
    fused_adamw._compiled = compiled(fused_adamw._update, **{"cpp.dynamic_threads": True})
if os.environ.get("CUDA") == "1" and torch.cuda.is_available():
    clock = time.perf_counter()
    torch.zeros(1, device="cuda")
    out["cuda_init_s"] = time.perf_counter() - clock
clock = time.perf_counter()  # inductor's check of the CPU's vector ISAs, once a process: on torch
vec_isa = getattr(torch._inductor, "cpu_vec_isa", None)  # 2.11 a build and a `python -c "import torch"` per ISA
if vec_isa is not None and hasattr(vec_isa, "valid_vec_isa_list"):
    out["vec_isa_check"] = os.environ.get("ISA_CHECK", "engine")
    if out["vec_isa_check"] == "engine":
        check_vector_isas()  # every set's check at once, as the trainer makes it
    out["vec_isas"] = [str(isa) for isa in vec_isa.valid_vec_isa_list()]
    out["vec_isa_check_s"] = time.perf_counter() - clock
clock = time.perf_counter()
out["probe_error"] = fused_adamw.probe(OptimConfig())
out["build_s"] = time.perf_counter() - clock
clock = time.perf_counter()
out["rates"] = rates(OptimConfig())
out["rates_s"] = time.perf_counter() - clock
out["inductor_counters"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))
