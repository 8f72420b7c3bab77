"""The map of the code holds: imports between the packages run one way, nothing
below the composition root imports it, no two modules import each other (in
a ring of any length), and the web process does not load the model stack
(README, "Architecture")."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The kernel, the engine (which imports nothing of the service), the
# torch-free generation side, the apps, the worker runtime, and
# the client (which users install without the service).
PACKAGES = (
    "lmsp_core",
    "engine",
    "generation",
    "accounts_app",
    "tasks_app",
    "responses_app",
    "workers",
    "openai_app",
    "ops_app",
    "playground_app",
    "lmsp_client",
)
# The composition root wires everything together and may import anything;
# nothing else imports it.
COMPOSITION_ROOT = "lmsp_project"


def imported_modules(path: Path, modules: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """Dotted names a module imports, at module level or inside functions,
    TYPE_CHECKING blocks included, relative imports resolved. ``from p import
    x`` names ``p.x`` when that is one of ``modules``, else ``p``."""
    relative = path.relative_to(ROOT).with_suffix("")
    package = relative.parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = ".".join(part for part in (base, node.module) if part)
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in modules else module)
    return found


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports (see ``imported_modules``)."""
    return {name.split(".")[0] for name in imported_modules(path) if name}


def package_imports() -> dict[str, set[str]]:
    names = (*PACKAGES, COMPOSITION_ROOT)
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        for path in (ROOT / name).rglob("*.py"):
            graph[name] |= (imported_packages(path) & set(names)) - {name}
    return graph


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def module_imports() -> dict[str, set[str]]:
    """Every module of the service and the client (migrations aside) and the
    modules of the service it imports."""
    paths = {
        module_name(path): path
        for name in (*PACKAGES, COMPOSITION_ROOT)
        for path in (ROOT / name).rglob("*.py")
        if "migrations" not in path.parts
    }
    known = set(paths)
    return {name: (imported_modules(path, known) & known) - {name} for name, path in paths.items()}


def rings(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's
    algorithm): modules that import each other, directly or around a ring."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_packages_import_each_other():
    graph = package_imports()
    both_ways = sorted(
        (a, b) for a in PACKAGES for b in graph[a] if a < b and a in graph.get(b, set())
    )
    assert both_ways == []


def test_nothing_below_the_composition_root_imports_it():
    """The layers take the Redis client and the Celery app from the kernel
    (``lmsp_core.redis_client``, ``lmsp_core.celery_app``), not from
    ``lmsp_project``, which imports every layer."""
    graph = package_imports()
    assert [name for name in PACKAGES if COMPOSITION_ROOT in graph[name]] == []


def test_no_modules_import_each_other():
    assert rings(module_imports()) == []


def test_the_ring_finder_finds_rings_of_any_length():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"} - {"e"}}
    assert rings(graph) == [["a", "b", "c"]]


def test_the_kernel_imports_no_app():
    assert package_imports()["lmsp_core"] == set()


def test_the_client_imports_nothing_of_the_service():
    assert package_imports()["lmsp_client"] == set()


def test_the_engine_imports_no_app_and_no_django():
    """The engine generates and nothing else: no package of the service, and
    not Django (an engine behind another server implements the same
    ``engine.interface``)."""
    assert package_imports()["engine"] == set()
    django_imports = {
        module_name(path): sorted(
            name for name in imported_modules(path) if name.split(".")[0] == "django"
        )
        for path in (ROOT / "engine").rglob("*.py")
    }
    assert {name: found for name, found in django_imports.items() if found} == {}


def test_importing_every_engine_module_loads_no_django():
    """In a fresh interpreter, every module of ``engine`` imports without
    Django being loaded along the way (through a dependency, say)."""
    modules = sorted(module_name(path) for path in (ROOT / "engine").rglob("*.py"))
    probe = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(','.join(m for m in sys.modules if m.split('.')[0] == 'django') or 'none')\n"
    )
    environment = {
        key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"
    }
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env=environment,
    )
    assert len(modules) > 1 and result.stdout.strip() == "none", result.stderr


def test_the_generation_side_imports_only_the_kernel():
    assert package_imports()["generation"] <= {"lmsp_core"}


def test_nothing_imports_the_openai_adapter():
    """The OpenAI-compatible API sits on top: only the composition root mounts it."""
    graph = package_imports()
    assert [name for name in PACKAGES if "openai_app" in graph[name]] == []


def test_only_the_worker_records_into_the_operators_app():
    graph = package_imports()
    importers = [name for name in PACKAGES if "ops_app" in graph[name]]
    assert importers == ["workers"]


def test_the_checker_sees_imports_inside_functions_and_relative_ones():
    module = ROOT / "responses_app" / "records.py"
    found = imported_modules(module)
    assert {"tasks_app.endings", "responses_app.models"} <= found
    assert imported_packages(ROOT / "workers" / "serve.py") >= {"generation", "lmsp_core"}


WEB_PROCESS = (
    "import lmsp_project.asgi, lmsp_project.urls\n"
    "from django.urls import get_resolver\n"
    "get_resolver().url_patterns\n"
    "from generation.registry import get_model\n"
    "from generation.tokens import prompt_tokenizer\n"
    "tokenizer = prompt_tokenizer(get_model('smollm2:135m'))\n"
    "tokenizer.count(tokenizer.render([{'role': 'user', 'content': 'Hi'}]))\n"
)
# The Celery app as the ops worker loads it (every app's jobs, found), then
# told it is ready, consuming the ops queue alone as the Procfile has it.
OPS_WORKER = (
    "from celery.signals import worker_ready\n"
    "from lmsp_project.celery import app\n"
    "app.loader.import_default_modules()\n"
    "assert 'workers.tasks.run_task' in app.tasks\n"
    "app.amqp.queues.select(['lmsp.control'])\n"
    "worker_ready.send(sender=type('Ready', (), {'app': app, 'hostname': 'ops@probe'}))\n"
)


@pytest.mark.parametrize("process", [WEB_PROCESS, OPS_WORKER], ids=["web", "ops"])
def test_the_web_and_ops_processes_do_not_import_the_model_stack(process):  # noqa: ANN001
    """What the web process serves (the URL configuration, every view and the
    admin) loads without torch, transformers' model code or xgrammar, and so
    does rendering a prompt and counting its tokens; the ops worker, which
    never generates, starts without them too (seconds of each start)."""
    probe = (
        "import os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'lmsp_project.settings')\n"
        "import django\n"
        "django.setup()\n"
        f"{process}"
        "heavy = ('torch', 'xgrammar', 'transformers.modeling_utils')\n"
        "print(','.join(m for m in heavy if m in sys.modules) or 'none')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "none", result.stderr
