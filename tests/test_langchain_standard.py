"""LangChain's own standard test suites (langchain-tests) against ChatBlend on the
transformers engine with a small local model.

Capabilities declared off, and why:
- tool calling, tool choice, structured output, JSON mode: not implemented yet
  (bind_tools and the tool-call parser are the open part of the LangChain issue);
- a per-call ``model`` override: a ChatBlend is bound to its engine's one model;
- image, audio, PDF and Anthropic-style inputs: the supported models read text only.
"""

from __future__ import annotations

import functools
import tempfile

from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from blend_integrations.langchain import ChatBlend
from blend_integrations.local_models import build_model


@functools.lru_cache(maxsize=1)
def tiny_model() -> str:
    return str(build_model(tempfile.mkdtemp(prefix="blend-standard-model-")))


class _ChatBlendSettings:
    @property
    def chat_model_class(self):
        return ChatBlend

    @property
    def chat_model_params(self):
        return {"model": tiny_model(), "store_path": tempfile.mkdtemp(prefix="blend-standard-store-")}

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False

    @property
    def supports_model_override(self):
        return False


class TestChatBlendStandardUnit(_ChatBlendSettings, ChatModelUnitTests):
    pass


class TestChatBlendStandardIntegration(_ChatBlendSettings, ChatModelIntegrationTests):
    pass
