"""Plan and walk layers: the settings of the blend algorithm."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Deviation = Literal["k", "v"]
DEVIATIONS: tuple[str, ...] = ("k", "v")
# Where a request's recompute ratio came from (``Usage.ratio_source``): the
# store's calibration for this model (the user's own), the calibration the
# package ships for it, the documented fallback (``"auto"`` without either),
# the request's own, the engine config's, the
# per-request guard, which raised the calibrated ratio for this request, or the
# live check (``quality_check``), which raised it for every request after
# checked answers disagreed with full prefill.
RatioSource = Literal["calibrated", "packaged", "fallback", "request", "config", "guard", "checked"]
RATIO_SOURCES: tuple[str, ...] = ("calibrated", "packaged", "fallback", "request", "config", "guard", "checked")
# The sources that are measured (a calibration, or its live check): ratio 1.0 from one is run as full prefill.
CALIBRATION_SOURCES: tuple[str, ...] = ("calibrated", "packaged", "checked")
# The share of "auto" requests checked against full prefill by default (``BlendConfig.quality_check``).
QUALITY_CHECK = 0.05
# The chance a user's request arrives during a live check that a check may start at
# (``BlendConfig.quality_check_risk``): checks run in the traffic's lulls.
QUALITY_CHECK_RISK = 0.05
# The ratio ``"auto"`` uses for a model the store holds no calibration for:
# what the answer-quality benchmark picks on the bundled reader
# (docs/results/quality.md). It is too low for small chat models (SmolLM2
# needs 0.5 or more): calibrate (``engine.calibrate``, docs/calibration.md).
FALLBACK_RATIO = 0.15
Mode = Literal["blend", "full", "reuse"]
MODES: tuple[str, ...] = ("blend", "full", "reuse")
Selection = Literal["deviation", "query", "query-tail", "mixed"]
SELECTIONS: tuple[str, ...] = ("deviation", "query", "query-tail", "mixed")
# How a chunk store may keep chunk KV besides raw (None): ``store/codec.py``.
KV_CODECS: tuple[str, ...] = ("fp8", "int8")
# The settings of one blend pass that a request may override and a
# calibration measures a ratio under (with it, they make a blend policy).
SETTINGS: tuple[str, ...] = ("check_layers", "deviation", "sink_tokens", "selection")


@dataclass(frozen=True)
class BlendConfig:
    """How a prompt made of cached chunks is fused.

    The defaults of check_layers, deviation and sink_tokens, and
    ``FALLBACK_RATIO``, are set from the answer-quality benchmark
    (docs/results/quality.md, and ``recommended_defaults`` in
    benchmarks/quality_report.py, which says how); selection from the
    reader's and SmolLM2's tables together (docs/results/selection/): a
    default changes only when both pick it.

    recompute_ratio: share of the reused (loaded) chunk tokens whose KV is
        recomputed, picked by largest deviation at the check layer. 1.0
        recomputes everything (equals full prefill), 0.0 is plain reuse.
        "auto" (the default): the ratio the store's calibration for this
        model and dtype chose (``engine.calibrate``), with its per-request
        guard; without a calibration, ``FALLBACK_RATIO``, logged once.
    check_layers: layers where deviation is measured and the recompute set is
        chosen. Layers before the first one are computed for every token.
        Several layers give gradual filtering: the ratio shrinks linearly from
        near 1 at the first check layer to ``recompute_ratio`` at the last.
    deviation: compare fresh and loaded values ("v", as the CacheBlend paper)
        or keys ("k") at the check layer.
    selection: how the recomputed tokens are chosen at a check layer.
        "deviation": the reused tokens whose fresh KV deviates most from the
        loaded KV (CacheBlend's HKVD); "query": the reused tokens the query
        pays the most attention to (the query is every token after the last
        chunk but the prompt's last one: the question and the template tail);
        "query-tail": the reused tokens that add the most to the question's
        own last few tokens (``selection.QUERY_TAIL``, before a chat template's
        tail: ``TokenizedPrompt.question_end``): their attention, each key
        weighted by its value's norm;
        "mixed": half of the count by query attention, the rest by deviation.
    separator: text placed between prefix, chunks and suffix; tokenized once,
        on its own. May be empty.
    sink_tokens: the first N tokens of every reused chunk are always
        recomputed (attention-sink repair).
    loading_controller: in blend mode, decide per request from where each
        chunk would be read (the store's measured bandwidth per tier) and how
        fast this engine computes: chunks whose loading would delay the first
        token more than computing them are computed as fresh tokens, and with
        ``pipelined_loading`` the ratio is raised above ``recompute_ratio``
        (the quality floor) while the extra compute still hides under the
        loads. Off: every stored chunk is loaded, at the configured ratio.
    pipelined_loading: read stored chunks layer by layer in a background
        thread while the walk computes; layer l waits only for its own KV.
        The answer is the same as without it.
    kv_codec: how the store the engine makes keeps chunk KV: None (raw),
        "fp8" or "int8" (about a quarter of float32's bytes; see
        docs/storage.md). A store passed to the engine keeps its own codec
        (``ChunkStore(kv_codec=...)``); this, when set, must be the same.
    quality_check: the share (0 to 1) of greedy blended ``"auto"`` requests
        whose answer is checked against full prefill's first tokens after it
        is answered, off its path (docs/calibration.md#live-check). Each
        check adds to the model's running agreement in the store; when its
        lower bound falls below the calibration's target, ``"auto"`` steps up
        the ladder for every engine on the store. 0 turns it off.
    quality_check_risk: a check starts only when the engine is idle and, at
        the rate users' requests have been arriving, one is no likelier than
        this (above 0, up to 1) to arrive before the check ends: a user who
        comes during a check waits for a slice of it (a layer on the
        transformers engine, about 20 ms on the embedded vLLM engine), on the
        server for its prefill. 1: whenever the engine is idle.
    """

    recompute_ratio: float | Literal["auto"] = "auto"
    check_layers: tuple[int, ...] = (1,)
    deviation: Deviation = "v"
    selection: Selection = "deviation"
    separator: str = "\n\n"
    sink_tokens: int = 0
    loading_controller: bool = False
    pipelined_loading: bool = False
    kv_codec: str | None = None
    quality_check: float = QUALITY_CHECK
    quality_check_risk: float = QUALITY_CHECK_RISK

    def __post_init__(self) -> None:
        check_kv_codec(self.kv_codec)
        object.__setattr__(self, "quality_check", check_ratio(self.quality_check, name="quality_check"))
        risk = self.quality_check_risk
        if isinstance(risk, bool) or not isinstance(risk, (int, float)) or not 0 < risk <= 1:
            raise ValueError(
                f"quality_check_risk must be a number in (0, 1] (at 0 no check would start; quality_check=0 "
                f"turns them off), got {risk!r:.60}"
            )
        object.__setattr__(self, "quality_check_risk", float(risk))
        if self.recompute_ratio != "auto":
            object.__setattr__(self, "recompute_ratio", check_ratio(self.recompute_ratio, auto=True))
        layers = tuple(self.check_layers) if not isinstance(self.check_layers, int) else (self.check_layers,)
        if not layers:
            raise ValueError("check_layers must name at least one layer, e.g. (1,)")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
            raise ValueError(f"check_layers must be non-negative layer indices, got {self.check_layers!r}")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"check_layers must be strictly increasing, got {self.check_layers!r}")
        object.__setattr__(self, "check_layers", layers)
        if self.deviation not in DEVIATIONS:
            raise ValueError(f'deviation must be "k" or "v", got {self.deviation!r}')
        check_selection(self.selection)
        if not isinstance(self.separator, str):
            raise ValueError(f"separator must be a string, got {type(self.separator).__name__}")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be a non-negative integer, got {self.sink_tokens!r}")
        for name in ("loading_controller", "pipelined_loading"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def replace(self, **changes) -> BlendConfig:
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """The blend-pass settings (``SETTINGS``) as plain values (JSON-ready)."""
        return {k: list(v) if k == "check_layers" else v for k, v in ((k, getattr(self, k)) for k in SETTINGS)}

    def with_settings(self, settings: dict[str, Any] | None, *, num_layers: int | None = None) -> BlendConfig:
        """This config with some ``SETTINGS`` replaced (a request's, or a
        calibration's); raises ValueError naming a bad or unknown one, or check
        layers beyond ``num_layers``."""
        if not settings:
            config = self
        else:
            unknown = sorted(str(k)[:40] for k in settings if k not in SETTINGS)
            if unknown:
                raise ValueError(f"unknown blend setting(s) {', '.join(unknown)}; they are {', '.join(SETTINGS)}")
            changes = dict(settings)
            if isinstance(changes.get("check_layers"), list):
                changes["check_layers"] = tuple(changes["check_layers"])
            config = self.replace(**changes)
        if num_layers is not None and config.check_layers[-1] >= num_layers:
            raise ValueError(f"check_layers {list(config.check_layers)} must be below the model's {num_layers} layers")
        return config

    def check_schedule(self, recompute_ratio: float | None = None) -> list[tuple[int, float]]:
        """(layer, ratio) per check layer; the last ratio is the recompute ratio
        (None: the config's, which must then be a number, not "auto")."""
        r = self.recompute_ratio if recompute_ratio is None else recompute_ratio
        if isinstance(r, str):
            raise ValueError('check_schedule needs a ratio: the config\'s is "auto", resolved per request')
        return check_schedule(self.check_layers, r)


def check_schedule(check_layers: tuple[int, ...], ratio: float) -> list[tuple[int, float]]:
    """(layer, ratio) per check layer: gradual filtering shrinks the share kept
    linearly from near 1 at the first to ``ratio`` at the last."""
    n = len(check_layers)
    return [(layer, ratio + (1.0 - ratio) * (n - 1 - i) / n) for i, layer in enumerate(check_layers)]


def check_mode(mode: str, *, name: str = "mode") -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}; got {mode!r:.60}")
    return mode


def check_kv_codec(codec: object) -> str | None:
    """``codec`` if it is one of ``KV_CODECS`` or None (raw); raise ValueError naming the choices."""
    if codec is None or (isinstance(codec, str) and codec in KV_CODECS):
        return codec
    raise ValueError(f"unknown kv_codec {codec!r:.60}; the choices are None (raw), {', '.join(map(repr, KV_CODECS))}")


def check_selection(selection: str, *, name: str = "selection") -> str:
    if not isinstance(selection, str) or selection not in SELECTIONS:
        raise ValueError(f"{name} must be one of {', '.join(SELECTIONS)}; got {selection!r:.60}")
    return selection


def check_ratio(recompute_ratio: float, *, name: str = "recompute_ratio", auto: bool = False) -> float:
    """A finite number in [0, 1] (NaN and infinities fail the range check).
    ``auto``: the message says "auto" is allowed too (checked by the caller)."""
    if (
        isinstance(recompute_ratio, bool)
        or not isinstance(recompute_ratio, (int, float))
        or not 0.0 <= recompute_ratio <= 1.0
    ):
        allowed = 'a number in [0, 1] or "auto"' if auto else "a number in [0, 1]"
        raise ValueError(f"{name} must be {allowed}, got {recompute_ratio!r:.60}")
    return float(recompute_ratio)


def parse_ratio(text: str) -> float | str:
    """A command line's ratio: "auto" or a number in [0, 1] (for argparse's ``type=``)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f'recompute_ratio must be a number in [0, 1] or "auto", got {text!r:.60}') from None
    return check_ratio(value, auto=True)
