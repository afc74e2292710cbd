"""Which of the host AdamW kernel's forms (megatrain/host_adamw.cpp, set_forms) give torch's fused
AdamW's numbers on this machine: the mismatches of each form per tensor (master, exp_avg,
exp_avg_sq) against torch's, for calls of whole vectors and calls shorter than one, at beta1 0.9
and 0.3. The kernel's load makes the same comparison and keeps the first form that matches
(fused_adamw.py); this prints all of them, for a machine where none does.

    python experiments/probes/adamw_forms.py
"""
import ctypes

import torch

from megatrain import fused_adamw

build = fused_adamw.build()
print("torch", torch.__version__, torch.backends.cpu.get_cpu_capability(), "vector width", fused_adamw.VECTOR,
      "form", build.form, "scalar tail", build.scalar_tail, "why not", build.why)
whole = ctypes.CDLL(str(build.path)).megatrain_adamw_whole  # loaded here too where the load refused it
whole.restype = None
whole.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_double] * 7 + [ctypes.c_int] * 3
gen = torch.Generator().manual_seed(0)
for name, n, forms in (("vector", 64 * fused_adamw.VECTOR, fused_adamw.VECTOR_FORMS),
                       ("scalar", fused_adamw.VECTOR - 1, fused_adamw.SCALAR_FORMS)):
    state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
             torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5]
    for beta1 in (0.9, 0.3):
        p, g, m, v = (t.clone() for t in state)
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.full((), 3.0)], lr=1e-3, beta1=beta1, beta2=0.999,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        want = [t.view(torch.int32) for t in (p, m, v)]
        for form in forms:
            p, g, m, v = (t.clone() for t in state)
            whole(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, n - n % fused_adamw.VECTOR, 3.0,
                  1e-3, beta1, 0.999, 0.1, 1e-8, 1.0, 0, 1, form)
            wrong = [int((t.view(torch.int32) != w).sum()) for t, w in zip((p, m, v), want)]
            print(f"{name} beta1 {beta1} form {form}: elements that differ (master, exp_avg, exp_avg_sq) {wrong} of {n}")
