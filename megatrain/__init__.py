"""MegaTrain: host-authoritative, layer-streaming training of Hugging Face causal LMs on one GPU."""
from megatrain.lifetime import end_with_launcher

# first, before torch's seconds of imports: a rank of torchrun's ends with its agent, however that
# ends, from the instant the kernel is told; an agent killed before it would leave an orphan
end_with_launcher()

from megatrain.config import TrainConfig, load_config  # noqa: E402

__all__ = ["Batch", "TrainConfig", "Trainer", "load_config"]


def __getattr__(name: str):
    # imported lazily: a script that writes a JSON (megatrain.io) or reads a config needs no torch
    if name == "Batch":
        from megatrain.batch import Batch
        return Batch
    if name == "Trainer":  # it pulls in transformers
        from megatrain.trainer import Trainer
        return Trainer
    raise AttributeError(name)
