"""Named model sizes and training settings, like nanoGPT's config files but typed and checked.

``shakespeare-char-cpu`` is nanoGPT's CPU configuration for shakespeare_char (the benchmark),
``shakespeare-char`` its GPU one, ``tiny`` a model that trains in seconds for tests and demos.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from selfattn.errors import SelfAttnError
from selfattn.models.gpt import GPTConfig
from selfattn.train.loop import TrainConfig

MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "dropout", "bias", "activation")


@dataclass(frozen=True)
class Preset:
    """A decoder's sizes (its vocabulary comes from the data) and how to train it."""

    name: str
    description: str
    n_layer: int
    n_head: int
    n_embd: int
    train: TrainConfig
    dropout: float = 0.0
    bias: bool = False
    activation: str = "gelu"

    def __post_init__(self) -> None:
        self.model_config(vocab_size=1)  # GPTConfig checks the sizes

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The decoder for a vocabulary of ``vocab_size``; positions = the training block size."""
        return GPTConfig(
            vocab_size=vocab_size,
            block_size=self.train.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            bias=self.bias,
            dropout=self.dropout,
            activation=self.activation,
        )

    def override(self, **changes: object) -> Preset:
        """A copy with some model fields and/or TrainConfig fields replaced (and re-validated)."""
        valid = (*MODEL_FIELDS, *(item.name for item in dataclasses.fields(TrainConfig)))
        unknown = [key for key in changes if key not in valid]
        if unknown:
            raise SelfAttnError(
                f"unknown training setting(s) {', '.join(map(repr, unknown))}; "
                f"valid overrides: {', '.join(valid)}"
            )
        model = {key: value for key, value in changes.items() if key in MODEL_FIELDS}
        train = {key: value for key, value in changes.items() if key not in MODEL_FIELDS}
        try:
            return dataclasses.replace(
                self, train=dataclasses.replace(self.train, **train), **model
            )
        except (TypeError, ValueError) as error:
            raise SelfAttnError(f"invalid training settings: {error}") from None

    @classmethod
    def from_configs(cls, name: str, model: GPTConfig, train: TrainConfig) -> Preset:
        """The preset a checkpoint was trained with, rebuilt from its saved configs."""
        sizes = {key: getattr(model, key) for key in MODEL_FIELDS}
        return cls(name=name, description="from a checkpoint", train=train, **sizes)


PRESETS = {
    preset.name: preset
    for preset in (
        Preset(
            name="shakespeare-char-cpu",
            description="nanoGPT's shakespeare_char on a CPU: 4 layers, 4 heads, 128 wide",
            n_layer=4,
            n_head=4,
            n_embd=128,
            train=TrainConfig(
                max_iters=2000,
                batch_size=12,
                block_size=64,
                learning_rate=1e-3,
                min_lr=1e-4,
                warmup_iters=100,
                lr_decay_iters=2000,
                weight_decay=0.1,
                beta2=0.99,
                eval_interval=250,
                eval_iters=20,
            ),
        ),
        Preset(
            name="shakespeare-char",
            description="nanoGPT's shakespeare_char on a GPU: 6 layers, 6 heads, 384 wide",
            n_layer=6,
            n_head=6,
            n_embd=384,
            dropout=0.2,
            train=TrainConfig(
                max_iters=5000,
                batch_size=64,
                block_size=256,
                learning_rate=1e-3,
                min_lr=1e-4,
                warmup_iters=100,
                lr_decay_iters=5000,
                weight_decay=0.1,
                beta2=0.99,
                eval_interval=250,
                eval_iters=200,
            ),
        ),
        Preset(
            name="tiny",
            description="2 layers, 2 heads, 32 wide: trains in seconds, for tests and demos",
            n_layer=2,
            n_head=2,
            n_embd=32,
            train=TrainConfig(
                max_iters=100,
                batch_size=8,
                block_size=16,
                learning_rate=3e-3,
                min_lr=3e-4,
                warmup_iters=10,
                lr_decay_iters=100,
                weight_decay=0.1,
                beta2=0.99,
                eval_interval=25,
                eval_iters=5,
                log_interval=5,
            ),
        ),
    )
}
DEFAULT_PRESET = "shakespeare-char-cpu"


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a one-line error listing the others."""
    if name not in PRESETS:
        raise SelfAttnError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
