"""Shared test set-up: no hub access, one headless chromium for the browser tests, and
processes spawned as the ranks of a gloo group."""

import importlib.util
import os
import socket
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Before anything imports triton: its kernels run under the interpreter, on CPU tensors, in
# every test file (test_triton.py's and ring attention's alike), whichever runs alone.
os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers (pytest-xdist)
    # One thread each: two workers' OpenMP teams on two cores made torch's tests up to 14
    # times slower. And no COLUMNS: a worker starts with COLUMNS=80, which the CLI's rich
    # console, made at import, would keep through the tests that set their own width.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("COLUMNS", None)

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    # playwright drives it: without it (an environment with chromium but without the [dev]
    # extras' playwright) every browser test erred at the fixture's import.
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="needs playwright to drive chromium (pip install playwright)",
    ),
]


@pytest.fixture(scope="module")
def hf_minilm():
    """Hugging Face's all-MiniLM-L6-v2, eager attention (its weights are the oracle's)."""
    transformers = pytest.importorskip("transformers")
    from selfattn.models.loading import resolve

    folder, _ = resolve("minilm")
    return transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright, headless, with no background network traffic."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-sync",
            ],
        )
        yield browser
        browser.close()


TRAINING_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\n"
    "Resolved. resolved.\n\n"
) * 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small training text file (a tiny char model learns it in seconds)."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(TRAINING_TEXT)
    return path


@pytest.fixture
def one_thread():
    """Tiny models run fastest, and steadiest on a busy machine, on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class WatchedPage:
    """A chromium page of the explorer with its console errors, uncaught exceptions, dialogs
    and requests recorded, and readers for the step panel's full-precision numbers."""

    def __init__(self, browser) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def step_rows(self) -> list[dict]:
        """Per key of the step panel: score and scaled (None for the head mean), weight."""
        return self.page.evaluate(
            """() => [...document.querySelectorAll('#steps tbody tr')].map((tr) => {
                const number = (name) => {
                    const cell = tr.querySelector(`[data-${name}]`);
                    return cell ? +cell.dataset[name] : null;
                };
                return {key: +tr.dataset.key, score: number('score'),
                        scaled: number('scaled'), weight: number('weight')};
            })"""
        )

    def output(self) -> list[float]:
        return self.page.evaluate(
            "() => JSON.parse(document.getElementById('output').dataset.values)"
        )


class OfflinePage(WatchedPage):
    """A self-contained page (``selfattn view``, ``generate --html``) opened from its file,
    in a colour scheme, ready once its ``#app`` says so."""

    def __init__(self, browser, path: Path, fragment: str = "", color_scheme: str = "light"):
        super().__init__(browser)
        self.page.emulate_media(color_scheme=color_scheme)
        self.url = path.as_uri()
        self.page.goto(self.url + fragment)
        self.page.wait_for_selector("#app[data-ready='true']", timeout=30_000)

    def check_clean(self) -> None:
        """No error, and no request but the file itself."""
        assert self.errors == []
        assert [url for url in self.requests if url != self.url] == []


def patch_triton_language_once() -> None:
    """Triton's interpreter patches ``triton.language`` anew on every call of a
    ``@triton.jit`` helper inside a kernel (``inspect.getmembers`` over the language each
    time), though the kernel's launch has patched it already and keeps it so until it returns:
    about a third of an interpreted kernel's time. Skip the patch where the language is
    patched already; the kernels compute the same. No change on a Triton whose interpreter is
    laid out otherwise."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter

        patch, nothing_patched = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    if getattr(patch, "once", False):
        return

    def patch_once(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return nothing_patched()  # a launch is running and has patched these already
        return patch(fn)

    patch_once.once = True
    interpreter._patch_lang = patch_once


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(worker, ranks: int, *args, seconds: float = 60) -> None:
    """``worker(rank, port, *args)`` in ``ranks`` spawned processes, ``port`` free for their
    rendezvous; fail after ``seconds`` (a worker's exception is raised here)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker, args=(free_port(), *args), nprocs=ranks, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{ranks} spawned ranks did not finish within {seconds:.0f} s")


class Bound:
    """What `server.listen` returns in tests of `selfattn serve`, without binding anything:
    the address asked for, equal to it."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)

    def getsockname(self) -> tuple[str, int]:
        return self.address

    def close(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return other == self.address


def char_gpt(alphabet: str, block_size: int):
    """A character-level GPT as `selfattn train` builds it, untrained (seed 0): 2 layers of 2
    heads, 16 wide, as a ``selfattn.Model``."""
    import torch

    from selfattn.models.gpt import GPT, GPTConfig
    from selfattn.models.model import Model, ModelConfig
    from selfattn.text import Tokenizer
    from selfattn.train.data import CharTokenizer

    torch.manual_seed(0)
    chars = CharTokenizer.from_text(alphabet)
    config = GPTConfig(
        vocab_size=chars.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=16
    )
    info = ModelConfig.for_decoder(config, "gpt")
    return Model(GPT(config), info, name="char", tokenizer=Tokenizer(chars.to_hf())).eval()


def randomise_norms(model, seed: int = 0) -> None:
    """Add seeded N(0, 0.2) noise to every norm's 1-D parameters (names with "norm" or an
    ``ln`` part) of a Hugging Face model before it is saved: its classes make them all 1
    (0 for Gemma's 1 + weight, and for biases), which hides a swapped or misplaced norm."""
    import re

    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and re.search(r"norm|(^|[._])ln", name, re.IGNORECASE):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
