"""The experiment trackers a run reports to besides metrics.jsonl (report_to): TensorBoard, Weights
& Biases and MLflow, each through its own package (an optional extra: pip install
'megatrain[wandb]'), imported only when named; the run's settings checked that it is there
(config.py). Each takes a step's scalars under `train/` or `eval/` names."""
from __future__ import annotations

import os
from pathlib import Path


class TensorBoard:
    def __init__(self, out: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """A run of the project WANDB_PROJECT (default megatrain), its files under output_dir/wandb;
    WANDB_MODE=offline keeps it on disk (`wandb sync` uploads it later)."""

    def __init__(self, out: Path, config: dict):
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "megatrain"), dir=str(out), config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """A run of the experiment MLFLOW_EXPERIMENT_NAME (else mlflow's default) at MLFLOW_TRACKING_URI
    (else ./mlruns), the run's settings as its parameters."""

    def __init__(self, out: Path, config: dict):
        import mlflow
        self.mlflow = mlflow
        if name := os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            mlflow.set_experiment(name)
        self.run = mlflow.start_run()
        # mlflow refuses a parameter value over 6000 characters (a long data.mix, say)
        mlflow.log_params({key: str(value)[:6000] for key, value in _flat(config).items()})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 1e-5}} -> {"optim.lr": 1e-5}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
