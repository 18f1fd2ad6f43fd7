"""The demo page: ``python -m blend_integrations.ui`` (``make ui``; docs/ui.md).

``session`` does the work (the engine, the checks, the two answers, what
blending recomputed) and ``page`` lays it out with Gradio, an optional
dependency (``pip install "blend_integrations[ui]"``)."""

from .session import AskError, DemoSession, highlighted, load_documents

__all__ = ["AskError", "DemoSession", "highlighted", "load_documents"]
