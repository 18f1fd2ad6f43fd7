"""Entry-points layer: the live check on the blend server (``BlendConfig.quality_check``,
``python -m blend_integrations.serve --quality-check SHARE``).

The embedded engines check a share of their ``"auto"`` answers themselves
(``engines.quality_check``). A server's answers leave through vLLM's API
server, so its ``CheckBlendParams`` middleware does it there, with the same
``QualityChecker``:

- it counts the users' requests in flight, and watches each greedy completion
  or chat completion with blend parameters: its text (streamed or not) and
  the connector's answer (``kv_transfer_params``) say whether ``"auto"``
  blended it from stored chunk KV, as ``Engine._answered`` requires;
- a picked answer is checked once no user request is in flight, as on the
  embedded engine: full prefill's first tokens are walked on the workers a
  slice of layers at a time (``engines.vllm_check``), through the API server's
  engine client, and a user's request that comes stops it at the next slice
  (``CheckPreempted``; it runs again later). The prompt's token ids are the
  request's own, or vLLM's rendering of its text or messages (its
  ``/tokenize`` route over loopback, marked with this process's secret so
  that it is not counted as a user's);
- the text of full prefill's first tokens (cut where vLLM would stop them)
  must begin the blend's answer (``agrees``: the server answers in text); the
  result goes to the model's live-check state in the server's store, which
  the connector reads with the calibration.

Its counts are Prometheus series on vLLM's ``/metrics`` (``LiveCheckMetrics``).
A response does not say whether it was checked: it is picked after it was sent.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .engines.base import AUTO_SOURCES
from .engines.quality_check import CheckPreempted, QualityChecker
from .engines.vllm_check import SlicedWalk
from .engines.vllm_contract import blend_results
from .engines.vllm_served import ServedModel, served_tokenizer
from .models.loading import end_token_ids, resolve_model_dir
from .store import ChunkStore

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

CHECK_HEADER = b"x-blend-live-check"  # a check's own request; its value is the process's secret
CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_WATCHED_BYTES = 4 << 20  # a longer response is passed on unwatched
RPC_TIMEOUT_S = 600.0
# A chat request's fields that vLLM's ``/tokenize`` renders as its chat completion does.
CHAT_RENDERING = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


@dataclass(frozen=True)
class CheckRequest:
    """What a check asks the server: a user's request, in full prefill."""

    path: str
    body: dict
    address: tuple[str, int]  # this server's, for ``/tokenize``


def checkable(path: str, data: dict | None) -> bool:
    """Whether a request may be checked once answered: one greedy answer to one prompt, blended."""
    if path not in CHECKED_PATHS or data is None:
        return False
    blend = data.get("kv_transfer_params", {}).get("blend")
    prompt = data.get("prompt")
    token_ids = isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)
    one_prompt = "messages" in data or isinstance(prompt, str) or token_ids
    return (
        isinstance(blend, dict)
        and blend.get("mode", "blend") == "blend"
        and data.get("temperature") == 0
        and data.get("n") in (None, 1)
        and data.get("best_of") in (None, 1)
        and not data.get("echo")
        and not data.get("prompt_logprobs")
        and one_prompt
    )


def answer_of(data: dict, body: bytes) -> tuple[str, dict | None] | None:
    """The answer's text and the connector's answer, from a response's body
    (a JSON object, or a stream's events); None when it cannot be read."""
    events: list[Any]
    try:
        if data.get("stream"):
            lines = body.decode().splitlines()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        else:
            events = [json.loads(body)]
    except (UnicodeDecodeError, ValueError):
        return None
    text, params = [], None
    for event in events:
        if not isinstance(event, dict):
            return None
        params = event.get("kv_transfer_params") or params
        choices = event.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            return None
        for choice in choices:
            said = choice.get("message") or choice.get("delta") or {}
            part = choice.get("text") or (said.get("content") if isinstance(said, dict) else None) or ""
            text.append(part if isinstance(part, str) else "")
    return "".join(text), params


def answer_text(tokenizer, end_ids: frozenset[int], ids: list[int], body: dict) -> str:
    """The text vLLM answers ``body`` with where it generated ``ids``: cut before an end token (one of
    ``end_ids`` or the request's ``stop_token_ids``, unless ``ignore_eos``) and at a stop string, and
    decoded as it decodes (``skip_special_tokens``)."""
    if not body.get("ignore_eos"):
        stops = end_ids | {t for t in body.get("stop_token_ids") or () if type(t) is int}
        ended = [i for i, t in enumerate(ids) if t in stops]
        ids = ids[: ended[0]] if ended else ids
    text = tokenizer.decode(ids, skip_special_tokens=body.get("skip_special_tokens", True) is not False)
    stop = body.get("stop")
    for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ():
        if isinstance(s, str) and s and s in text:
            text = text[: text.index(s) + (len(s) if body.get("include_stop_str_in_output") else 0)]
    return text


def blended_by_auto(params: dict | None) -> bool:
    """Whether the connector says ``"auto"`` blended this prompt from stored chunk KV (``Engine._answered``)."""
    try:
        usage, _, fallback = blend_results(params)
    except ValueError:
        return False
    ratio = usage.get("recompute_ratio")
    return (
        fallback is None
        and usage.get("ratio_source") in AUTO_SOURCES
        and ratio is not None
        and ratio < 1.0
        and usage.get("cached_tokens", 0) > 0
    )


class ServedChecks:
    """One API server process's live checks: what ``QualityChecker`` needs of an engine
    (``quality_check.Checkable``), walked on the workers through the server's engine client."""

    def __init__(
        self, served: ServedModel, model_config, store: ChunkStore, engine_client, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.store = store
        self.calibrations = served.calibrations(store)
        self.tokenizer = served_tokenizer(model_config.tokenizer)
        self.stop_ids = end_token_ids(generation_config(model_config.model), self.tokenizer)
        self.context_length = int(model_config.max_model_len)
        self.engine_client, self.loop = engine_client, loop
        self.secret = secrets.token_hex(16).encode()
        self.in_flight = 0  # the users' requests (under the lock)
        self._lock = threading.Lock()
        self._walk = SlicedWalk()
        self.checker = QualityChecker(self, served.config.quality_check, served.config.quality_check_risk)

    def idle(self) -> bool:
        with self._lock:
            return self.in_flight == 0

    def _arrived(self) -> None:
        """A user's request came: count it (a check in flight stops at its next slice)."""
        self.checker.arrived()
        with self._lock:
            self.in_flight += 1

    def _rpc(self, method: str, args: tuple = ()):
        """A worker method on every rank (``vllm_worker``), run on the server's event loop; the first rank's result."""
        rpc = self.engine_client.collective_rpc(method, args=args)
        return asyncio.run_coroutine_threadsafe(rpc, self.loop).result(timeout=RPC_TIMEOUT_S)[0]

    def full_prefill_tokens(self, request: CheckRequest, tokens: int) -> str:
        """The text of full prefill's first ``tokens`` tokens for ``request``, cut where vLLM would
        stop them; a user's request that comes stops it (``CheckPreempted``)."""
        ids = self.prompt_ids(request)
        tokens = min(tokens, self.context_length - len(ids))
        if tokens < 1:
            raise ValueError(f"a prompt of {len(ids)} tokens leaves no room in the context of {self.context_length}")

        def call(method: str, args: tuple):
            if not self.idle():
                raise CheckPreempted("a user's request arrived")
            return self._rpc(method, args)

        ids = self._walk.run(call, lambda: self._rpc("blend_check_stop"), ids, tokens)
        return answer_text(self.tokenizer, self.stop_ids, ids, request.body)

    def prompt_ids(self, request: CheckRequest) -> list[int]:
        """The token ids vLLM prefilled for the request: its own, or its text or messages as vLLM
        renders them (``/tokenize``, which runs no engine step)."""
        body = request.body
        prompt = body.get("prompt")
        if isinstance(prompt, list):  # token ids (``checkable``)
            return prompt
        if "messages" in body:
            asked = {k: body[k] for k in CHAT_RENDERING if k in body}
        else:
            asked = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
            if "model" in body:
                asked["model"] = body["model"]
        headers = {"Content-Type": "application/json", CHECK_HEADER.decode(): self.secret.decode()}
        key = os.environ.get("VLLM_API_KEY")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn = http.client.HTTPConnection(*request.address, timeout=RPC_TIMEOUT_S)
        try:
            conn.request("POST", "/tokenize", json.dumps(asked), headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            ids = json.loads(raw)["tokens"] if response.status == 200 else None
        except (ValueError, KeyError, TypeError):
            ids = None
        if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
            raise RuntimeError(f"the server's /tokenize answered HTTP {response.status}: {raw[:200]!r}")
        return ids

    def watch(self, scope, data: dict | None, send):
        """Count a user's request in flight and preempt a check; returns the ``send`` to use and a
        function to call (off the event loop: it reads the store) when it was answered, which ends
        its count and offers it for a check where it may be checked."""
        from .http_edge import request_path

        self._arrived()
        path = request_path(scope)
        if not checkable(path, data) or self.checker.share <= 0:
            return send, self._done
        assert data is not None
        status, parts, size = [0], [], [0]

        async def watching(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message.get("status", 0)
            elif message["type"] == "http.response.body" and size[0] <= MAX_WATCHED_BYTES:
                parts.append(message.get("body", b""))
                size[0] += len(parts[-1])
            await send(message)

        def done() -> CheckRequest | None:
            self._done()
            if status[0] != 200 or size[0] > MAX_WATCHED_BYTES:
                return None
            answer = answer_of(data, b"".join(parts))
            if answer is None or not answer[0] or not blended_by_auto(answer[1]):
                return None
            host, port = scope.get("server") or ("127.0.0.1", 8000)
            request = CheckRequest(path, data, ("127.0.0.1" if host in ("0.0.0.0", "::") else host, port))
            most = data.get("max_completion_tokens") or data.get("max_tokens")
            try:
                self.checker.offer(request, answer[0], most if isinstance(most, int) else None)
            except Exception as e:  # the store could not be read: this answer goes unchecked
                logger.warning("a live check could not be offered (%s: %s)", type(e).__name__, str(e)[:200])
                return None
            return request

        return watching, done

    def _done(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def close(self) -> None:
        self.checker.close()


class LiveCheckMetrics:
    """A Prometheus collector (vLLM's ``/metrics``) of a server's live checks, read at each scrape:

    - ``vllm:blend_live_checks_total{outcome}``: checks that agreed, disagreed, failed (an error: the
      answer was not touched), were preempted by a user's request, given up (preempted too often),
      dropped (the queue was full);
    - ``vllm:blend_live_check_seconds_total``: the time the checks' full prefills took (the users'
      is vLLM's ``vllm:e2e_request_latency_seconds``);
    - ``vllm:blend_live_check_share``: the share of eligible answers checked now;
    - ``vllm:blend_live_checks_waiting``: checks picked and not yet run (they wait for a lull);
    - ``vllm:blend_auto_ratio{source}``: the ratio ``"auto"`` gives a request now, and why
      (``checked``: the live check raised it above the calibrated policy)."""

    def __init__(self, checks: ServedChecks) -> None:
        self.checks = checks

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.checks.checker.stats()
        outcomes = CounterMetricFamily(
            "vllm:blend_live_checks",
            "Live checks of blended answers against full prefill, by outcome.",
            labels=["outcome"],
        )
        outcomes.add_metric(["agreed"], stats["agreed"])
        outcomes.add_metric(["disagreed"], stats["checked"] - stats["agreed"])
        for outcome in ("failed", "preempted", "given_up", "dropped"):
            outcomes.add_metric([outcome], stats[outcome])
        yield outcomes
        yield CounterMetricFamily(
            "vllm:blend_live_check_seconds", "Time the live checks' full prefills took.", value=stats["seconds"]
        )
        yield GaugeMetricFamily(
            "vllm:blend_live_check_share", "Share of eligible auto answers checked now.", value=stats["share_now"]
        )
        yield GaugeMetricFamily(
            "vllm:blend_live_checks_waiting", "Live checks picked and waiting for a lull.", value=stats["waiting"]
        )
        choice = self.checks.calibrations.choice()
        ratio = GaugeMetricFamily(
            "vllm:blend_auto_ratio", 'The recompute ratio "auto" gives a request now, by its source.', labels=["source"]
        )
        ratio.add_metric([choice.source], choice.ratio)
        yield ratio


def generation_config(model: str):
    """The checkpoint's generation config, whose end tokens vLLM stops at (None where it has none)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(resolve_model_dir(model))
    except OSError:
        return None


def open_checks(vllm_config, engine_client, loop: asyncio.AbstractEventLoop) -> ServedChecks | None:
    """This process's live checks (None where the server runs none), with their metrics registered;
    ``engine_client``: the API server's (``app.state.engine_client``), run on ``loop``."""
    served = ServedModel.of(vllm_config)
    if served.config.quality_check <= 0:
        return None
    from prometheus_client import REGISTRY

    store = ChunkStore(**{**served.store_args, "memory_limit_bytes": 0})
    checks = ServedChecks(served, vllm_config.model_config, store, engine_client, loop)
    REGISTRY.register(LiveCheckMetrics(checks))
    return checks
