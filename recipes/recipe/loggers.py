"""``trainer.loggers``: where a run's metrics go. CSV and TensorBoard in the run folder (on by
default), and the trackers teams watch, Weights & Biases and MLflow, each with its own options
(their clients are the optional extras ``wandb`` and ``mlflow``). What is logged and how a
tracker that fails is kept away from training: ``yamlformer.recipes.training.trackers``."""

from __future__ import annotations

from pydantic import Field

from yamlformer.recipes.fields import _Section


class _Tracker(_Section):
    """What W&B and MLflow both take."""

    name: str | None = Field(None, description="The tracked run's name (null: the recipe's name).")
    tags: dict[str, str] = Field(
        default_factory=dict, description="Tags on the tracked run (W&B takes their keys and values as its tags)."
    )
    log_model: bool = Field(
        False, description="Upload the run's last and best checkpoints to the tracker at the end (off: none leaves)."
    )


class WandbSection(_Tracker):
    project: str | None = Field(None, description="The W&B project (null: the recipe's name).")
    entity: str | None = Field(None, description="The W&B team or user (null: the logged-in user's default).")
    offline: bool = Field(
        False,
        description="Write the run to <output_dir>/wandb only (no network); `wandb sync` uploads it later.",
    )


class MlflowSection(_Tracker):
    tracking_uri: str | None = Field(
        None,
        description="The MLflow tracking server (http://host:5000) or store (file:/path, sqlite:///path); null: "
        "MLFLOW_TRACKING_URI, else <output_dir>/mlruns.",
    )
    experiment: str | None = Field(None, description="The MLflow experiment (null: the recipe's name).")


class LoggersSection(_Section):
    csv: bool = Field(True, description="logs/version_N/metrics.csv (builder report reads it).")
    tensorboard: bool = Field(True, description="tensorboard/version_N event files.")
    wandb: WandbSection | None = Field(None, description="Weights & Biases (pip install 'yamlformer[wandb]').")
    mlflow: MlflowSection | None = Field(None, description="MLflow (pip install 'yamlformer[mlflow]').")
