"""Train nanoGPT's shakespeare_char CPU configuration and report loss, speed and a sample.

The configuration is the ``shakespeare-char-cpu`` preset: 4 layers, 4 heads, 128 wide, block 64,
batch 12, 2,000 steps, lr 1e-3 -> 1e-4 (100 warm-up, cosine to step 2,000), AdamW beta2 0.99,
weight decay 0.1, no dropout, no bias, 20 evaluation batches every 250 steps. nanoGPT reports
val loss 1.88 for it. Also measures how noisy the 20-batch validation estimate is (the final
model under 50 evaluation seeds) and draws one trained head's attention on a line of the play.

``--reference`` also trains, in the same run, an independent re-implementation of nanoGPT's
model, initialisation, optimizer groups, schedule and loop in plain PyTorch
(:class:`ReferenceGPT`, :func:`train_reference`), after checking that it computes the same
function as ours from the same weights; both loss curves are printed side by side. It trains on
our run's batches, or with ``--reference-batches nanogpt`` on nanoGPT's own random stream (with
seed 1337: nanoGPT's own run replayed, since the same seed also gives the same initial weights).

    python benchmarks/train_shakespeare.py                      # ~70 s on 2 idle cores
    python benchmarks/train_shakespeare.py --reference --reference-batches nanogpt  # ~3 minutes
    python benchmarks/train_shakespeare.py --max-iters 100      # a quick check of the script
    python benchmarks/train_shakespeare.py --arch llama         # the same sizes as a Llama

The head's figure goes next to the checkpoint; the recorded run's (docs/benchmarks.md) was
drawn with ``--figure docs/train_head.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import Tensor, nn

from selfattn import record
from selfattn.models.gpt import GPT, GPTConfig
from selfattn.train import RandomBatches, TextData, TrainConfig, configure_optimizer, train_decoder
from selfattn.train.data import read_text
from selfattn.train.loop import BatchSource, learning_rate
from selfattn.train.presets import get_preset
from selfattn.viz.figures import heatmap_figure, save_figure

REPO = Path(__file__).resolve().parents[1]
PRESET = "shakespeare-char-cpu"  # nanoGPT's CPU configuration (the module doc)
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
EVAL_SEEDS = 50  # evaluation seeds for the spread of the 20-batch estimate


# --- nanoGPT's model, written independently of selfattn (plain PyTorch) -------------------------


class ReferenceOutput(NamedTuple):
    logits: Tensor
    loss: Tensor | None


class ReferenceBlock(nn.Module):
    """nanoGPT's pre-norm block without biases: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5, bias=False)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)  # q, k, v in one matrix
        self.attn_proj = nn.Linear(n_embd, n_embd, bias=False)  # nanoGPT's attn.c_proj
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5, bias=False)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd, bias=False)  # nanoGPT's mlp.c_proj

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(head size)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))  # exact GELU


class ReferenceGPT(nn.Module):
    """nanoGPT's GPT for the shakespeare_char CPU configuration (no bias, no dropout)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(ReferenceBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for module in self.modules():  # nanoGPT's _init_weights
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for block in self.h:  # the two c_proj maps that write into the residual stream
            for proj in (block.attn_proj, block.mlp_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> ReferenceOutput:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return ReferenceOutput(logits, loss)

    def load_from(self, ours: GPT) -> ReferenceGPT:
        """Copy the weights of our decoder (same sizes) into this one."""
        with torch.no_grad():
            self.wte.weight.copy_(ours.token_embedding.weight)
            self.wpe.weight.copy_(ours.positions.embedding.weight)
            for mine, theirs in zip(self.h, ours.blocks, strict=True):
                attention = theirs.attention
                mine.ln_1.weight.copy_(theirs.norm1.weight)
                mine.c_attn.weight.copy_(
                    torch.cat([attention.W_q.weight, attention.W_k.weight, attention.W_v.weight])
                )
                mine.attn_proj.weight.copy_(attention.W_o.weight)
                mine.ln_2.weight.copy_(theirs.norm2.weight)
                mine.c_fc.weight.copy_(theirs.feed_forward.up.weight)
                mine.mlp_proj.weight.copy_(theirs.feed_forward.down.weight)
            self.ln_f.weight.copy_(ours.final_norm.weight)
        return self


def reference_lr(it: int, config: TrainConfig) -> float:
    """nanoGPT's get_lr: warm-up lr·(it+1)/(warmup+1), cosine to min_lr at lr_decay_iters."""
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / (config.warmup_iters + 1)
    if it > config.lr_decay_iters:
        return config.min_lr
    ratio = (it - config.warmup_iters) / (config.lr_decay_iters - config.warmup_iters)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (
        config.learning_rate - config.min_lr
    )


def reference_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: decay every 2+-dim tensor, not the rest; on a CPU it
    uses torch's default (not fused) AdamW, eps 1e-8."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2))


def reference_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, lr: float, clip: float
) -> float:
    """One step as nanoGPT's train.py takes it (one micro-step, float32 on a CPU)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(x, y).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def eval_loss(model: nn.Module, batches: BatchSource, iters: int, split: str = "val") -> float:
    """nanoGPT's estimate_loss for one split: the mean loss of ``iters`` batches of ``split``."""
    model.eval()
    losses = [model(*batches.batch(split)).loss.item() for _ in range(iters)]
    model.train()
    return sum(losses) / len(losses)


class NanoGPTBatches:
    """nanoGPT's get_batch: offsets from ``torch.randint`` on torch's global generator, which
    also initialised the model, so one seed fixes weights and batches as in its train.py."""

    def __init__(self, data: TextData, batch_size: int, block_size: int) -> None:
        self.batch_size = batch_size
        self.block_size = block_size
        self.data = {"train": data.train, "val": data.val}

    def batch(self, split: str) -> tuple[Tensor, Tensor]:
        data = self.data[split]
        ix = torch.randint(len(data) - self.block_size, (self.batch_size,))
        x = torch.stack([data[i : i + self.block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + self.block_size] for i in ix])
        return x, y


@dataclass
class ReferenceRun:
    model: ReferenceGPT
    history: list[dict[str, float]]
    train_seconds: float


def train_reference(
    data: TextData,
    vocab_size: int,
    config: TrainConfig,
    sizes: dict[str, int],
    console: Console,
    batch_stream: str = "ours",
) -> ReferenceRun:
    """nanoGPT's training loop: lr set, evaluation when due, forward, prefetch of the next
    batch, backward, clip, step.

    ``batch_stream="ours"``: the batches our run used (same seed and draw order: the same
    training batch at every step, the same validation batches at every evaluation).
    ``"nanogpt"``: nanoGPT's own stream (:class:`NanoGPTBatches`, drawn in its train.py's
    order: one training batch before the loop, 20 training and 20 validation batches at each
    evaluation), which with seed 1337 replays the run behind nanoGPT's published number.
    """
    torch.manual_seed(config.seed)
    model = ReferenceGPT(vocab_size, **sizes)
    optimizer = reference_optimizer(model, config)
    batches: BatchSource
    if batch_stream == "nanogpt":
        batches = NanoGPTBatches(data, config.batch_size, config.block_size)
        eval_splits = ("train", "val")
    else:
        batches = RandomBatches(data, config.batch_size, config.block_size, config.seed)
        eval_splits = ("val",)
    history: list[dict[str, float]] = []
    window: list[float] = []
    seconds = 0.0
    x, y = batches.batch("train")
    for it in range(config.max_iters + 1):
        if it % config.eval_interval == 0 or it == config.max_iters:
            losses = {s: eval_loss(model, batches, config.eval_iters, s) for s in eval_splits}
            entry = {"step": it, "val": losses["val"]}
            if window:
                entry["train"] = sum(window) / len(window)
            history.append(entry)
            window = []
            console.print(f"reference step {it:>5}: val loss {entry['val']:.4f}")
        if it == config.max_iters:
            break
        tick = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(it, config)
        loss = model(x, y).loss
        x, y = batches.batch("train")  # nanoGPT fetches the next batch during the step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(loss.item())
        seconds += time.perf_counter() - tick
    return ReferenceRun(model.eval(), history, seconds)


def check_same_function(
    data: TextData, model_config: GPTConfig, config: TrainConfig, steps: int = 50
) -> str:
    """Ours and the reference from the same initial weights, on the same batches: the largest
    differences of logits and gradients at step 0, and of the loss over ``steps`` steps, each
    model trained by its own optimizer and schedule (fused vs default AdamW: rounding only)."""
    torch.manual_seed(config.seed)  # the initial weights of our run (see selfattn.train.run)
    ours = GPT(model_config).train()
    reference = ReferenceGPT(model_config.vocab_size, **_sizes(model_config)).load_from(ours)
    batches = RandomBatches(data, config.batch_size, config.block_size, seed=12345)
    x, y = batches.batch("train")
    out, ref = ours(x, y), reference(x, y)
    logits_diff = (out.logits - ref.logits).abs().max().item()
    out.loss.backward()
    ref.loss.backward()
    ours_grads = torch.cat([g.flatten() for g in _as_reference(ours, lambda p: p.grad)])
    ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    grad_diff = ((ours_grads - ref_grads).abs().max() / ref_grads.abs().max()).item()
    ours.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    ours_opt, ref_opt = configure_optimizer(ours, config), reference_optimizer(reference, config)
    loss_diff = 0.0
    for step in range(steps):
        x, y = batches.batch("train")
        for group in ours_opt.param_groups:
            group["lr"] = learning_rate(step, config)
        loss = ours(x, y).loss
        loss.backward()
        nn.utils.clip_grad_norm_(ours.parameters(), config.grad_clip)
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)
        lr = reference_lr(step, config)
        ref_loss = reference_step(reference, ref_opt, x, y, lr, config.grad_clip)
        loss_diff = max(loss_diff, abs(loss.item() - ref_loss))
    weights = torch.cat([w.flatten() for w in _as_reference(ours, lambda p: p.detach())])
    ref_weights = torch.cat([p.detach().flatten() for p in reference.parameters()])
    weight_diff = (weights - ref_weights).abs().max().item()
    lr_diff = max(
        abs(learning_rate(i, config) - reference_lr(i, config)) for i in range(config.max_iters)
    )
    return (
        f"same weights, same batch: max |logits diff| {logits_diff:.1e}, max gradient diff "
        f"{grad_diff:.1e} of the largest gradient; then {steps} steps each with its own "
        f"optimizer and schedule: max |loss diff| {loss_diff:.1e}, max |weight diff| "
        f"{weight_diff:.1e}; learning rates over {config.max_iters} steps: max diff {lr_diff:.1e}"
    )


def _sizes(model_config: GPTConfig) -> dict[str, int]:
    names = ("block_size", "n_layer", "n_head", "n_embd")
    return {name: getattr(model_config, name) for name in names}


def _as_reference(ours: GPT, get: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """``get`` of each of our tensors, in the reference's parameter order and layout."""
    tensors = [get(ours.token_embedding.weight), get(ours.positions.embedding.weight)]
    for block in ours.blocks:
        attention, feed_forward = block.attention, block.feed_forward
        tensors += [
            get(block.norm1.weight),
            torch.cat(
                [get(attention.W_q.weight), get(attention.W_k.weight), get(attention.W_v.weight)]
            ),
            get(attention.W_o.weight),
            get(block.norm2.weight),
            get(feed_forward.up.weight),
            get(feed_forward.down.weight),
        ]
    return [*tensors, get(ours.final_norm.weight)]


# --- measurements shared by both models ---------------------------------------------------------


@torch.no_grad()
def whole_split_loss(model: nn.Module, ids: Tensor, block: int, batch_size: int = 256) -> float:
    """Mean next-character loss over the split cut into consecutive block-size windows: the
    exact held-out loss, where the 20 random evaluation batches are an estimate."""
    n = (len(ids) - 1) // block
    x, y = ids[: n * block].view(n, block), ids[1 : n * block + 1].view(n, block)
    total = sum(
        model(x[i : i + batch_size], y[i : i + batch_size]).loss.item() * len(x[i : i + batch_size])
        for i in range(0, n, batch_size)
    )
    return total / n


@torch.no_grad()
def eval_spread(
    model: nn.Module, data: TextData, config: TrainConfig, seeds: int = EVAL_SEEDS
) -> list[float]:
    """The benchmark's validation estimate (``eval_iters`` random batches) of one model under
    ``seeds`` different batch seeds: how much the reported number moves with the batches."""
    estimates = []
    for seed in range(seeds):
        batches = RandomBatches(data, config.batch_size, config.block_size, seed=10_000 + seed)
        estimates.append(eval_loss(model, batches, config.eval_iters))
    model.eval()
    return estimates


def _spread(values: list[float]) -> str:
    return (
        f"mean {statistics.mean(values):.4f}, std {statistics.stdev(values):.4f}, "
        f"range {min(values):.4f}-{max(values):.4f}"
    )


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``argv`` None reads ``sys.argv``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=REPO / "../shared/data/tinyshakespeare.txt",
        help="training text (default: ../shared/data/tinyshakespeare.txt)",
    )
    parser.add_argument("--max-iters", type=int, default=2000, help="training steps")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=1337, help="seed of weights and batches")
    parser.add_argument(
        "--arch",
        choices=("gpt", "llama"),
        default="gpt",
        help="the model: nanoGPT's GPT (default) or a Llama of the same sizes (selfattn train "
        "--arch llama)",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also train an independent re-implementation of nanoGPT (see --reference-batches)",
    )
    parser.add_argument(
        "--reference-batches",
        choices=("ours", "nanogpt"),
        default="ours",
        help="the reference's batches: our run's (default) or nanoGPT's own random stream",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="checkpoint directory (default: a temporary one)"
    )
    parser.add_argument(
        "--figure",
        type=Path,
        default=None,
        help="where to draw one trained head's attention (default: train_head.png in the "
        "checkpoint directory; the recorded run's is docs/train_head.png)",
    )
    parser.add_argument("--layer", type=int, default=1, help="layer of the drawn head")
    parser.add_argument("--head", type=int, default=0, help="the drawn head")
    args = parser.parse_args(argv)
    if args.reference and args.arch != "gpt":
        parser.error("--reference re-implements nanoGPT's GPT; drop it with --arch llama")
    if min(args.max_iters, args.threads) < 1:
        parser.error("--max-iters and --threads must be at least 1")
    preset = get_preset(PRESET)  # checked now, not after the whole run that draws the head
    if not 0 <= args.layer < preset.n_layer or not 0 <= args.head < preset.n_head:
        parser.error(
            f"--layer {args.layer} --head {args.head}: the model has layers "
            f"0..{preset.n_layer - 1} and heads 0..{preset.n_head - 1}"
        )
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    console = Console(soft_wrap=True)  # long lines stay whole when piped (e.g. to tee)
    console.print(f"load average (1, 5, 15 min) at the start: {_load()}")
    out = args.out or Path(tempfile.mkdtemp(prefix="shakespeare-char-"))
    start = time.perf_counter()
    overrides = {"max_iters": args.max_iters, "seed": args.seed, "arch": args.arch}
    run = train_decoder(
        args.data, out, preset=PRESET, overrides=overrides, device="cpu",
        console=console,
    )  # fmt: skip
    wall = time.perf_counter() - start
    result, config = run.result, run.config.train
    console.print(f"load average after training: {_load()}")

    model, tokenizer = run.model, run.tokenizer
    block = config.block_size
    data = TextData.from_file(args.data, block, tokenizer)
    reference = None
    if args.reference:
        text = read_text(args.data)  # nanoGPT's prepare.py: sorted characters, first 90% trains
        n_train = int(0.9 * len(text))
        assert tokenizer.chars == "".join(sorted(set(text)))
        assert data.train.tolist() == tokenizer.encode(text[:n_train])
        console.print("\n" + check_same_function(data, run.config.model, config))
        reference = train_reference(
            data,
            tokenizer.vocab_size,
            config,
            _sizes(run.config.model),
            console,
            args.reference_batches,
        )

    console.print(
        "\n| step | train loss | val loss |"
        + (" reference train | reference val |\n|---:|---:|---:|---:|---:|" if reference else
           "\n|---:|---:|---:|")
    )  # fmt: skip
    for i, entry in enumerate(result.history):
        row = f"| {entry['step']} | {entry.get('train', float('nan')):.4f} | {entry['val']:.4f} |"
        if reference is not None:
            theirs = reference.history[i]
            row += f" {theirs.get('train', float('nan')):.4f} | {theirs['val']:.4f} |"
        console.print(row.replace("nan", "–"))
    console.print(
        f"\nval loss {result.history[-1]['val']:.4f} at step {result.step}; "
        f"{result.ms_per_iter:.1f} ms/iter, {result.tokens_per_second:,.0f} tokens/s "
        f"(training steps only); wall time {wall:.1f} s (with evaluation, checkpoints, start-up); "
        f"torch {torch.__version__}, {args.threads} threads; {args.arch}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; checkpoint in {out}"
    )
    models = {"ours": model} | ({"reference": reference.model} if reference else {})
    for name, trained in models.items():
        held_out = whole_split_loss(trained, data.val, block)
        spread = _spread(eval_spread(trained, data, config))
        console.print(
            f"{name}: val loss on the whole held-out split (every {block}-character window) "
            f"{held_out:.4f}; the {config.eval_iters}-batch estimate under {EVAL_SEEDS} "
            f"evaluation seeds: {spread}"
        )
    if reference is not None:
        ours_ms, theirs_ms = result.ms_per_iter, 1000 * reference.train_seconds / config.max_iters
        console.print(
            f"ms/iter (training steps only, this run): ours {ours_ms:.1f}, nanoGPT reference "
            f"{theirs_ms:.1f}; ours/reference {ours_ms / theirs_ms:.2f} (ours "
            f"{theirs_ms / ours_ms:.2f}x as fast)"
        )
    console.print(f"load average at the end: {_load()}")

    ids = torch.tensor([tokenizer.encode("\n")])
    sample = model.generate(ids, 300, temperature=0.8, top_k=200, seed=1337)
    console.print("\nsample (temperature 0.8, top-k 200, seed 1337):\n", markup=False)
    console.print(tokenizer.decode(sample[0]), markup=False)

    text = PROMPT[:block]
    with record(model) as recording, torch.no_grad():
        model(torch.tensor([tokenizer.encode(text)]))
    weights = recording[args.layer].weights(args.head)  # (T, T)
    labels = [repr(char)[1:-1] if char in "\n " else char for char in text]
    labels = ["␣" if char == " " else char for char in labels]
    figure = heatmap_figure(
        weights, labels, labels,
        f"shakespeare_char model after {result.step} steps: layer {args.layer}, head {args.head}",
    )  # fmt: skip
    path = args.figure or out / "train_head.png"
    console.print(f"\nattention figure: {save_figure(figure, path)}")


if __name__ == "__main__":
    main()
