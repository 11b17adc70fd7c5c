"""Train nanoGPT's shakespeare_char CPU configuration and report loss, speed and a sample.

The configuration is the ``shakespeare-char-cpu`` preset: 4 layers, 4 heads, 128 wide, block 64,
batch 12, 2,000 steps, lr 1e-3 -> 1e-4 (100 warm-up, cosine to step 2,000), AdamW beta2 0.99,
weight decay 0.1, no dropout, no bias, 20 evaluation batches every 250 steps. nanoGPT reports
val loss 1.88 for it. Also draws one trained head's attention on a line of the play.

    python benchmarks/train_shakespeare.py                      # ~2-3 minutes on 2 cores
    python benchmarks/train_shakespeare.py --max-iters 100      # a quick check of the script
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from selfattn import record
from selfattn.train import TextData, train_gpt
from selfattn.viz.figures import heatmap_figure, save_figure

REPO = Path(__file__).resolve().parents[1]
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


@torch.no_grad()
def whole_split_loss(model: torch.nn.Module, ids: torch.Tensor, batch_size: int = 256) -> float:
    """Mean next-character loss over the split cut into consecutive block-size windows: the
    exact held-out loss, where the 20 random evaluation batches are an estimate."""
    block = model.config.block_size
    n = (len(ids) - 1) // block
    x, y = ids[: n * block].view(n, block), ids[1 : n * block + 1].view(n, block)
    total = sum(
        model(x[i : i + batch_size], y[i : i + batch_size]).loss.item() * len(x[i : i + batch_size])
        for i in range(0, n, batch_size)
    )
    return total / n


def main() -> None:
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
        "--out", type=Path, default=None, help="checkpoint directory (default: a temporary one)"
    )
    parser.add_argument(
        "--figure",
        type=Path,
        default=REPO / "docs/train_head.png",
        help="where to draw one trained head's attention",
    )
    parser.add_argument("--layer", type=int, default=1, help="layer of the drawn head")
    parser.add_argument("--head", type=int, default=0, help="the drawn head")
    args = parser.parse_args()  # fmt: skip

    torch.set_num_threads(args.threads)
    console = Console()
    out = args.out or Path(tempfile.mkdtemp(prefix="shakespeare-char-"))
    start = time.perf_counter()
    overrides = {"max_iters": args.max_iters, "seed": args.seed}
    run = train_gpt(
        args.data, out, preset="shakespeare-char-cpu", overrides=overrides, device="cpu",
        console=console,
    )  # fmt: skip
    wall = time.perf_counter() - start
    result = run.result

    console.print("\n| step | train loss | val loss |\n|---:|---:|---:|")
    for entry in result.history:
        train = f"{entry['train']:.4f}" if "train" in entry else "–"
        console.print(f"| {entry['step']} | {train} | {entry['val']:.4f} |")
    console.print(
        f"\nval loss {result.history[-1]['val']:.4f} at step {result.step}; "
        f"{result.ms_per_iter:.1f} ms/iter, {result.tokens_per_second:,.0f} tokens/s "
        f"(training steps only); wall time {wall:.1f} s (with evaluation, checkpoints, start-up); "
        f"torch {torch.__version__}, {args.threads} threads; checkpoint in {out}"
    )

    model, tokenizer = run.model, run.tokenizer
    held_out = whole_split_loss(model, TextData.from_file(args.data, 64, tokenizer).val)
    console.print(
        f"val loss on the whole held-out split (every 64-character window): {held_out:.4f}"
    )
    ids = torch.tensor([tokenizer.encode("\n")])
    sample = model.generate(ids, 300, temperature=0.8, top_k=200, seed=1337)
    console.print("\nsample (temperature 0.8, top-k 200, seed 1337):\n", markup=False)
    console.print(tokenizer.decode(sample[0]), markup=False)

    text = PROMPT[: model.config.block_size]
    with record(model) as recording, torch.no_grad():
        model(torch.tensor([tokenizer.encode(text)]))
    weights = recording[args.layer].weights(args.head)  # (T, T)
    labels = [repr(char)[1:-1] if char in "\n " else char for char in text]
    labels = ["␣" if char == " " else char for char in labels]
    figure = heatmap_figure(
        weights, labels, labels,
        f"shakespeare_char model after {result.step} steps: layer {args.layer}, head {args.head}",
    )  # fmt: skip
    console.print(f"\nattention figure: {save_figure(figure, args.figure)}")


if __name__ == "__main__":
    main()
