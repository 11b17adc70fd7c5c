"""A checkpoint's JSON files onto our configs: ``config.json`` for each family, and the
sentence-transformers and generation settings beside it.

Every entry a family reads is checked for its kind first (:data:`CONFIG_ENTRIES`), so that a
string where a size belongs, or null for a count, is a one-line error naming the file, never a
TypeError deep in a layer. Defaults are those of the family's transformers config class.

One :class:`Bert` serves three encoder families. RoBERTa (and XLM-RoBERTa, the same network)
is BERT with positions numbered from ``pad_token_id + 1``: its table's first rows are never a
real token's, so it reads ``max_position_embeddings - pad_token_id - 1`` tokens at most
(514 rows, 512 tokens). DistilBERT is BERT without token types or pooler under its own config
names (``dim``, ``n_layers``). MPNet is RoBERTa's positions (from its padding id 1, fixed in
transformers' code) without token types, plus a relative position bias table. The Llama family
(Llama, Mistral, Qwen2, Qwen3), Phi-3, Gemma and GPT-NeoX (Pythia) configure one
:class:`Llama`: biases, q/k norms, RoPE's theta, scaling and partial rotation, sliding windows,
the norm, the activation and the residual layout.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from selfattn.errors import SelfAttnError, is_integer
from selfattn.layers import RopeScaling
from selfattn.models.bert import RELATIVE_BUCKETS, BertConfig
from selfattn.models.fields import problem
from selfattn.models.gpt import GPTConfig
from selfattn.models.llama import LlamaConfig
from selfattn.models.model import SentenceConfig

POOLING_NAMES = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens"}  # v6 -> ours
COMPUTED_MODULES = ("Transformer", "Pooling", "Normalize")  # of sentence-transformers' pipeline
HF_ACTIVATIONS = {  # Hugging Face's names -> ours (selfattn.layers.ACTIVATIONS)
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
}


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
        ),
        "positive",
    ),
    **dict.fromkeys(("rotary_pct", "partial_rotary_factor"), "float"),
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
    rope, rope_key = rope_settings(raw)
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
    if model_type == "phi3" and scaling is not None:  # transformers refuses it: no reference
        raise SelfAttnError(
            f"unsupported RoPE type {scaling.kind!r} for phi3 ({rope_settings(raw)[1]} in "
            "config.json); Phi-3 scales RoPE only by its own longrope, which is not built here"
        )
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
    """Gemma's GeGLU activation, from ``hidden_activation`` and ``hidden_act`` (the tanh
    approximation where neither is given); a plain "gelu" means that approximation too, as
    transformers reads it. Where the two name different activations the config is refused:
    transformers 4 reads the first, 5 the second, so neither answer is the checkpoint's."""
    given = {key: raw[key] for key in ("hidden_activation", "hidden_act") if raw.get(key)}
    read = {
        key: "gelu_tanh" if name == "gelu" else activation_of(raw, key, "gelu_pytorch_tanh")
        for key, name in given.items()
    }
    if len(set(read.values())) > 1:
        raise SelfAttnError(
            f"config.json: hidden_activation {given['hidden_activation']!r} and hidden_act "
            f"{given['hidden_act']!r} name different activations (transformers 4 reads the "
            "first, 5 the second); make them agree"
        )
    return next(iter(read.values()), "gelu_tanh")


def neox_config(raw: dict) -> LlamaConfig:
    """Our decoder config from a GPT-NeoX (Pythia) ``config.json``: LayerNorms, an ungated MLP
    with biases, a partial rotation (``rotary_pct``, 0.25 if unsaid, as GPTNeoXConfig has it)
    and, unless ``use_parallel_residual`` is false, the parallel residual."""
    n_heads = raw["num_attention_heads"]
    head_dim = raw["hidden_size"] // n_heads
    older = {"rope_theta": raw.get("rotary_emb_base", 10000.0)}  # before rope_parameters
    older["partial_rotary_factor"] = raw.get("rotary_pct", 0.25)
    rope = older | (rope_settings(raw)[0] or {})
    theta, scaling, rotary_dim = rope_of(
        raw | {"rope_parameters": rope, "rope_scaling": None}, head_dim, partial=True
    )
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


def rope_settings(raw: dict) -> tuple[Any, str]:
    """RoPE's settings and the config.json entry that holds them: transformers 5's
    ``rope_parameters``, else the older ``rope_scaling``; one line where both give a setting
    with different values (transformers 5 takes rope_scaling's: the two would differ)."""
    parameters, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if parameters and isinstance(parameters, dict) and scaling and isinstance(scaling, dict):
        kinds = [settings.get("rope_type", settings.get("type", "default")) for settings in
                 (parameters, scaling)]  # fmt: skip
        differ = [
            key for key in parameters.keys() & scaling.keys() if parameters[key] != scaling[key]
        ]
        if kinds[0] != kinds[1] or differ:
            what = f"type {kinds[0]!r} and {kinds[1]!r}" if kinds[0] != kinds[1] else differ[0]
            raise SelfAttnError(
                f"config.json's rope_parameters and rope_scaling disagree ({what}); keep the "
                "checkpoint's own RoPE settings in one of them"
            )
    return (parameters, "rope_parameters") if parameters else (scaling, "rope_scaling")


def rope_of(raw: dict, head_dim: int, partial: bool) -> tuple[float, RopeScaling | None, int]:
    """RoPE's theta, scaling and the dims of a head that turn (``partial_rotary_factor`` of
    ``head_dim``, rounded down as transformers does, for the families whose transformers code
    reads it: ``partial``): transformers 5's ``rope_parameters``, or the older top-level
    ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``."""
    rope, rope_key = rope_settings(raw)
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES or any(isinstance(value, dict) for value in rope.values()):
        raise SelfAttnError(
            f"unsupported RoPE type {kind!r} ({rope_key} in config.json); supported: "
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
    """How sentence-transformers pools this checkpoint (mean if unsaid) and where it truncates.

    ``folder`` is the transformer's; its pipeline is described by its own ``modules.json``,
    or, in the older layout whose transformer sits in a subfolder (``0_Transformer``), by
    the parent's."""
    root = pipeline_root(folder)
    modules = pipeline(root)
    pooling_path = dict(modules).get("Pooling", "1_Pooling")
    pooling_file = root / pooling_path / "config.json"
    kinds = [kind for kind, _ in modules]
    return SentenceConfig(
        pooling=pooling_of(pooling_file) if pooling_file.is_file() else "mean_tokens",
        max_seq_length=min(max_seq_length(folder) or max_positions, max_positions),
        not_computed=tuple(kind for kind in kinds if kind not in COMPUTED_MODULES),
        normalize="Normalize" in kinds,
        lowercase=lowercases(folder),
    )


def lowercases(folder: Path) -> bool:
    """Whether sentence-transformers lowercases texts before its tokenizer (the Transformer
    module's ``do_lower_case`` in ``sentence_bert_config.json``)."""
    path = folder / "sentence_bert_config.json"
    setting = read_json(path, "sentence settings").get("do_lower_case") if path.is_file() else None
    if setting is not None and not isinstance(setting, bool):
        raise SelfAttnError(
            f"{path}: do_lower_case must be true or false, got {json.dumps(setting)}; restore "
            "the original"
        )
    return bool(setting)


def transformer_folder(folder: Path) -> Path:
    """Where the transformer of a sentence-transformers folder is: ``folder`` itself, or in
    the older layout (no config.json beside ``modules.json``) the subfolder it names."""
    if (folder / "config.json").exists() or not (folder / "modules.json").is_file():
        return folder
    path = dict(pipeline(folder)).get("Transformer", "")
    return folder / path if path and (folder / path / "config.json").is_file() else folder


def pipeline_root(folder: Path) -> Path:
    """The folder whose ``modules.json`` describes the pipeline of the transformer in
    ``folder``: ``folder``, or its parent where that lists ``folder`` as its Transformer."""
    if (folder / "modules.json").is_file() or not (folder.parent / "modules.json").is_file():
        return folder
    named = dict(pipeline(folder.parent)).get("Transformer")
    return folder.parent if named == folder.name else folder


def pooling_of(pooling_file: Path) -> str:
    """The one pooling ``1_Pooling/config.json`` names, under our name (``mean_tokens``): its
    ``pooling_mode`` ("mean", sentence-transformers >= 6) or the ``pooling_mode_*`` flag set."""
    raw = read_json(pooling_file, "pooling config")
    if "pooling_mode" in raw:
        named = raw["pooling_mode"]  # one name, or a list of them to concatenate
        named = [named] if isinstance(named, str) else named
        if not isinstance(named, list) or not all(isinstance(mode, str) for mode in named):
            raise SelfAttnError(
                f'{pooling_file}: pooling_mode must name a pooling such as "mean", got '
                f"{json.dumps(named)}; restore the original"
            )
    else:
        flags = [key for key, on in raw.items() if key.startswith("pooling_mode_") and on is True]
        named = [flag.removeprefix("pooling_mode_") for flag in flags]
    modes = [POOLING_NAMES.get(mode, mode) for mode in named]
    if len(modes) != 1 or modes[0] not in SentenceConfig.POOLINGS:
        raise SelfAttnError(
            f"{pooling_file} pools by {' and '.join(named) or 'nothing'}; encode computes one "
            "of mean, cls or max pooling (sentence-transformers computes the others)"
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
        if length is None:
            continue
        if not is_integer(length, 1):
            raise SelfAttnError(
                f"{path}: {key} must be a whole number of tokens >= 1, got {json.dumps(length)}; "
                "restore the original"
            )
        return length
    return None


def pipeline(folder: Path) -> list[tuple[str, str]]:
    """The kind and subfolder of each module ``modules.json`` lists, in order
    (("Transformer", ""), ("Pooling", "1_Pooling"), ...); none without the file, which
    sentence-transformers reads as a transformer and mean pooling, unnormalised."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return []
    modules = read_json(modules_file, "sentence-transformers modules", holds=list)
    listed = []
    for module in modules:
        kind = module.get("type") if isinstance(module, dict) else None
        path = module.get("path", "") if isinstance(module, dict) else None
        if not isinstance(kind, str) or not kind or not isinstance(path, str):
            raise SelfAttnError(
                f'{modules_file}: each module must be an object with a "type" such as '
                f'"sentence_transformers.models.Pooling", got {json.dumps(module)[:60]}; '
                "restore the original"
            )
        listed.append((kind.rsplit(".", 1)[-1], path))
    return listed


def eos_token_ids(raw: dict, folder: Path, vocab_size: int) -> tuple[int, ...]:
    """The tokens that end a generation: ``generation_config.json``'s ``eos_token_id`` (one
    id or a list, as Llama 3's instruct models list three), or without that file
    ``config.json``'s, as Hugging Face's generate reads them (a generation_config.json with
    no ``eos_token_id`` stops at none, whatever config.json says); () for none. Ids past the
    vocabulary are left out: no step can choose them (transformers writes GPT-2's 50256 into
    the config of a GPT-2 of any vocabulary). One that is not an integer is refused."""
    generation_file = folder / "generation_config.json"
    generation = (
        read_json(generation_file, "generation settings") if generation_file.is_file() else {}
    )
    source = generation_file if generation_file.is_file() else folder / "config.json"
    ids = generation.get("eos_token_id") if generation_file.is_file() else raw.get("eos_token_id")
    ids = tuple(ids) if isinstance(ids, list) else () if ids is None else (ids,)
    for token_id in ids:
        if type(token_id) is not int:
            raise SelfAttnError(
                f"{source}: eos_token_id {token_id!r} is not a token id (an integer); "
                f"restore the checkpoint's original {source.name}"
            )
    return tuple(token_id for token_id in ids if 0 <= token_id < vocab_size)
