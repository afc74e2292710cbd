"""DeepSpeed ZeRO-3 Offload: parameters and optimizer state in pinned host memory, CPU Adam
(the shared machinery and the options are in deepspeed_zero)."""
from __future__ import annotations

from suite.systems import hf
from suite.systems.deepspeed_zero import ZeroSystem, ds_config


class System(ZeroSystem):
    NAME = "ZeRO-3 Offload"
    # host RSS (fp32 master, moments and gradients, bf16 parameters, pinned buffers) measured on the
    # H100 machine: 25.9 B/param at the 3B shape, 27.7 and 29.2 at the 7B width on 7 and 14 layers
    # (results/h100/points/depth); admission takes the largest
    HOST_BYTES_PER_PARAM = 29

    def build_config(self, spec) -> dict:
        return ds_config(spec, "cpu")

    def admit(self, spec) -> None:
        hf.require_host(spec, self.HOST_BYTES_PER_PARAM, self.NAME)

    def info(self) -> dict:
        return {**super().info(), "offload": "cpu"}
