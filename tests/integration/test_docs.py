"""The documentation builds with warnings as errors, and every code sample in it runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from docs_runner import samples  # pytest puts tests/ on sys.path

from tests.fixtures.commands import ROOT, run_python

DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts)


def test_docs_build_without_warnings(tmp_path):
    run_python("-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"), timeout=300)
    assert (tmp_path / "site" / "index.html").exists()


def test_only_make_test_and_make_demo_are_not_run_here():
    """``make test`` runs these tests; ``make demo`` runs in tests/integration/test_examples.py."""
    skipped = [
        (p.name, code.strip()) for p in PAGES for _, code, directive in samples(p) if directive.startswith("skip")
    ]
    assert all(code in ("make test", "make demo") for _, code in skipped), skipped
    assert ("index.md", "make demo") in skipped


@pytest.mark.parametrize("page", [p for p in PAGES if samples(p)], ids=lambda p: p.name)
def test_code_samples_run(page, model_dirs, examples_store, tmp_path):
    # index.md runs in the examples' store, with the home folder whose cache holds the demo model
    # `make install` converted (another home would fetch and convert it again); the other pages run
    # in a home folder of their own
    quickstart = page.name == "index.md"
    store = examples_store if quickstart else tmp_path / "store"
    env = dict(
        os.environ,
        HOME=os.environ["HOME"] if quickstart else str(tmp_path),
        HF_HUB_OFFLINE="1",
        BLEND_STORE_PATH=str(store),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    run_python(str(ROOT / "tests" / "docs_runner.py"), str(page), model_dirs("llama"), cwd=tmp_path, env=env,
               timeout=1200)  # fmt: skip


# Raised and caught inside the package (a failed read turns into a miss), never seen by a caller.
INTERNAL = {"LoadFailed", "ReadFailed"}


def raised_messages():
    """(file:line, the message's fixed parts) of every raise with a literal message in the package."""
    import ast

    for path in sorted((ROOT / "blend_integrations").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
            message = node.exc.args[0]
            if name in INTERNAL:
                continue
            if isinstance(message, ast.Constant) and isinstance(message.value, str):
                parts = [message.value]
            elif isinstance(message, ast.JoinedStr):
                parts = "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in message.values).split("\0")
            else:
                continue  # a message built elsewhere (e.g. CorruptEntryError(reason)): its parts are raises too
            yield f"{path.relative_to(ROOT)}:{node.lineno}", [p.strip() for p in parts if len(p.strip()) >= 8]


def test_troubleshooting_names_every_error():
    page = (DOCS / "troubleshooting.md").read_text()
    messages = list(raised_messages())
    assert len(messages) > 100
    missing = [(where, part) for where, parts in messages for part in parts if part not in page]
    assert not missing, missing


def test_configuration_names_every_option():
    """Every BlendConfig field with its default, and every option of the loaders,
    the store and the framework models, is on the configuration page."""
    import dataclasses
    import inspect
    import json

    from langchain_core.language_models import BaseChatModel, BaseLLM
    from llama_index.core.llms import CustomLLM

    from blend_integrations import BlendConfig, ChunkStore, load_engine
    from blend_integrations.langchain import BlendLLM, ChatBlend
    from blend_integrations.llama_index import BlendLLM as LlamaIndexBlendLLM

    page = (DOCS / "configuration.md").read_text()
    for field in dataclasses.fields(BlendConfig):
        default = json.dumps(field.default) if isinstance(field.default, str) else repr(field.default)
        assert f"| `{field.name}` | `{default}` |" in page, field.name
    names = [n for fn in (load_engine, ChunkStore.__init__) for n in inspect.signature(fn).parameters if n != "self"]
    for model, base in ((ChatBlend, BaseChatModel), (BlendLLM, BaseLLM), (LlamaIndexBlendLLM, CustomLLM)):
        names += sorted(set(model.model_fields) - set(base.model_fields))
    assert len(names) > 30
    assert not [n for n in names if f"`{n}`" not in page]
