"""The demo page's work, apart from the page: load the engine in the
background, check a question, answer it with blending and with full prefill,
and say token by token what blending did.

The two answers run one after the other on the one engine, blend first, so
that each time to first token is its own: sent together, vLLM would batch
them, and the blend pass would wait for full prefill's tokens in the same step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..chat import rag_prompt
from ..config import CALIBRATION_SOURCES
from ..engines import Engine, Generation, load_engine
from ..prompt import PromptError, TokenizedPrompt
from ..store import ChunkStore

# The checkout's example documents (the RAG examples'), where the package runs from a checkout.
EXAMPLE_DOCUMENTS = Path(__file__).resolve().parents[2] / "examples" / "data"
MAX_DOCUMENT_FILES = 200  # a folder's documents the page lists
RECOMPUTED, REUSED = "recomputed", "reused from the store"


class AskError(ValueError):
    """A question the page cannot ask; the message says why, for the page to show."""


def load_documents(folder: str | Path) -> dict[str, str]:
    """The ``.txt`` and ``.md`` documents of ``folder`` by file name (empty ones left out)."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"the documents folder {str(path)!r} is not a folder")
    files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".md") and p.is_file())[:MAX_DOCUMENT_FILES]
    documents = {p.name: p.read_text(errors="replace").strip() for p in files}
    return {name: text for name, text in documents.items() if text}


@dataclass
class Answered:
    """One question's two answers, as they stream: ``blend`` and ``full``
    hold the text so far; ``generations`` the finished ``Generation`` of each."""

    prompt: TokenizedPrompt
    blend: str = ""
    full: str = ""
    generations: dict[str, Generation] = field(default_factory=dict)


class DemoSession:
    """One engine for every tab of the page. It loads in a thread, so the
    page is up at once and says what happened if the model fails to load;
    questions take turns on it (``ask`` holds a lock)."""

    def __init__(
        self,
        model: str,
        *,
        backend: str = "vllm",
        store: ChunkStore | None = None,
        max_tokens: int = 48,
        engine_options: dict | None = None,
        label: str | None = None,
    ) -> None:
        self.model = model
        self.label = label or model  # the model's name on the page
        self.backend = backend
        self.store = store
        self.max_tokens = max_tokens
        self.engine_options = engine_options or {}
        self.engine: Engine | None = None
        self.error: str | None = None
        self.load_s: float | None = None
        self._loaded = threading.Event()
        self._turn = threading.Lock()
        self.questions = 0  # questions answered in this session, every tab's
        self.history: list[dict] = []  # per answer (two a question): the question's number, the side, its TTFT (ms)

    def start(self) -> DemoSession:
        threading.Thread(target=self._load, name="blend-ui-load", daemon=True).start()
        return self

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            self.engine = load_engine(self.model, backend=self.backend, store=self.store, **self.engine_options)
        except Exception as exc:  # the page stays up and says why
            self.error = (
                f"the model {self.model!r} failed to load on the {self.backend} engine: {type(exc).__name__}: {exc}"
            )
        self.load_s = time.perf_counter() - started
        self._loaded.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether loading ended (either way) within ``timeout`` seconds."""
        return self._loaded.wait(timeout)

    def status(self) -> str:
        if not self._loaded.is_set():
            return f"Loading {self.label} on the {self.backend} engine..."
        if self.error is not None:
            return f"Error: {self.error}"
        assert self.engine is not None and self.load_s is not None
        return f"Ready: {self.label} on the {self.backend} engine (loaded in {self.load_s:.0f} s)"

    def prompt(self, documents: Sequence[str], question: str) -> TokenizedPrompt:
        """The RAG prompt the chains build, checked: documents chosen, a
        question, and room in the model's context for the answer."""
        engine = self._engine()
        if not documents:
            raise AskError("choose or paste at least one document")
        if not question.strip():
            raise AskError("the question is empty: type a question about the documents")
        try:
            tp = rag_prompt(list(documents), question.strip(), engine.tokenizer, engine.config.separator)
        except PromptError as exc:
            raise AskError(str(exc)) from None
        room = engine.context_length - self.max_tokens
        if len(tp) > room:
            longest = max(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in documents)
            raise AskError(
                f"the prompt has {len(tp)} tokens, but the model's context of {engine.context_length} tokens "
                f"leaves {room} for it after the answer's {self.max_tokens}: choose fewer or shorter documents "
                f"(the longest chosen has {longest} tokens)"
            )
        return tp

    def _engine(self) -> Engine:
        if not self._loaded.is_set():
            raise AskError("the model is still loading: ask again in a moment")
        if self.engine is None:
            raise AskError(self.error or "the model did not load")
        return self.engine

    def ask(self, documents: Sequence[str], question: str, ratio: float | str = "auto") -> Iterator[Answered]:
        """Answer with blending, then with full prefill, yielding as text
        streams; the last ``Answered`` has both generations."""
        tp = self.prompt(documents, question)
        engine = self._engine()
        answered = Answered(tp)
        with self._turn:
            for side, options in (("blend", {"recompute_ratio": ratio}), ("full", {"mode": "full"})):
                stream = engine.stream(tp, max_tokens=self.max_tokens, **options)
                for delta in stream:
                    setattr(answered, side, getattr(answered, side) + delta)
                    yield answered
                answered.generations[side] = stream.result()
            self.questions += 1
            self.history += [
                {"question": self.questions, "answer": side, "ttft_ms": float(f"{1000 * gen.ttft_s:.3g}")}
                for side, gen in answered.generations.items()
            ]
        yield answered


def highlighted(engine: Engine, generation: Generation, prompt: TokenizedPrompt) -> list[tuple[str, str | None]]:
    """The prompt's documents as (text, label) pieces, token by token: label
    ``RECOMPUTED`` for a token whose stored KV blending recomputed, ``REUSED``
    for one it used as stored, None for one computed fresh (a chunk's first
    tokens, a chunk the store missed); a header before each document."""
    reused = {i for start, end in generation.reused_spans or () for i in range(start, end)}
    recomputed = set(generation.recomputed_positions or ())
    pieces: list[tuple[str, str | None]] = []
    for n, (start, end) in enumerate(prompt.chunk_spans, 1):
        pieces.append((f"{'' if n == 1 else chr(10) * 2}[document {n}] ", None))
        for i in range(start, end):
            label = RECOMPUTED if i in recomputed else REUSED if i in reused else None
            text = engine.tokenizer.decode([prompt.token_ids[i]])
            if pieces and pieces[-1][1] == label and label is None:
                pieces[-1] = (pieces[-1][0] + text, None)
            else:
                pieces.append((text, label))
    return pieces


def summary(generation: Generation) -> dict[str, object]:
    """What a pane shows under its answer."""
    usage = generation.usage
    shown: dict[str, object] = {
        "TTFT (ms)": round(1000 * generation.ttft_s),
        "tokens read from the store": usage.cached_tokens,
        "tokens recomputed": usage.recomputed_tokens,
        "ratio": usage.recompute_ratio,
        "ratio source": usage.ratio_source,
        "chunks hit / missed": f"{usage.chunks_hit} / {usage.chunks_missed}",
    }
    if generation.fallback is not None:
        shown["fell back to full prefill"] = generation.fallback
    return shown


def verdict(blend: Generation, full: Generation) -> str:
    """What the page says of the blend side against full prefill. Only a
    real blend (chunks reused, ratio below 1) is a gain to time; a blend
    side that fell back, or that ran as full prefill, says so and why."""
    usage = blend.usage
    if blend.fallback is not None:
        return f"**Blending fell back to full prefill:** {blend.fallback}. Both answers are full prefill's."
    ratio, source = usage.recompute_ratio, usage.ratio_source
    if ratio is not None and ratio >= 1.0:
        if source in CALIBRATION_SOURCES:
            whose = "shipped with this package" if source == "packaged" else "in this store"
            why = f"the calibration for this model ({whose}) chose ratio 1.0: no lower ratio kept its answers"
        elif source == "guard":
            why = "the calibration's per-request guard raised the ratio to 1.0 for this prompt"
        else:
            asked = "the ratio asked for" if source == "request" else f"the ratio ({source})"
            why = f"{asked} is 1.0, so every token read from the store was recomputed"
        return f"**Blending ran as full prefill:** {why}."
    if usage.chunks_hit == 0 or usage.cached_tokens == 0:
        if usage.chunks_computed:
            why = "the loading controller computed the stored documents instead of loading them"
        else:
            why = "the store held none of these documents yet (they are stored now: ask again and they are hits)"
        return f"**Blending ran as full prefill:** {why}."
    speedup = full.ttft_s / blend.ttft_s
    how = f"{usage.recomputed_tokens} of {usage.cached_tokens} stored tokens recomputed"
    if ratio is not None:
        how = f"ratio {ratio:g}, {how}"
    if speedup >= 1:
        return f"Blending answered {speedup:.2f}x sooner than full prefill ({how})."
    return f"Blending answered {1 / speedup:.2f}x later than full prefill ({how})."
