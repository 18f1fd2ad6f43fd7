"""Engines layer: token sampling and incremental text for engines that decode themselves."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_sampling(max_tokens: int, temperature: float, top_p: float, logprobs: int | None) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"logprobs must be a non-negative integer or None, got {logprobs!r}")


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else nucleus sampling from float32 logits ``[V]``."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # keep the smallest set reaching top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, k: int, chosen: int) -> dict[int, float]:
    logp = torch.log_softmax(logits, dim=-1)
    out = {chosen: float(logp[chosen])}
    if k:
        values, ids = logp.topk(k)
        out.update(zip(ids.tolist(), values.tolist()))
    return out


class TextAssembler:
    """Turns generated ids into text deltas, holding back an incomplete UTF-8
    character and any tail that may be the start of a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text, self.stopped = text[:at], True
                return self._emit(len(self.text))
        self.text = text
        hold = 1 if text.endswith("\ufffd") else 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return self._emit(len(text) - hold)

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
