"""Sentence embeddings on the CPU: our ``Model.encode``, transformers and sentence-transformers.

all-MiniLM-L6-v2 (the installed default model), float32, ``torch.set_num_threads(2)``, on a
fixed corpus of 2,048 English sentences of 5 to 60 words (uniform), drawn from a seeded RNG
over the word list below. Three implementations of the same pipeline (tokenize with the
checkpoint's tokenizer.json, cut at 256 tokens, encode, mean-pool over real tokens, L2-normalise):

- ours: ``selfattn.load("minilm").encode(texts, batch_size=...)``;
- transformers: ``AutoModel`` with ``attn_implementation="sdpa"``, tokenized by the
  ``tokenizers`` library, batches in order of length (as sentence-transformers does), each
  padded to its longest, mean pooling and normalisation as in sentence-transformers;
- sentence-transformers: ``SentenceTransformer(folder).encode(..., normalize_embeddings=True)``.

All are loaded and warmed up first; then each timed round runs every implementation once over
the whole corpus, interleaved, so that a busy neighbour slows them alike. Prints a markdown
table: sentences/s (best and median of the rounds), ours/sentence-transformers (best against
best), and the agreement with sentence-transformers (minimum cosine over all 2,048 sentences).

    python benchmarks/encode.py                   # batch 32 and 128, 3 timed rounds (~4 min)
    python benchmarks/encode.py --rounds 1 --batch-sizes 32   # a shorter run
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import selfattn
from selfattn.models.loading import resolve

N_SENTENCES = 2048
MIN_WORDS, MAX_WORDS = 5, 60
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length
WORDS = """
the a an of to in on at by for with from about over under after before between through and or
but because while if when where which who that this these those it they we you he she I my our
their his her its time year day week morning evening night world city country river bank money
market house school road car train book paper letter story language word sentence question
answer idea plan problem reason result system model network attention memory computer data
number value table chart garden tree flower water fire stone mountain sea rain wind sun moon
light music song film picture game team player teacher student doctor friend family child
people company government office price cost loan account deposit saving coffee bread dinner
walk run read write speak listen learn teach build open close find keep give take make see
look think know believe remember forget choose change grow move carry send bring buy sell pay
good new old great small large long short early late young quiet happy careful simple strong
bright dark warm cold heavy light fast slow quickly slowly often never always sometimes again
together almost really very still already soon today tomorrow yesterday here there
""".split()


def corpus(n: int = N_SENTENCES, seed: int = 0) -> list[str]:
    """``n`` sentences of MIN_WORDS..MAX_WORDS words (uniform), the same on every run."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(MIN_WORDS, MAX_WORDS))
        sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
    return sentences


def ours(folder: str) -> Callable[[list[str], int], Tensor]:
    """Our model and ``Model.encode``, exactly as a user calls them."""
    model = selfattn.load(folder)
    return lambda texts, batch_size: model.encode(texts, batch_size=batch_size, progress=False)


def transformers_sdpa(folder: str) -> Callable[[list[str], int], Tensor]:
    """Hugging Face's BertModel on torch SDPA, batched and pooled as sentence-transformers does."""
    from tokenizers import Tokenizer
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.enable_padding()  # to the longest of each batch

    def encode(texts: list[str], batch_size: int) -> Tensor:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        embeddings = torch.empty(len(texts), model.config.hidden_size)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                encodings = tokenizer.encode_batch([texts[i] for i in batch])
                input_ids = torch.tensor([e.ids for e in encodings])
                mask = torch.tensor([e.attention_mask for e in encodings])
                hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
                embeddings[batch] = F.normalize(pooled, dim=-1)
        return embeddings

    return encode


def sentence_transformers(folder: str) -> Callable[[list[str], int], Tensor]:
    """The reference: the checkpoint's own pipeline (Transformer, Pooling, Normalize)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")

    def encode(texts: list[str], batch_size: int) -> Tensor:
        return model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_tensor=True,
            show_progress_bar=False,
        )

    return encode


IMPLEMENTATIONS = {
    "ours": ours,
    "transformers (sdpa)": transformers_sdpa,
    "sentence-transformers": sentence_transformers,
}
REFERENCE = "sentence-transformers"


def timed(
    encode: Callable[[list[str], int], Tensor], texts: list[str], batch_size: int
) -> tuple[float, Tensor]:
    """Seconds for one pass over ``texts``, and the embeddings."""
    start = time.perf_counter()
    embeddings = encode(texts, batch_size)
    return time.perf_counter() - start, embeddings


def token_counts(folder: str, texts: list[str]) -> list[int]:
    """Tokens per text as every implementation sees them (special tokens in, cut at 256)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads every text to 128 by default
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[32, 128], help="sentences per batch"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the corpus")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or args.rounds < 1:  # before the three models load
        parser.error("--batch-sizes and --rounds must be at least 1")

    torch.set_num_threads(2)
    folder = str(resolve("minilm")[0])
    texts = corpus()
    tokens = sum(token_counts(folder, texts))
    encoders = {name: build(folder) for name, build in IMPLEMENTATIONS.items()}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{len(texts)} sentences, {tokens} tokens ({tokens / len(texts):.1f} per sentence)\n")
    print(
        "| batch | implementation | sentences/s (best) | median | vs sentence-transformers "
        "| min cosine to sentence-transformers |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for batch_size in args.batch_sizes:
        for encode in encoders.values():  # warm-up: first-call allocations, thread pools
            encode(texts[: batch_size * 2], batch_size)
        seconds: dict[str, list[float]] = {name: [] for name in encoders}
        embeddings: dict[str, Tensor] = {}
        for _ in range(args.rounds):
            for name, encode in encoders.items():
                elapsed, embeddings[name] = timed(encode, texts, batch_size)
                seconds[name].append(elapsed)
        reference_best = min(seconds[REFERENCE])
        for name in encoders:
            best, median = min(seconds[name]), statistics.median(seconds[name])
            cosine = F.cosine_similarity(embeddings[name], embeddings[REFERENCE], dim=-1).min()
            print(
                f"| {batch_size} | {name} | {len(texts) / best:.0f} | {len(texts) / median:.0f} "
                f"| {reference_best / best:.2f}x | {cosine.item():.7f} |",
                flush=True,
            )
    print(f"\nload average after the run: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
