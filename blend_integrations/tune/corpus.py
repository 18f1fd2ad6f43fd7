"""Tuning layer: training text that every machine with Python has, offline.

    python -m blend_integrations.tune.corpus DIR

writes the docstrings of Python's standard library (its modules, classes and
functions, under the Python Software Foundation License, which allows this
use) as one text file per module, each docstring a paragraph. They are read
from the source files with ``ast``, never imported, and the test suites,
IDLE and the tkinter demos are left out. This is prose of another kind than
the retrieval benchmarks' documents, so a model tuned on it is evaluated on
text it never saw.
"""

from __future__ import annotations

import argparse
import ast
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MIN_WORDS = 25  # shorter docstrings are signatures and one-liners, not prose
SKIPPED = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages", "ensurepip", "__pycache__"}


def stdlib_docstrings(root: str | os.PathLike | None = None) -> Iterator[tuple[str, list[str]]]:
    """``(module name, its docstrings of MIN_WORDS words or more)`` for each
    standard-library source file under ``root`` (default: this Python's)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if SKIPPED & set(parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = []
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= MIN_WORDS:
                    docs.append(doc.strip())
        if docs:
            yield ".".join(parts).removesuffix(".py"), list(dict.fromkeys(docs))


def write_corpus(out: str | os.PathLike, root: str | os.PathLike | None = None) -> tuple[int, int]:
    """Write one ``MODULE.txt`` per module into ``out``; (files, words)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = words = 0
    for name, docs in stdlib_docstrings(root):
        (out / f"{name}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        files += 1
        words += sum(len(d.split()) for d in docs)
    return files, words


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m blend_integrations.tune.corpus", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", help="folder to write the text files into")
    args = parser.parse_args(argv)
    files, words = write_corpus(args.out)
    print(f"wrote {files} files, {words:,} words of Python standard-library docstrings to {args.out}")


if __name__ == "__main__":
    main()
