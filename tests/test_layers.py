"""The map of the code holds: imports between the packages run one way, and the
web process does not load the model stack (README, "Architecture")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The kernel, the torch-free generation side, the apps, the worker runtime, and
# the client (which users install without the service).
PACKAGES = (
    "lmsp_core",
    "generation",
    "accounts_app",
    "tasks_app",
    "responses_app",
    "workers",
    "openai_app",
    "ops_app",
    "lmsp_client",
)
# The composition root wires everything together and may import anything.
COMPOSITION_ROOT = {"lmsp_project/urls.py", "lmsp_project/asgi.py", "lmsp_project/celery.py"}


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, at module level or inside functions,
    TYPE_CHECKING blocks included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def package_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in PACKAGES}
    for name in PACKAGES:
        for path in (ROOT / name).rglob("*.py"):
            if str(path.relative_to(ROOT)) in COMPOSITION_ROOT:
                continue
            graph[name] |= (imported_packages(path) & set(PACKAGES)) - {name}
    return graph


def test_no_two_packages_import_each_other():
    graph = package_imports()
    both_ways = sorted(
        (a, b) for a in PACKAGES for b in graph[a] if a < b and a in graph.get(b, set())
    )
    assert both_ways == []


def test_the_kernel_imports_no_app():
    assert package_imports()["lmsp_core"] == set()


def test_the_client_imports_nothing_of_the_service():
    assert package_imports()["lmsp_client"] == set()


def test_the_generation_side_imports_only_the_kernel():
    assert package_imports()["generation"] <= {"lmsp_core"}


def test_nothing_imports_the_openai_adapter():
    """The OpenAI-compatible API sits on top: only the composition root mounts it."""
    assert [name for name, imports in package_imports().items() if "openai_app" in imports] == []


def test_only_the_worker_records_into_the_operators_app():
    importers = [name for name, imports in package_imports().items() if "ops_app" in imports]
    assert importers == ["workers"]


def test_the_checker_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tasks_app import lifecycle\n    import workers.runner\n")
    assert imported_packages(module) == {"tasks_app", "workers"}


def test_the_web_process_does_not_import_the_model_stack():
    """What the web process serves (the URL configuration, every view and the
    admin) loads without torch, transformers' model code or xgrammar, and so
    does rendering a prompt and counting its tokens."""
    probe = (
        "import os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'lmsp_project.settings')\n"
        "import django\n"
        "django.setup()\n"
        "import lmsp_project.asgi, lmsp_project.urls\n"
        "from django.urls import get_resolver\n"
        "get_resolver().url_patterns\n"
        "from generation.registry import get_model\n"
        "from generation.tokens import prompt_tokenizer\n"
        "tokenizer = prompt_tokenizer(get_model('smollm2:135m'))\n"
        "tokenizer.count(tokenizer.render([{'role': 'user', 'content': 'Hi'}]))\n"
        "heavy = ('torch', 'xgrammar', 'transformers.modeling_utils')\n"
        "print(','.join(m for m in heavy if m in sys.modules) or 'none')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "none", result.stderr
