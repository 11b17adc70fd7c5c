"""Named model sizes and training settings, like nanoGPT's config files but typed and checked.

``shakespeare-char-cpu`` is nanoGPT's CPU configuration for shakespeare_char (the benchmark),
``shakespeare-char`` its GPU one, ``tiny`` a model that trains in seconds for tests and demos.
Each trains either architecture (``arch``): nanoGPT's GPT (learned positions, LayerNorm, GELU
MLP, tied head) or a Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from selfattn.errors import SettingsError, is_real
from selfattn.models.gpt import GPTConfig
from selfattn.models.llama import LlamaConfig, llama_hidden_size
from selfattn.train.loop import TrainConfig, setting, whole_number

ARCHITECTURES = ("gpt", "llama")
MODEL_FIELDS = ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "dropout", "bias", "activation")
LLAMA_NORM_EPS = 1e-5  # Llama 2's and Llama 3's rms_norm_eps
LLAMA_ROPE_THETA = 10000.0  # Llama 2's

DecoderConfig = GPTConfig | LlamaConfig


def architecture(config: DecoderConfig) -> str:
    """The ``arch`` (and a checkpoint's ``model_type``) of a decoder config: gpt or llama."""
    return "gpt" if isinstance(config, GPTConfig) else "llama"


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
    activation: str | None = None  # None: the architecture's (gpt: exact GELU, llama: SiLU)
    arch: str = "gpt"  # one of ARCHITECTURES
    n_kv_head: int | None = None  # llama: key/value heads shared by the query heads (n_head)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{setting('arch', self.arch)} is not an architecture; choose "
                f"{' or '.join(ARCHITECTURES)}"
            )
        self._check_sizes()
        if self.n_kv_head is not None:
            self._check_kv_heads()
        if self.arch == "gpt" and self.n_embd % self.n_head:
            raise ValueError(
                f"{setting('n_embd', self.n_embd)} must be a multiple of "
                f"{setting('n_head', self.n_head)}: each head is n_embd / n_head wide; choose "
                f"--n-embd {self._multiple(self.n_head)} or a --n-head that divides it"
            )
        if self.arch == "llama" and self.n_embd % (2 * self.n_head):
            raise ValueError(
                f"{setting('n_embd', self.n_embd)} must be a multiple of 2 × "
                f"{setting('n_head', self.n_head)}: each head is n_embd / n_head wide, and RoPE "
                f"turns pairs of its dims; choose --n-embd {self._multiple(self.n_head)} or a "
                "--n-head whose double divides it"
            )
        self.model_config(vocab_size=1)  # GPTConfig or LlamaConfig checks the sizes

    def _check_sizes(self) -> None:
        """The sizes as the flags name them (the configs would name their own fields)."""
        kv_heads = () if self.n_kv_head is None else ("n_kv_head",)  # checked on its own
        for name in ("n_layer", "n_head", "n_embd", *kv_heads):
            object.__setattr__(self, name, whole_number(name, getattr(self, name)))
            if name != "n_kv_head" and getattr(self, name) < 1:
                raise ValueError(f"{setting(name, getattr(self, name))} must be at least 1")
        if not is_real(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(
                f"{setting('dropout', repr(self.dropout))} must be a probability in [0, 1) "
                "(0: no dropout; nanoGPT's shakespeare_char uses 0.2)"
            )
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.bias not in (True, False):  # numpy's bools and 0/1 read as theirs
            raise ValueError(f"bias={self.bias!r} (Python only) must be True or False")
        object.__setattr__(self, "bias", bool(self.bias))

    def _multiple(self, heads: int) -> int:
        """The multiple of ``heads`` (of 2 × heads for a Llama) nearest above n_embd."""
        step = heads * (2 if self.arch == "llama" else 1)
        return -(-self.n_embd // step) * step

    def _check_kv_heads(self) -> None:
        """--n-kv-head: Llama's only, and dividing the query heads into equal groups."""
        kv_heads = setting("n_kv_head", self.n_kv_head)
        if self.arch != "llama":
            raise ValueError(
                f"{kv_heads} is for --arch llama (GPT's heads each have their own keys and "
                "values); add --arch llama or drop it"
            )
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            divisors = [str(n) for n in range(1, self.n_head + 1) if self.n_head % n == 0]
            raise ValueError(
                f"{kv_heads} must divide {setting('n_head', self.n_head)} (each key/value head "
                f"serves the same number of query heads); choose one of {', '.join(divisors)}"
            )

    def model_config(self, vocab_size: int) -> DecoderConfig:
        """The decoder for a vocabulary of ``vocab_size``; positions = the training block size.

        A Llama has RMSNorm (eps 1e-5), RoPE (theta 10000) on whole heads, a SwiGLU hidden
        size by :func:`~selfattn.models.llama.llama_hidden_size` (a multiple of 32 near
        8/3·n_embd), biases only if ``bias``, and an untied head.
        """
        if self.arch == "gpt":
            return GPTConfig(
                vocab_size=vocab_size,
                block_size=self.train.block_size,
                n_layer=self.n_layer,
                n_head=self.n_head,
                n_embd=self.n_embd,
                bias=self.bias,
                dropout=self.dropout,
                activation=self.activation or "gelu",
            )
        return LlamaConfig(
            vocab_size=vocab_size,
            d_model=self.n_embd,
            n_layers=self.n_layer,
            n_heads=self.n_head,
            n_kv_heads=self.n_kv_head or self.n_head,
            head_dim=self.n_embd // self.n_head if self.n_head > 0 else 0,
            d_ff=llama_hidden_size(self.n_embd),
            max_positions=self.train.block_size,
            norm_eps=LLAMA_NORM_EPS,
            rope_theta=LLAMA_ROPE_THETA,
            activation=self.activation or "silu",
            qkv_bias=self.bias,
            out_bias=self.bias,
            mlp_bias=self.bias,
            dropout=self.dropout,
        )

    def override(self, **changes: object) -> Preset:
        """A copy with some model fields and/or TrainConfig fields replaced (and re-validated)."""
        valid = (*MODEL_FIELDS, *(item.name for item in dataclasses.fields(TrainConfig)))
        unknown = [key for key in changes if key not in valid]
        if unknown:
            raise SettingsError(
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
            raise SettingsError(f"invalid training settings: {error}") from None

    @classmethod
    def from_configs(cls, name: str, model: DecoderConfig, train: TrainConfig) -> Preset:
        """The preset a checkpoint was trained with, rebuilt from its saved configs."""
        if isinstance(model, GPTConfig):
            fields = ("n_layer", "n_head", "n_embd", "dropout", "bias", "activation")
            sizes = {key: getattr(model, key) for key in fields}
        else:
            grouped = model.n_kv_heads != model.n_heads
            sizes = {
                "arch": "llama",
                "n_layer": model.n_layers,
                "n_head": model.n_heads,
                "n_kv_head": model.n_kv_heads if grouped else None,
                "n_embd": model.d_model,
                "dropout": model.dropout,
                "bias": model.qkv_bias,
                "activation": model.activation,
            }
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
        raise SettingsError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
