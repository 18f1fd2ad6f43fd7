"""Integrations layer: what the LangChain and LlamaIndex models share.

``BlendModelBase`` holds the fields of both frameworks' models (documented, as
LangChain's own convention asks: a docstring under every field), loads their
engine, and turns a call's options into engine settings. The framework
classes are thin adapters: they translate messages, documents and responses.
The warmers of both frameworks share ``warm``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, SecretStr, field_validator, model_validator

from .config import BlendConfig
from .engines import Engine, load_engine
from .store import ChunkStore

# The options a call may set; every other keyword is an error.
CALL_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "mode", "recompute_ratio", "selection", "stop")


def _api_key_from_env() -> SecretStr | None:
    # the server engine reads the same variable when given no key
    key = os.environ.get("BLEND_API_KEY")
    return SecretStr(key) if key else None


class BlendModelBase(BaseModel):
    """The fields, engine loading and call settings of every blend model.

    Give ``engine=`` (a loaded ``Engine``, shared with other models), ``model=``
    (loaded here), or ``base_url=`` (a running blend server)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), use_attribute_docstrings=True)

    if TYPE_CHECKING:
        engine: Engine  # never None once the model is built: given, or loaded by ``_load_engine``
    else:
        engine: InstanceOf[Engine] | None = Field(default=None, exclude=True)
        """A loaded ``Engine``, shared with other models and chains; the loading fields are then ignored."""

    model: str | None = None
    """The model: a local checkpoint directory, a GGUF file or a hub id (or a server's URL with ``backend="server"``)."""

    base_url: str | None = None
    """A blend server's URL (``python -m blend_integrations.serve``): the ``"server"`` backend, no ``model`` needed."""

    api_key: SecretStr | None = Field(default_factory=_api_key_from_env, exclude=True)
    """The key of a server started with ``--api-key``; default ``$BLEND_API_KEY``. In-process engines ignore it."""

    backend: str = "transformers"
    """``"transformers"`` (in-process), ``"vllm"`` (embedded vLLM) or ``"server"`` (a blend server)."""

    store: InstanceOf[ChunkStore] | None = Field(default=None, exclude=True)
    """The chunk-KV store; ``None``: ``ChunkStore(store_path)``. A server keeps its own."""

    store_path: str | None = None
    """The chunk store's directory when ``store`` is not given; ``None``: the default store."""

    config: InstanceOf[BlendConfig] | None = Field(default=None, exclude=True)
    """The engine's ``BlendConfig``; ``None``: ``BlendConfig()``."""

    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra engine arguments for ``load_engine`` (``dtype``, ``device``, ``max_model_len``, ...)."""

    timeout: float | None = None
    """Seconds: the HTTP timeout of the ``"server"`` backend (its default is 600)."""

    mode: str = "blend"
    """Every call's default mode: ``"blend"``, ``"full"`` (full prefill) or ``"reuse"``."""

    recompute_ratio: float | Literal["auto"] | None = None
    """Every call's default share of chunk tokens to recompute; ``None``: the engine config's (``"auto"``
    by default: the model's calibration in the store); ``"auto"``: the calibration even if the config sets a
    ratio. Responses say which ratio was used and why (``recompute_ratio``, ``ratio_source``)."""

    selection: str | None = None
    """Every call's default way of choosing the tokens to recompute: ``"deviation"`` (CacheBlend's),
    ``"query"`` (by the question's attention), ``"query-tail"`` (by what the query's last tokens read) or
    ``"mixed"``; ``None``: the engine config's."""

    max_tokens: int = 256
    """The most tokens a reply has."""

    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""

    top_p: float = 1.0
    """Nucleus sampling: the probability mass sampled from."""

    seed: int | None = None
    """Sampling seed."""

    stop: list[str] | None = None
    """Default stop strings; a call's ``stop`` adds to them."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engine_kwargs" in data:
            data = {**data}
            old = renamed("engine_kwargs", "model_kwargs", data.pop("engine_kwargs"), stacklevel=5)
            data["model_kwargs"] = {**old, **(data.get("model_kwargs") or {})}
        return data

    @field_validator("engine", mode="before")
    @classmethod
    def _is_engine(cls, engine: Any) -> Any:
        if engine is not None and not isinstance(engine, Engine):
            raise ValueError(f"engine must be a blend_integrations Engine, got {type(engine).__name__}")
        return engine

    @model_validator(mode="after")
    def _load_engine(self):
        if self.base_url is not None:
            if "backend" in self.model_fields_set and self.backend != "server":
                raise ValueError(f"base_url= is a blend server's URL, for backend='server', not {self.backend!r}")
            self.backend = "server"
        if self.engine is not None:
            return self
        target = self.base_url or self.model
        if target is None:
            raise ValueError(
                "give model= (a local path, hub id or server URL), base_url= (a blend server's URL) "
                "or engine= (a loaded Engine)"
            )
        store, kwargs = self.store, dict(self.model_kwargs)
        if self.backend == "server":  # the server keeps its own store
            if self.timeout is not None:
                kwargs.setdefault("timeout_s", self.timeout)
            if self.api_key is not None:
                kwargs.setdefault("api_key", self.api_key.get_secret_value())
        elif store is None:
            store = ChunkStore(self.store_path, kv_codec=(self.config or BlendConfig()).kv_codec)
        self.engine = load_engine(
            target, backend=self.backend, store=store, config=self.config or BlendConfig(), **kwargs
        )
        return self

    def _call_settings(self, options: dict, stop: list[str] | None = None) -> dict:
        """The engine settings of one call: ``options`` (``CALL_SETTINGS`` only)
        over the fields; the call's stop strings (in ``options`` or ``stop``)
        add to the field's."""
        unexpected = set(options) - set(CALL_SETTINGS)
        if unexpected:
            raise TypeError(f"unexpected generation arguments: {', '.join(sorted(unexpected))}")
        settings = {name: options.get(name, getattr(self, name)) for name in CALL_SETTINGS}
        settings["stop"] = list(self.stop or []) + list(options.get("stop") or []) + list(stop or [])
        return settings


def warmer_engine(llm: Any, warmer: str) -> Engine:
    """The engine a warmer fills: ``llm`` itself or its ``engine``."""
    engine = llm if isinstance(llm, Engine) else getattr(llm, "engine", None)
    if not isinstance(engine, Engine):
        raise TypeError(f"{warmer} needs a BlendLLM or an Engine, got {type(llm).__name__}")
    return engine


def warm(
    engine: Engine, texts: Iterable[str], show_progress: bool | None, *, calibrate: bool = False, **options: Any
) -> None:
    """Compute and store the chunk KV of every non-empty text (what both
    frameworks' warmers do at ingestion). ``show_progress=None``: a bar for
    more than 8 texts. ``calibrate``: then, if the store holds no calibration
    of this model on the user's documents yet (a packaged one does not count),
    calibrate it on these texts (``Engine.calibrate`` with ``options``), so
    that ``recompute_ratio="auto"`` uses a ratio measured on them."""
    texts = [t for t in texts if t]
    engine.warm(texts, progress=show_progress)
    if calibrate and engine.calibration_source() != "calibrated":
        engine.calibrate(texts, **{"progress": show_progress is not False, **options})


def renamed(old: str, new: str, value: Any, *, stacklevel: int = 3) -> Any:
    """``value``, given under the deprecated name ``old``: a ``DeprecationWarning`` names ``new``."""
    warnings.warn(f"{old}= is deprecated; use {new}=", DeprecationWarning, stacklevel=stacklevel)
    return value
