"""A GPT-style decoder built from our layers: token + learned positions, pre-norm blocks, tied head.

The same network serves GPT-2 checkpoints (see :mod:`selfattn.models.loading`) and the small
models trained from scratch by :mod:`selfattn.train`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn.errors import SelfAttnError, is_integer, is_real
from selfattn.layers import ACTIVATIONS, KVCache, LearnedPositions, RMSNorm, TransformerBlock
from selfattn.models.fields import check_fields, check_positive


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and options of a decoder; validated on creation."""

    vocab_size: int
    block_size: int  # the most positions the model has
    n_layer: int
    n_head: int
    n_embd: int
    bias: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_tanh"

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        check_positive(self, "layer_norm_eps")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; one of {list(ACTIVATIONS)}")


@dataclass
class DecoderOutput:
    logits: Tensor  # (B, T, vocab)
    loss: Tensor | None  # mean cross-entropy when targets are given
    hidden_states: tuple[Tensor, ...]  # embedding output, then each block's output


class Decoder(nn.Module, ABC):
    """What generation needs of a decoder network, shared by :class:`GPT` and the Llama family.

    A subclass has ``blocks`` (one :class:`KVCache` each), ``max_positions``, and a
    ``forward(input_ids, attention_mask=..., position_ids=..., caches=...)`` that gives a
    :class:`DecoderOutput`, its tokens placed after the cached ones unless ``position_ids``
    say otherwise; one without ``max_positions`` cannot be made.
    """

    blocks: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Linear

    def decode(
        self,
        x: Tensor,
        masks: list[Tensor | None],
        caches: list[KVCache] | None,
        targets: Tensor | None,
        logits_to_keep: int = 0,
        **block_options: bool | Tensor | tuple[Tensor, Tensor] | None,
    ) -> DecoderOutput:
        """The blocks over the embedded tokens x (B, T, D), block i under ``masks[i]`` and its
        cache, then the final norm and the head: logits (of the last ``logits_to_keep``
        tokens only, unless 0), the loss against ``targets``, and every hidden state (x
        first)."""
        if type(logits_to_keep) is not int or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0: all), got {logits_to_keep!r}")
        if targets is not None and logits_to_keep:
            raise ValueError(
                "logits_to_keep keeps the last tokens' logits (for generation), and the loss "
                "needs every token's: pass targets or logits_to_keep, not both"
            )
        hidden_states = [x]
        for i, block in enumerate(self.blocks):
            x = block(x, mask=masks[i], cache=caches[i] if caches else None, **block_options)
            hidden_states.append(x)
        logits = self.lm_head(self.final_norm(x[:, -logits_to_keep:]))  # (B, T or kept, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return DecoderOutput(logits, loss, tuple(hidden_states))

    @property
    @abstractmethod
    def max_positions(self) -> int:
        """The most tokens the network reads at once."""

    def reset_parameters(self) -> None:
        """GPT-2's initialisation, nanoGPT's: every linear map and embedding N(0, 0.02), biases
        0, norms at the identity (scale 1, bias 0), and the two maps of each block that write
        into the residual stream (``attention.W_o``, ``feed_forward.down``) N(0, 0.02 /
        sqrt(2·layers)), so that the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                module.reset_parameters()
        residual_std = 0.02 / math.sqrt(2 * len(self.blocks))
        for block in self.blocks:
            nn.init.normal_(block.attention.W_o.weight, std=residual_std)
            nn.init.normal_(block.feed_forward.down.weight, std=residual_std)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Append ``max_new_tokens`` tokens to ``input_ids`` (B, T); temperature 0 is greedy.

        Rows of different lengths are padded on the left and marked by ``attention_mask``
        (B, T), 0 for padding, as Hugging Face's ``padding_side="left"`` does: each row reads
        only its own tokens, numbered from 0, so it continues as it would alone.

        With the key/value cache each step feeds only the new token (bottom-right causal
        alignment lets it see every cached key). Once the context outgrows ``max_positions`` the
        window slides and the cache is rebuilt, so outputs match ``use_cache=False`` exactly.
        """
        steps = self.generate_steps(
            input_ids,
            max_new_tokens,
            attention_mask=attention_mask,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            use_cache=use_cache,
        )
        last = deque(steps, maxlen=1)  # runs every step, keeps the final ids
        return last[0] if last else input_ids

    @torch.no_grad()
    def generate_steps(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> Iterator[Tensor]:
        """:meth:`generate` one token at a time: yields the ids (B, T + n) after each new token.

        Each ``next()`` runs exactly one forward pass, the one that chose the new token, so a
        caller can look at it (``with record(model): next(steps)``). In a left-padded batch
        the window slides for all rows once the longest outgrows ``max_positions``: each row
        then reads its last ``max_positions`` tokens (or all it has), as it would alone.
        """
        check_sampling(max_new_tokens, temperature, top_k, seed)
        padding = left_padding(input_ids, attention_mask)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=input_ids.device).manual_seed(seed)
        window = self.max_positions
        # Columns that pad every row are never read: the context starts at the longest row.
        start = 0 if padding is None else input_ids.shape[1] - int(padding.sum(-1).max())
        caches: list[KVCache] | None = None
        ids = input_ids
        for _ in range(max_new_tokens):
            if use_cache and caches is not None and len(caches[0]) < window:
                width = 1
            else:
                caches = [KVCache() for _ in self.blocks] if use_cache else None
                width = min(ids.shape[1] - start, window)
            inputs = {}
            if padding is not None:
                seen = len(caches[0]) if caches else 0  # tokens already in the cache
                keys = padding[:, -(seen + width) :]  # (B, S): the keys this step reads
                positions = (keys.cumsum(-1) - 1).clamp(min=0)[:, -width:]  # padding at 0
                inputs = {"attention_mask": keys, "position_ids": positions}
            output = self(ids[:, -width:], caches=caches, logits_to_keep=1, **inputs)
            logits = output.logits[:, -1, :]  # (B, vocab)
            next_id = sample(logits, temperature, top_k, generator)
            ids = torch.cat([ids, next_id], dim=1)
            if padding is not None:
                padding = F.pad(padding, (0, 1), value=True)
            yield ids


def check_position_ids(position_ids: Tensor, input_ids: Tensor, limit: int | None) -> None:
    """One line unless ``position_ids`` is an integer tensor of input_ids' shape, its values
    in [0, limit) where the positions are a table of ``limit`` rows (read in eager calls: a
    compiled graph cannot branch on them)."""
    if not isinstance(position_ids, Tensor) or position_ids.shape != input_ids.shape:
        got = tuple(position_ids.shape) if isinstance(position_ids, Tensor) else position_ids
        raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {got!r}")  # fmt: skip
    if position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must hold integers, got {position_ids.dtype}")
    if limit is not None and (outside := out_of_range(position_ids, limit)):
        low, high = outside
        raise ValueError(
            f"position_ids must lie in 0..{limit - 1} (the model's positions), got {low}..{high}"
        )


def out_of_range(values: Tensor, limit: int) -> tuple[int, int] | None:
    """The lowest and highest of integer ``values`` where some lie outside [0, limit); None
    where all lie inside, there are none, or a compiled graph is being traced (a check that
    reads the values would break it, and ``fullgraph=True`` refuses that)."""
    if values.numel() == 0 or torch.compiler.is_compiling():
        return None
    low, high = (int(value) for value in torch.aminmax(values))  # one pass, one device sync
    return (low, high) if low < 0 or high >= limit else None


def left_padding(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """The mask of real tokens (B, T), bool, or None where there is no padding; one line for
    a mask that is not input_ids' shape or pads anywhere but on the left of a row."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        mask = attention_mask
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise SelfAttnError(
            f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {got}"
        )
    real = attention_mask.to(device=input_ids.device, dtype=torch.bool)
    if real.numel() and not bool((real[:, 1:] >= real[:, :-1]).all() & real[:, -1].all()):
        raise SelfAttnError(
            "attention_mask must pad on the left: 0s, then 1s to each row's end (Hugging "
            "Face's padding_side='left'); pad the prompts on the left"
        )
    return None if bool(real.all()) else real


class GPT(Decoder):
    """Decoder-only transformer; ``forward(input_ids, targets)`` gives logits and loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = LearnedPositions(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                config.n_embd,
                config.n_head,
                4 * config.n_embd,
                norm_first=True,
                activation=config.activation,
                bias=config.bias,
                dropout=config.dropout,
                layer_norm_eps=config.layer_norm_eps,
            )
            for _ in range(config.n_layer)
        )
        self.final_norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied, as in GPT-2
        self.reset_parameters()

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        caches: list[KVCache] | None = None,
        logits_to_keep: int = 0,
    ) -> DecoderOutput:
        """input_ids (B, T); attention_mask (B, S) with 1 for real tokens; position_ids (B, T),
        by default those after the cached tokens (Hugging Face's); caches per block; the
        logits of the last ``logits_to_keep`` tokens only (0: all), as generation needs."""
        x = self.token_embedding(input_ids)  # (B, T, C)
        if position_ids is None:
            x = self.positions(x, len(caches[0]) if caches else 0)
        else:
            check_position_ids(position_ids, input_ids, self.config.block_size)
            x = x + self.positions.embedding(position_ids)
        x = self.dropout(x)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S): keys that exist
        masks = [mask] * len(self.blocks)
        return self.decode(x, masks, caches, targets, logits_to_keep, causal=True)

    @property
    def max_positions(self) -> int:
        return self.config.block_size


MAX_SAMPLING_SEED = 2**32 - 1  # as the command line's --seed and the explorer's


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: int | None, seed: int | None = None
) -> None:
    """One line for a generation option that no sampling can take, before any step."""
    if not is_integer(max_new_tokens, 0):
        raise SelfAttnError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    if not (is_real(temperature) and temperature >= 0):  # also refuses NaN
        raise SelfAttnError(f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}")
    if seed is not None and not (is_integer(seed, 0) and seed <= MAX_SAMPLING_SEED):
        raise SelfAttnError(
            f"seed must be a whole number from 0 to {MAX_SAMPLING_SEED}, or None, got {seed!r}"
        )
    if top_k is not None and not is_integer(top_k, 1):
        raise SelfAttnError(
            f"top_k must be a whole number >= 1 (or None to sample from every token), got {top_k!r}"
        )


def sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token id per row of logits (B, vocab) -> (B, 1); temperature 0 takes the argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # Shift each row's maximum to 0 before scaling: with a tiny temperature the others go to
    # -inf (never inf - inf = NaN), so sampling approaches the argmax. The temperature is kept
    # at least the dtype's smallest normal number (a Python float casts to the tensor's dtype,
    # so 1e-300 would become 0 and 0 / 0 NaN); half precision is scaled in float32. The top-k
    # mask is chosen on the unscaled logits and applied after scaling (-inf / inf is NaN).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        scaled = scaled.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
