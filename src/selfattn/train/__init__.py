"""Training transformers from scratch: character data, a model-agnostic loop, checkpoints, DDP.

``train_decoder`` is what ``selfattn train`` runs (a GPT, or with ``overrides={"arch":
"llama"}`` a Llama); ``load_checkpoint`` gives back a trained model, its tokenizer, configs
and training state (to resume); ``load_model`` gives the model alone as the viewers'
:class:`~selfattn.models.model.Model` (for ``generate``, ``explain``, ``serve``).
"""

from selfattn.train.checkpoint import (
    RunConfig,
    TrainingState,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from selfattn.train.data import CharTokenizer, RandomBatches, TextData
from selfattn.train.loop import TrainConfig, TrainResult, configure_optimizer, evaluate, train
from selfattn.train.presets import PRESETS, Preset, get_preset
from selfattn.train.run import TrainedRun, train_decoder

__all__ = [
    "PRESETS",
    "CharTokenizer",
    "Preset",
    "RandomBatches",
    "RunConfig",
    "TextData",
    "TrainConfig",
    "TrainResult",
    "TrainedRun",
    "TrainingState",
    "configure_optimizer",
    "evaluate",
    "get_preset",
    "load_checkpoint",
    "load_model",
    "save_checkpoint",
    "train",
    "train_decoder",
]
