"""DeepSpeed ZeRO-Infinity: ZeRO-3 with parameters and optimizer state swapped to NVMe through
DeepSpeed's async_io op, which needs libaio (baselines/libaio.sh provides it without root).
The shared machinery and the options are in deepspeed_zero."""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from megatrain.memory import DoesNotFit, Shortage
from suite.systems import Unsupported, hf
from suite.systems.deepspeed_zero import ZeroSystem, aio_problem, ds_config


def _existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


class System(ZeroSystem):
    NAME = "ZeRO-Infinity"
    # an upper bound, not a measurement: bf16 parameters 2, fp32 master and moments 12, fp32 gradients 4
    SWAP_BYTES_PER_PARAM = 18

    def build_config(self, spec) -> dict:
        self.owns_swap = "nvme_path" not in spec.options
        self.swap = spec.options.get("nvme_path") or os.path.join(tempfile.gettempdir(),
                                                                   f"megatrain-zero-infinity-{os.getpid()}")
        return ds_config(spec, "nvme", self.swap)

    def admit(self, spec) -> None:
        problem = aio_problem()
        if problem:
            raise Unsupported(f"{self.NAME}: DeepSpeed cannot build its async_io op: {problem} -- provide libaio with "
                              f"baselines/libaio.sh (fetch .libaio where apt works, carry .libaio, then "
                              f"eval \"$(baselines/libaio.sh env .libaio)\" before python starts)")
        need = hf.params(spec) * self.SWAP_BYTES_PER_PARAM
        free = shutil.disk_usage(_existing(self.swap)).free
        if need > free:
            raise DoesNotFit(self.NAME, [Shortage("disk", int(need), free, f"its swap at {self.swap}, "
                                                  f"{self.SWAP_BYTES_PER_PARAM} B/param")])
        os.makedirs(self.swap, exist_ok=True)
        # removed at close, or at exit when the construction fails after this point
        self._remove_swap = weakref.finalize(self, shutil.rmtree, self.swap, True) if self.owns_swap else None

    def info(self) -> dict:
        return {**super().info(), "offload": "nvme", "nvme_path": self.swap}

    def close(self) -> None:
        super().close()
        if self._remove_swap:
            self._remove_swap()
