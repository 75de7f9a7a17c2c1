"""The models ``tk`` trains and exports: a registry of built-ins plus any ``package.module:callable``."""

from tk.models.base import ModelEntry, ModelSpec, TrainingTask
from tk.models.registry import build_model, entries
from tk.models.user import UserModel

__all__ = ["ModelEntry", "ModelSpec", "TrainingTask", "UserModel", "build_model", "entries"]
