"""MegaTrain: host-authoritative, layer-streaming training of Hugging Face causal LMs on one GPU."""
from megatrain.config import TrainConfig, load_config
from megatrain.batch import Batch

__all__ = ["Batch", "TrainConfig", "Trainer", "load_config"]


def __getattr__(name: str):
    if name == "Trainer":  # imported lazily: it pulls in transformers
        from megatrain.trainer import Trainer
        return Trainer
    raise AttributeError(name)
