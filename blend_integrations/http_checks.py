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
- a picked answer is checked once no user request is in flight: the same
  request without its blend parameters (so vLLM computes it in full), for the
  compared tokens only, over loopback, marked with this process's secret so
  that it is neither counted nor checked itself. A user's request arriving
  meanwhile closes its connection, which makes vLLM abort it, and the check
  runs again later (``CheckPreempted``);
- full prefill's first tokens' text must begin the blend's answer (``agrees``:
  the server answers in text); the result goes to the model's live-check
  state in the server's store, which the connector reads with the calibration.

Its counts are Prometheus series on vLLM's ``/metrics`` (``LiveCheckMetrics``).
A response does not say whether it was checked: it is picked after it was sent.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .engines.base import AUTO_SOURCES
from .engines.quality_check import CheckPreempted, QualityChecker
from .engines.vllm_contract import blend_results
from .engines.vllm_served import ServedModel
from .store import ChunkStore

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

CHECK_HEADER = b"x-blend-live-check"  # a check's own request; its value is the process's secret
CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_WATCHED_BYTES = 4 << 20  # a longer response is passed on unwatched
CHECK_TIMEOUT_S = 600.0
# Fields of a user's request a check leaves out: its blend parameters (so vLLM computes it in full), how it
# is delivered, what only makes the response longer, and a floor its few tokens would break.
DROPPED = (
    "kv_transfer_params",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "echo",
    "min_tokens",
)


@dataclass(frozen=True)
class CheckRequest:
    """What a check asks the server: a user's request, in full prefill."""

    path: str
    body: dict
    address: tuple[str, int]


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
    (``quality_check.Checkable``), run over loopback HTTP."""

    def __init__(self, served: ServedModel, store: ChunkStore) -> None:
        self.store = store
        self.calibrations = served.calibrations(store)
        self.secret = secrets.token_hex(16).encode()
        self.in_flight = 0  # the users' requests (under the lock)
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._preempted = False
        self.checker = QualityChecker(self, served.config.quality_check, served.config.quality_check_risk)

    def idle(self) -> bool:
        with self._lock:
            return self.in_flight == 0

    def _arrived(self) -> None:
        """A user's request came: count it, and close the check in flight's connection (vLLM aborts it)."""
        self.checker.arrived()
        with self._lock:
            self.in_flight += 1
            if self._conn is not None and self._conn.sock is not None:
                self._preempted = True
                with contextlib.suppress(OSError):
                    self._conn.sock.shutdown(socket.SHUT_RDWR)

    def full_prefill_tokens(self, request: CheckRequest, tokens: int) -> str:
        """The text of full prefill's first ``tokens`` tokens for ``request``, asked of this server."""
        body = {k: v for k, v in request.body.items() if k not in DROPPED}
        body |= {"max_tokens": tokens, "n": 1}
        if "messages" in body:
            body["max_completion_tokens"] = tokens
        headers = {"Content-Type": "application/json", CHECK_HEADER.decode(): self.secret.decode()}
        key = os.environ.get("VLLM_API_KEY")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn = http.client.HTTPConnection(*request.address, timeout=CHECK_TIMEOUT_S)
        with self._lock:
            if self.in_flight:
                raise CheckPreempted
            self._conn, self._preempted = conn, False
        try:
            conn.request("POST", request.path, json.dumps(body), headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException):
            if self._preempted:
                raise CheckPreempted from None
            raise
        finally:
            with self._lock:
                self._conn = None
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"the server answered the check HTTP {response.status}: {raw[:200]!r}")
        answer = answer_of({}, raw)
        if answer is None:
            raise RuntimeError(f"the server's answer to the check is not a completion: {raw[:200]!r}")
        return answer[0]

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


def open_checks(vllm_config) -> ServedChecks | None:
    """This process's live checks (None where the server runs none), with their metrics registered."""
    served = ServedModel.of(vllm_config)
    if served.config.quality_check <= 0:
        return None
    from prometheus_client import REGISTRY

    checks = ServedChecks(served, ChunkStore(**{**served.store_args, "memory_limit_bytes": 0}))
    REGISTRY.register(LiveCheckMetrics(checks))
    return checks
