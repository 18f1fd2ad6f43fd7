"""Engines layer: the vLLM plugin (entry point ``vllm.general_plugins``): the ``blend`` model loader.

vLLM runs ``register`` in each of its processes. The ``blend`` load format
loads weights exactly as vLLM's default loader does and remembers the model,
so the blend connector in the same worker can run the blend pass with the
model's own modules. Start vLLM with ``load_format="blend"``
(``vllm serve MODEL --load-format blend ...``).
"""

from __future__ import annotations

import copy

_models: list = []  # models loaded in this process, first = the served model
_registered = False


def loaded_model():
    return _models[0] if _models else None


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register_model_loader("blend")
    class BlendModelLoader(BaseModelLoader):
        """vLLM's default loader ("auto" format), remembering the model."""

        def __init__(self, load_config) -> None:
            super().__init__(load_config)
            inner = copy.copy(load_config)
            inner.load_format = "auto"
            self.inner = DefaultModelLoader(inner)

        def download_model(self, model_config) -> None:
            self.inner.download_model(model_config)

        def load_weights(self, model, model_config) -> None:
            self.inner.load_weights(model, model_config)

        def load_model(self, *args, **kwargs):
            model = super().load_model(*args, **kwargs)
            _models.append(model)
            return model
