"""The docs a newcomer reads: short enough to read, and every shell line in
them runs, verbatim.

Each ```` ```sh ```` block of ``README.md`` and ``docs/*.md`` is run, in
order, one ``bash -euo pipefail`` per file, from the checkout, against the
test stack: ``LMSP_BASE_URL`` and ``LMSP_TOKEN`` name the stack and a token
with every scope, ``DATABASE_URL`` and ``REDIS_URL`` its servers (as
``scripts/serve`` leaves them for ``manage.py``). A block a person runs
(it starts or stops the whole service, or needs Docker or a second
terminal) is fenced ```` ```sh manual ````; ``MANUAL`` lists them by their
first line, so that adding one is a decision (docs/development.md).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .stack import Stack

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MANUAL = {
    "upstream.md": [
        "vllm serve /srv/models/smollm2-135m --served-model-name smollm2:135m \\",
        "export LMSP_VLLM_API_KEY=... LMSP_WORKER_MODELS=smollm2:135m-vllm",
        "docker compose -f compose.yaml -f compose.upstream.yaml up",
    ],
    "README.md": [
        "scripts/serve   # install into .venv, then run the whole service on http://127.0.0.1:8000",
        "export LMSP_BASE_URL=http://127.0.0.1:8000 LMSP_TOKEN=...   # as above",
        """kill -9 "$(pgrep -f 'uvicorn lmsp_project.asgi')\"""",
    ],
    "development.md": [
        "scripts/serve               # install, then run the whole service on http://127.0.0.1:8000"
    ],
    "operations.md": [
        "cp .env.example .env                # set POSTGRES_PASSWORD, LMSP_SECRET_KEY, "
        "LMSP_ALLOWED_HOSTS"
    ],
}
MOST_LINES = {"README.md": 299}  # every file of docs/: 399


def blocks(doc: Path) -> list[tuple[str, str]]:
    """The doc's shell blocks: (``sh`` or ``sh manual``, their text)."""
    return [
        (info.strip(), text)
        for info, text in FENCE.findall(doc.read_text())
        if info.split()[:1] == ["sh"]
    ]


def runnable(doc: Path) -> str:
    return "".join(text for info, text in blocks(doc) if info == "sh")


def test_each_doc_is_short_and_the_readme_links_every_one() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in DOCS:
        lines = len(doc.read_text().splitlines())
        assert lines <= MOST_LINES.get(doc.name, 399), f"{doc.name}: {lines} lines"
        if doc.parent.name == "docs":
            assert f"](docs/{doc.name})" in readme, f"the README does not link {doc.name}"
    top = blocks(ROOT / "README.md")[0][1].splitlines()  # the two commands, first
    assert [line.split()[0] for line in top] == ["scripts/serve", "scripts/test"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_finds_its_file_and_heading() -> None:
    for doc in [*DOCS, ROOT / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            assert linked.exists(), f"{doc.name} links {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.MULTILINE)
                assert anchor in {slug(h) for h in headings}, f"{doc.name} links {target}"


def test_the_blocks_a_person_runs_are_the_listed_ones() -> None:
    for doc in DOCS:
        manual = [text.splitlines()[0] for info, text in blocks(doc) if info != "sh"]
        assert manual == MANUAL.get(doc.name, []), doc.name
        assert all(info in ("sh", "sh manual") for info, _ in blocks(doc)), doc.name


@pytest.mark.e2e
@pytest.mark.parametrize("doc", [doc for doc in DOCS if runnable(doc)], ids=lambda doc: doc.name)
def test_every_shell_line_of_a_doc_runs(stack: Stack, token: str, doc: Path) -> None:
    env = {**stack.env, "LMSP_BASE_URL": stack.base_url, "LMSP_TOKEN": token}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", runnable(doc)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, (
        f"{doc.name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
