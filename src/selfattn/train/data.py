"""Character-level text data: the tokenizer, the 90/10 split, and seeded random batches.

The same scheme as nanoGPT's shakespeare_char: the vocabulary is every character of the text,
sorted; the first 90% of the text trains, the last 10% is held out; a batch is ``batch_size``
windows of ``block_size + 1`` characters at random offsets, inputs and next-character targets.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import stat
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from tokenizers import Regex, decoders, models, pre_tokenizers
from torch import Tensor

from selfattn.errors import SelfAttnError, is_integer
from selfattn.text import LONE_SURROGATE, quoted_characters

TRAIN_FRACTION = 0.9
SPLITS = ("train", "val")
UNICODE_SIZE = 0x110000  # code points
ENCODE_CHUNK = 1 << 24  # characters encoded at a time (64 MB of UTF-32)


class CharTokenizer:
    """One token per character; ids follow the sorted vocabulary."""

    def __init__(self, chars: str) -> None:
        if not isinstance(chars, str):
            raise ValueError(f"the vocabulary is a {type(chars).__name__}, not a string")
        if not chars or len(set(chars)) != len(chars):
            raise ValueError("a character vocabulary needs distinct characters, at least one")
        surrogate = LONE_SURROGATE.search(chars)
        if surrogate:  # no text holds one (UTF-8 cannot), and tokenizers refuses it
            raise ValueError(
                f"the vocabulary holds a lone surrogate ({surrogate.group()!r}), which is no "
                "character"
            )
        self.chars = chars
        self._ids = {char: i for i, char in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of ``text``: each character it holds, once, in code point order."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """The number of characters, and so of token ids (0 .. vocab_size - 1)."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """One id per character; a character outside the vocabulary is refused by name."""
        self._refuse_unknown(self.unknown_characters(text))
        return [self._ids[char] for char in text]

    @staticmethod
    def _refuse_unknown(unknown: str) -> None:
        if unknown:
            raise SelfAttnError(
                f"characters not in the model's vocabulary: {unknown}; "
                "use only characters of the training text"
            )

    def encode_tensor(self, text: str) -> Tensor:
        """``encode(text)`` as an int64 tensor, without a Python int per character: a 200 MB
        text encodes in seconds, where a list of ids took over 20 s and 3.5 GB."""
        table = torch.full((UNICODE_SIZE,), -1, dtype=torch.long)  # code point -> id
        table[[ord(char) for char in self.chars]] = torch.arange(self.vocab_size)
        ids = torch.empty(len(text), dtype=torch.long)
        for start in range(0, len(text), ENCODE_CHUNK):
            piece = text[start : start + ENCODE_CHUNK]
            points = torch.frombuffer(
                bytearray(piece.encode("utf-32-le", "surrogatepass")), dtype=torch.int32
            )
            torch.index_select(table, 0, points, out=ids[start : start + len(piece)])
        if bool((ids < 0).any()):
            self._refuse_unknown(self.unknown_characters(text))
        return ids

    def unknown_characters(self, text: str) -> str:
        """The characters of ``text`` outside the vocabulary, quoted ("" if none)."""
        unknown = set(text) - self._ids.keys()
        return quoted_characters(unknown) if unknown else ""

    def decode(self, ids: list[int] | Tensor) -> str:
        """The text of ``ids`` (a list or a 1-D tensor), one character per id."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    def tokens(self, text: str) -> list[str]:
        """The text as the model sees it: one token string per character."""
        self.encode(text)
        return list(text)

    def to_hf(self) -> tokenizers.Tokenizer:
        """The same vocabulary as a Hugging Face tokenizer (one token per character, with
        character offsets), for the viewers that read checkpoints through ``tokenizers``."""
        backend = tokenizers.Tokenizer(models.WordLevel(self._ids, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        return backend

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash(self.chars)

    def save(self, path: str | Path) -> None:
        """The vocabulary as JSON, ``{"type": "char", "chars": ...}``, in UTF-8."""
        text = json.dumps({"type": "char", "chars": self.chars}, ensure_ascii=False)
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        """The tokenizer :meth:`save` wrote to ``path``."""
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["chars"])


@dataclass(frozen=True)
class TextData:
    """A text file as token ids, split into the first 90% (train) and the rest (val)."""

    tokenizer: CharTokenizer
    train: Tensor  # (N_train,) int64
    val: Tensor  # (N_val,) int64

    @classmethod
    def from_file(
        cls, path: str | Path, block_size: int, tokenizer: CharTokenizer | None = None
    ) -> TextData:
        """Read, encode and split ``path``; each split must hold at least one window."""
        return cls.from_text(read_text(path), block_size, tokenizer, source=path)

    @classmethod
    def from_text(
        cls,
        text: str,
        block_size: int,
        tokenizer: CharTokenizer | None = None,
        source: Path | str = "the text",
    ) -> TextData:
        """Encode and split ``text`` (read from ``source``, which errors name)."""
        tokenizer = tokenizer or CharTokenizer.from_text(text)
        ids = tokenizer.encode_tensor(text)
        n_train = int(TRAIN_FRACTION * len(ids))
        data = cls(tokenizer, ids[:n_train], ids[n_train:])
        shortest = min(len(data.train), len(data.val))
        if shortest < block_size + 1:
            split = (  # the validation split, except in a text of one character
                "training split (the first 90%)"
                if len(data.train) < len(data.val)
                else "validation split (the last 10%)"
            )
            raise SelfAttnError(
                f"{source} is too short for block size {block_size}: its {len(ids)} characters "
                f"give a {shortest}-character {split}, and each split needs at least "
                f"{block_size + 1}; use more text or a smaller --block-size"
            )
        return data


def read_text(path: str | Path) -> str:
    """The file's text, without the byte-order mark some editors put first (it would become a
    character of the vocabulary); a one-line error if it is missing, a folder, no regular file
    (a device, a pipe: each process of a distributed run reads the file, and a pipe gives its
    text to one), unreadable or empty."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise SelfAttnError(
            f"data file {path} does not exist; pass a text file with --data"
        ) from None
    except OSError as error:
        raise SelfAttnError(f"cannot read {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise SelfAttnError(f"data file {path} is a folder; pass a text file with --data")
    if not stat.S_ISREG(mode):
        raise SelfAttnError(
            f"data file {path} is {_file_kind(mode)}, not a regular file; pass a text file "
            "with --data (to train on a command's output, save it to a file first)"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        with path.open("rb") as file:  # the decoder counts from after a byte-order mark
            at = error.start + (len(codecs.BOM_UTF8) if file.read(3) == codecs.BOM_UTF8 else 0)
        raise SelfAttnError(
            f"{path} is not UTF-8 text ({error.reason} at byte {at}); convert it "
            f"first, e.g. iconv -f latin1 -t utf-8 {path} > {path.with_stem(path.stem + '-utf8')}"
        ) from None
    except OSError as error:
        raise SelfAttnError(f"cannot read {path}: {error.strerror or error}") from None
    if not text:
        raise SelfAttnError(f"data file {path} is empty; pass a file with text in it")
    return text


def _file_kind(mode: int) -> str:
    """What a file that is not a regular one or a folder is, for a message."""
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


class RandomBatches:
    """Random windows of the whole split, drawn by this process's own seeded generators.

    There is no sharding, as in nanoGPT: each rank draws from generators seeded from ``(seed,
    rank, split)``, so ranks read different batches (windows may overlap) and the batch
    stream is reproducible; drawing validation batches never moves the training stream.
    ``start_evaluation(step)`` reseeds the validation generator from ``(seed, rank, step)``:
    an evaluation's batches depend on its step only, not on the evaluations before it (a
    resumed run's equal a straight run's). ``state_dict`` holds the generator states for an
    exact resume.
    """

    def __init__(
        self, data: TextData, batch_size: int, block_size: int, seed: int, rank: int = 0
    ) -> None:
        for name, size in (("batch_size", batch_size), ("block_size", block_size)):
            if not is_integer(size, 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {size!r}")
        for split in SPLITS:
            if len(getattr(data, split)) <= block_size:
                raise ValueError(
                    f"the {split} split holds {len(getattr(data, split))} tokens, too few for "
                    f"one window of block_size {block_size} and its next token; lower block_size"
                )
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        # (N - block, block + 1) overlapping views: row i is tokens i .. i + block
        self.windows = {
            split: getattr(data, split).unfold(0, block_size + 1, 1) for split in SPLITS
        }
        self.generators = {
            split: torch.Generator().manual_seed(batch_seed(seed, rank, split)) for split in SPLITS
        }

    def batch(self, split: str) -> tuple[Tensor, Tensor]:
        """Inputs and targets, each (batch_size, block_size), of the given split."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        windows = self.windows[split]
        starts = torch.randint(len(windows), (self.batch_size,), generator=self.generators[split])
        rows = windows[starts]  # (B, block + 1)
        return rows[:, :-1], rows[:, 1:]

    def start_evaluation(self, step: int) -> None:
        """Draw the validation batches of the evaluation at ``step`` from now on."""
        self.generators["val"].manual_seed(evaluation_seed(self.seed, self.rank, step))

    def state_dict(self) -> dict[str, Tensor]:
        return {split: generator.get_state() for split, generator in self.generators.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for split, generator in self.generators.items():
            generator.set_state(state[split])


def batch_seed(seed: int, rank: int, split: str) -> int:
    """A distinct generator seed for each (seed, rank, split)."""
    return seed * 1_000_003 + 2 * rank + SPLITS.index(split)


def evaluation_seed(seed: int, rank: int, step: int) -> int:
    """A distinct generator seed for each (seed, rank, step), within torch's [0, 2⁶⁴)."""
    digest = hashlib.blake2b(f"{seed} {rank} {step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
