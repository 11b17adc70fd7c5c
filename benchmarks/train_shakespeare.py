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
from selfattn.train import train_gpt
from selfattn.viz.figures import heatmap_figure, save_figure

REPO = Path(__file__).resolve().parents[1]
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


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
    run = train_gpt(
        args.data, out, preset="shakespeare-char-cpu", overrides={"max_iters": args.max_iters},
        device="cpu", console=console,
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
        weights, labels, labels, f"trained shakespeare_char model, layer {args.layer}, "
        f"head {args.head} (rows: queries, columns: keys)",
    )  # fmt: skip
    console.print(f"\nattention figure: {save_figure(figure, args.figure)}")


if __name__ == "__main__":
    main()
