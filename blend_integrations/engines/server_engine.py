"""Engines layer: a client engine for a blend-enabled vLLM server (``python -m blend_integrations.serve``).

Prompts are tokenized here, chunk by chunk, and sent as token ids with their
chunk spans in ``kv_transfer_params``, so the server never re-tokenizes
joined text. ``generate`` makes one plain completion request and gets the
blend usage back; ``stream`` uses server-sent events and has the real time to
first token, and the blend usage from the stream's last event (which the
server's middleware adds: ``stream_usage``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence

from typing_extensions import Unpack

from ..calibration import CalibrationError, CalibrationRecord
from ..config import BlendConfig, check_kv_codec
from ..prompt import BlendPrompt, PromptInput, TextOrIds
from .base import Engine, GenerateOptions, Generation, GenerationStream, Request, Usage
from .vllm_contract import blend_results, kv_transfer_params

API_KEY_ENV = "BLEND_API_KEY"


class ServerError(RuntimeError):
    """The server answered with an error, or could not be reached. ``status``:
    the HTTP status, or None if there was no answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


CALIBRATION_PATH = "/v1/blend/calibration"  # served by ``serve.CalibrationRoute``


class ServerEngine(Engine):
    backend = "server"

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: str | None = None,
        config: BlendConfig | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        """base_url: e.g. ``http://127.0.0.1:8000``. tokenizer: a path or hub id
        (default: the model the server reports, which works on its machine).
        config: only ``separator`` matters here; the server has its own ratio.
        api_key: the key of a server started with ``--api-key`` (default:
        ``$BLEND_API_KEY``), sent as ``Authorization: Bearer``."""
        from transformers import AutoTokenizer

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"the server's base_url must be an http:// or https:// URL, got {base_url!r:.80}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        card = self._request_http("GET", "/v1/models")["data"][0]
        self.model_name = card["id"]
        self.context_length = int(card["max_model_len"])
        self.config = config or BlendConfig()
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer or card["root"])
        self.store = None  # type: ignore[assignment]  # the server's store is on the server
        self._kv_codec: str | None = None

    @property
    def tokenizer(self):
        return self._tokenizer

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        raise NotImplementedError("chunk keys depend on the served checkpoint; the server computes them")

    @property
    def calibrations(self):
        raise NotImplementedError(
            "a server engine's calibration is in the server's store: engine.calibration() reads it, "
            "engine.calibrate(documents) measures and stores it"
        )

    @property
    def kv_codec(self) -> str | None:
        """The server's store's KV codec, as its last ``served_model`` said."""
        return self._kv_codec

    def served_model(self) -> dict:
        """The server's ``GET /v1/blend/calibration``: the served model's name,
        fingerprint, KV dtype and layers, the server's blend settings, and its
        calibration record (None if none)."""
        info = self._request_http("GET", CALIBRATION_PATH)
        expected = {"model": str, "fingerprint": str, "dtype": str, "num_layers": int, "settings": dict}
        wrong = [k for k, kind in expected.items() if not isinstance(info.get(k), kind)]
        if wrong or not (info.get("record") is None or isinstance(info["record"], dict)):
            raise ServerError(f"GET {CALIBRATION_PATH}: the answer lacks or mistypes {', '.join(wrong) or 'record'}")
        try:
            check_kv_codec(info.get("kv_codec"))
        except ValueError as e:
            raise ServerError(f"GET {CALIBRATION_PATH}: {e}") from None
        return info

    def calibration(self) -> CalibrationRecord | None:
        """The calibration record the server's ``recompute_ratio="auto"`` uses (None: its fallback)."""
        info = self.served_model()
        if info["record"] is None:
            return None
        return CalibrationRecord.from_bytes(
            json.dumps(info["record"]).encode(),
            fingerprint=info["fingerprint"],
            dtype=info["dtype"],
            num_layers=info["num_layers"],
        )

    def calibration_source(self) -> str:
        """Where the server's calibration comes from ("calibrated", "packaged" or "fallback")."""
        source = self.served_model().get("source")
        if source not in ("calibrated", "packaged", "fallback"):
            raise ServerError(f"GET {CALIBRATION_PATH}: the answer lacks or mistypes source")
        return source

    def calibration_meaning(self) -> str | None:
        meaning = self.served_model().get("meaning")
        return meaning if isinstance(meaning, str) else None

    def calibrate(self, documents: Sequence[str] | None = None, **options) -> CalibrationRecord:
        """Calibrate the served model over HTTP (``Engine.calibrate``) from the
        server's own blend settings, and store the record in the server's
        store, where its connector uses it. Times to first token are measured
        here, to the whole (``tokens``-long) answer, network included: a
        speedup measured so is lower than the server's own. Calibrations of
        one server from two clients at once are not refused here: both
        records are complete, and the one stored last is used."""
        info = self.served_model()
        self.fingerprint, self.dtype_name, self.num_layers = info["fingerprint"], info["dtype"], info["num_layers"]
        self._kv_codec = info.get("kv_codec")  # absent from servers before KV codecs: raw
        self.config = self.config.with_settings(info["settings"], num_layers=self.num_layers)
        return super().calibrate(documents, **options)

    def stored_documents(self, limit: int = 256) -> list[str]:
        raise CalibrationError(
            "calibrating a server needs documents (or prompts) to probe with: its store's chunks are on the server"
        )

    def calibration_lock(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def keep_calibration(self, record: CalibrationRecord) -> None:
        self._request_http("PUT", CALIBRATION_PATH, json.loads(record.to_bytes()))

    def __repr__(self) -> str:
        return f"ServerEngine({self.base_url!r}, model={self.model_name!r})"

    def _request_http(self, method: str, path: str, body: dict | None = None, stream: bool = False):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 401:
                hint = (
                    "pass api_key= (or set $BLEND_API_KEY) with the server's key"
                    if not self._api_key
                    else "the api_key given is not one of the server's keys"
                )
                raise ServerError(f"{method} {path} failed with HTTP 401 (unauthorized): {hint}", 401) from exc
            raise ServerError(f"{method} {path} failed with HTTP {exc.code}: {detail}", exc.code) from exc
        except urllib.error.URLError as exc:
            raise ServerError(f"cannot reach the blend server at {self.base_url}: {exc.reason}") from exc
        if stream:
            return resp
        with resp:
            return json.loads(resp.read())

    def _body(self, req: Request, stream: bool) -> dict:
        tp = req.prompt
        body = {
            "model": self.model_name,
            "prompt": tp.token_ids,
            "max_tokens": min(req.max_tokens, self.context_length - len(tp)),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if req.stop:
            body["stop"] = req.stop
        if req.seed is not None:
            body["seed"] = req.seed
        if req.logprobs is not None:
            body["logprobs"] = req.logprobs
            body["return_tokens_as_token_ids"] = True  # logprob keys "token_id:<id>"
        params = kv_transfer_params(req)
        if params:
            body["kv_transfer_params"] = params
        return body

    def _run(self, req: Request, stream: GenerationStream) -> Iterator[str]:
        text, ttft, finish, n_tokens = [], None, "length", 0
        answer = None  # the connector's, from the event the middleware adds at the end
        with self._request_http("POST", "/v1/completions", self._body(req, stream=True), stream=True) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("usage"):
                    n_tokens = event["usage"]["completion_tokens"]
                if "kv_transfer_params" in event:
                    answer = event["kv_transfer_params"]
                if not event.get("choices"):
                    continue
                choice = event["choices"][0]
                if ttft is None:
                    ttft = time.perf_counter() - req.started
                if choice["text"]:
                    text.append(choice["text"])
                    yield choice["text"]
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        blend, loading, fallback = blend_results(answer)
        stream.generation = Generation(
            text="".join(text),
            token_ids=[],
            prompt_token_ids=list(req.prompt.token_ids),
            finish_reason="length" if finish == "length" else "stop",
            ttft_s=ttft if ttft is not None else time.perf_counter() - req.started,
            usage=Usage(prompt_tokens=len(req.prompt), completion_tokens=n_tokens, **blend),
            mode=req.mode,
            total_s=time.perf_counter() - req.started,
            loading=loading,
            fallback=fallback,
        )

    def generate(self, prompt: PromptInput, **options: Unpack[GenerateOptions]) -> Generation:
        """One completion request; ``ttft_s`` is the time to the whole answer here
        (a plain response has no first token to time; use ``stream`` for that)."""
        req = self._request(prompt, **options)
        body = self._body(req, stream=False)
        body["return_token_ids"] = True
        resp = self._request_http("POST", "/v1/completions", body)
        choice = resp["choices"][0]
        blend, loading, fallback = blend_results(resp.get("kv_transfer_params"))
        lp = None
        if req.logprobs is not None and choice.get("logprobs"):
            lp = [
                {int(t.removeprefix("token_id:")): v for t, v in (top or {}).items()}
                for top in choice["logprobs"]["top_logprobs"]
            ]
        elapsed = time.perf_counter() - req.started
        return Generation(
            text=choice["text"],
            token_ids=list(choice.get("token_ids") or []),
            prompt_token_ids=list(req.prompt.token_ids),
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            ttft_s=elapsed,
            mode=req.mode,
            logprobs=lp,
            total_s=elapsed,
            loading=loading,
            fallback=fallback,
            usage=Usage(prompt_tokens=len(req.prompt), completion_tokens=resp["usage"]["completion_tokens"], **blend),
        )

    def warm(self, chunks: Iterable[TextOrIds], *, progress: bool | None = None) -> int:
        """Computes chunks on the server by sending each one as a one-chunk
        prompt (a miss is computed and saved there). Returns how many missed."""
        from tqdm.auto import tqdm

        chunks = list(chunks)
        show = progress if progress is not None else len(chunks) > 8
        computed = 0
        for chunk in tqdm(chunks, desc="warming chunk KV on the server", unit="chunk", disable=not show):
            g = self.generate(BlendPrompt([], [chunk], []), max_tokens=1)
            computed += g.usage.chunks_missed
        return computed
