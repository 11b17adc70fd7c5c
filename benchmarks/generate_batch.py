"""Generation for 8 prompts at once against 8 single calls, on the CPU.

``Model.generate(prompts, 50, temperature=0)`` (one left-padded batch, one forward pass per
step) against ``[Model.generate(p, 50, temperature=0) for p in prompts]``, on a random GPT
(GPT-2's block: learned positions, LayerNorm, GELU) and a random Llama (RoPE, RMSNorm, SwiGLU,
grouped-query attention 8/2), each 4 layers, 256 wide, 256 positions, a vocabulary of 32,000
words (a word-level tokenizer built here: no downloads). Prompts of 4 to 64 words; float32,
one thread (``torch.set_num_threads(1)``), the key/value cache on. Both ways are warmed up,
then timed in interleaved rounds; prints the best and median seconds and the speed-up (best
against best), and whether every batched text equals its single call's (weights drawn
N(0, 0.3), so that greedy steps are far from ties). The seconds are this process's CPU time
(``time.process_time``): on one thread it is the wall time of an idle machine, and on a
shared one other jobs' load stretches the wall time far more than it (time waiting for a
core is not counted).

    python benchmarks/generate_batch.py              # 5 rounds (~1 min)
    python benchmarks/generate_batch.py --rounds 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from selfattn.models.gpt import GPT, Decoder, GPTConfig
from selfattn.models.llama import Llama, LlamaConfig, llama_hidden_size
from selfattn.models.model import Model, ModelConfig
from selfattn.text import Tokenizer

VOCAB, WIDTH, LAYERS, POSITIONS, NEW_TOKENS = 32_000, 256, 4, 256, 50
PROMPT_WORDS = [4, 9, 15, 22, 30, 40, 52, 64]


def networks() -> dict[str, Decoder]:
    """The two random decoders, by name."""
    gpt = GPT(GPTConfig(VOCAB, block_size=POSITIONS, n_layer=LAYERS, n_head=4, n_embd=WIDTH))
    llama = Llama(
        LlamaConfig(
            VOCAB,
            d_model=WIDTH,
            n_layers=LAYERS,
            n_heads=8,
            n_kv_heads=2,
            head_dim=WIDTH // 8,
            d_ff=llama_hidden_size(WIDTH),
            max_positions=POSITIONS,
        )
    )
    return {"gpt": gpt, "llama": llama}


def model(network: Decoder, name: str) -> Model:
    """``network`` with weights N(0, 0.3) and a word-level tokenizer of VOCAB words."""
    with torch.no_grad():
        for parameter in network.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.3)
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    info = ModelConfig.for_decoder(network.config, name)
    return Model(network, info, name=name, tokenizer=Tokenizer(backend)).eval()


def timed(run: Callable[[], object], times: list[float]) -> None:
    """Run ``run`` once and append its CPU time in seconds to ``times``."""
    start = time.process_time()
    run()
    times.append(time.process_time() - start)


def measured(decoder: Model, prompts: list[str], rounds: int) -> str:
    """One markdown row: 8 single calls against one batch, interleaved ``rounds`` times."""

    def single() -> list[str]:
        return [decoder.generate(prompt, NEW_TOKENS, temperature=0.0) for prompt in prompts]

    def batch() -> list[str]:
        return decoder.generate(prompts, NEW_TOKENS, temperature=0.0)

    same = single() == batch()  # also the warm-up
    single_times: list[float] = []
    batch_times: list[float] = []
    for _ in range(rounds):
        timed(single, single_times)
        timed(batch, batch_times)
    s, b = min(single_times), min(batch_times)
    return (
        f"| {decoder.name} | {s:.2f} (median {statistics.median(single_times):.2f}) | {b:.2f} "
        f"(median {statistics.median(batch_times):.2f}) | {s / b:.1f}x | {same} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of both ways")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    words = torch.randint(1, VOCAB, (max(PROMPT_WORDS),)).tolist()
    prompts = [" ".join(f"w{i}" for i in words[:n]) for n in PROMPT_WORDS]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    print(f"{len(prompts)} prompts of {PROMPT_WORDS[0]}-{PROMPT_WORDS[-1]} tokens, "
          f"{NEW_TOKENS} new tokens each, greedy\n")  # fmt: skip
    print("| model | 8 single calls (CPU s) | one batch of 8 (CPU s) | speed-up | same texts |")
    print("|---|---|---|---|---|")
    for name, network in networks().items():
        print(measured(model(network, name), prompts, args.rounds))


if __name__ == "__main__":
    main()
