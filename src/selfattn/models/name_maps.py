"""Each architecture's checkpoint tensor names onto our parameters.

Each architecture has one explicit map from checkpoint tensor names to ours (:class:`Rule`):
a name, the parameter(s) it fills, and how (copied, transposed from GPT-2's Conv1D layout,
or split into W_q, W_k, W_v). :class:`Architecture` says what else a ``model_type`` saves:
the prefix its head models put before the body, and the tensors deliberately left out.

Left out: buffers that are not parameters (``position_ids``, ``token_type_ids``, GPT-2's
``attn.bias``/``attn.masked_bias`` causal masks), the encoders' task heads (:data:`TASK_HEADS`:
BERT's pre-training ``cls.*``, the masked-word heads ``lm_head.*`` and DistilBERT's
``vocab_*``, fine-tuned ``classifier.*``/``pre_classifier.*`` and ``qa_outputs.*``), which no
feature here uses. GPT-2's ``lm_head.weight`` is not skipped but checked: it must equal the
token embedding it is tied to. Old BERT checkpoints name their layer norms' weight and bias
``gamma`` and ``beta``; they are read under today's names, as transformers reads them.

DistilBERT's names are ``q_lin``, ``sa_layer_norm``, ``ffn.lin1``; MPNet's
``attention.attn.q``, plus ``encoder.relative_attention_bias``, shared by every layer. The
Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma) shares one map: the rules list exactly the
parameters the config builds (biases, Qwen3's q/k norms, an untied head); older checkpoints'
``rotary_emb.inv_freq`` buffers are skipped. Fused tensors are split by rows: Phi-3's
``qkv_proj`` (q | k | v) and ``gate_up_proj`` (gate | up), GPT-NeoX's ``query_key_value``,
whose rows run head by head, each head's q, k and v in turn (an (H, 3, head_dim) layout).
GPT-NeoX's output head is ``embed_out`` (``lm_head`` in a state dict of transformers 5, read
under the checkpoint's name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor

from selfattn.models.llama import Llama


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
# The decoders' task heads, refused by name (a decoder is loaded to generate, with its LM head):
# GPT-2's and Llama's sequence/token classification, GPT-2's multiple choice, question answering.
DECODER_TASK_HEADS = ("score.", "multiple_choice_head.", "qa_outputs.", "classifier.")
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
