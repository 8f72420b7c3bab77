"""A newcomer's first hour: a fresh clone, the README's commands, nothing exported.

The repository is cloned into a temporary folder and ``scripts/serve`` runs
there as the README says (it builds the clone's own .venv, starts an embedded
PostgreSQL and a private Redis under the clone's .data/). The tests then use
the service as a user would: the dev token it prints, the README's
``manage.py`` commands beside it, the admin, the metrics; and finally Ctrl-C
(SIGINT to its process group) must leave no process behind, and
``manage.py`` must still work with the service stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from lmsp_project.devstack import free_port

from .conftest import request_body

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
# Installing the clone's .venv from pip's cache, converting the model and
# starting everything: a few minutes; beyond this something is wrong.
SERVE_READY_SECONDS = 900
# What the README tells a user to run for a token (verbatim but for the user name).
TOKEN_COMMAND = (
    ".venv/bin/python manage.py lmsp_token create --user me "
    "--scopes models:read,responses:write,responses:read,tasks:write,tasks:read,metrics:read"
)


@dataclass
class ServedClone:
    folder: Path
    process: subprocess.Popen
    log: Path
    port: int
    env: dict[str, str]
    dev_token: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def run(self, command: str, **env: str) -> subprocess.CompletedProcess:
        """A README command, run in the clone's folder through a shell as a user would."""
        return subprocess.run(
            command,
            shell=True,
            cwd=self.folder,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )


def newcomer_env(port: int) -> dict[str, str]:
    """The environment of someone who has set nothing: none of the suite's
    service addresses, data folder or virtual environment."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("LMSP_", "DJANGO_", "CELERY_"))
        and name not in {"DATABASE_URL", "REDIS_URL", "VIRTUAL_ENV", "PYTHONPATH"}
    }
    ours = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    env["LMSP_PORT"] = str(port)  # the default 8000 may be taken on a shared machine
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_for(predicate, timeout: float, what: str, clone: ServedClone | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if clone is not None and clone.process.poll() is not None:
            pytest.fail(f"scripts/serve exited ({clone.process.returncode}):\n{clone.output()}")
        time.sleep(0.5)
    tail = clone.output()[-5000:] if clone is not None else ""
    pytest.fail(f"{what} not within {timeout}s\n{tail}")


def processes_of(folder: Path, pgid: int | None = None) -> list[str]:
    """Processes running from the clone: their working folder, command line or
    executable is inside it (PostgreSQL's run in its data folder, redis-server
    in its own), or they are in the serve command's process group."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd", "exe"]):
        info = proc.info
        text = " ".join([info["cwd"] or "", info["exe"] or "", *(info["cmdline"] or [])])
        in_group = False
        if pgid is not None:
            try:
                in_group = os.getpgid(info["pid"]) == pgid
            except OSError:
                continue
        if str(folder) in text or in_group:
            found.append(f"{info['pid']}: {' '.join(info['cmdline'] or [])} (cwd {info['cwd']})")
    return found


@pytest.fixture(scope="module")
def clone() -> Iterator[ServedClone]:
    # Not under pytest's base folder: as root, the embedded PostgreSQL runs as
    # its own user, which must traverse the folders above the clone, and pytest
    # makes /tmp/pytest-of-root private again whenever any session starts.
    top = Path(tempfile.mkdtemp(prefix="lmsp-fresh-clone-"))
    try:
        yield from served_clone(top / "lmsp")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def served_clone(folder: Path) -> Iterator[ServedClone]:
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(folder)], check=True)
    assert not (folder / ".venv").exists() and not (folder / ".data").exists()
    port = free_port()
    env = newcomer_env(port)
    log = folder.parent / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["scripts/serve"],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal gives it
            # and Ctrl-C acts, as in a terminal, even if this suite runs with it ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    served = ServedClone(folder, process, log, port, env, dev_token="")
    try:
        wait_for(
            lambda: (
                "Application startup complete" in served.output()
                and re.search(r"worker\.1 .*ready\.", served.output())
            ),
            SERVE_READY_SECONDS,
            "scripts/serve ready",
            served,
        )
        match = re.search(r"shown only this once:\s*\n(lmsp_\S+)", served.output())
        assert match, served.output()
        served.dev_token = match.group(1)
        yield served
    finally:
        if process.poll() is None:  # a test failed before Ctrl-C: leave nothing running
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        for pid_line in processes_of(folder):
            pid = int(pid_line.split(":", 1)[0])
            with_suppress_kill(pid)


def with_suppress_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def generate(clone: ServedClone, token: str, **extra: object) -> dict:
    answer = httpx.post(
        f"{clone.base_url}/lmsp/v1/responses",
        headers={"Authorization": f"Bearer {token}"},
        json=request_body(max_output_tokens=8, **extra),
        timeout=180,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_serve_answers_a_generation_with_the_dev_token_it_printed(clone: ServedClone):
    body = generate(clone, clone.dev_token)
    assert body["status"] in ("completed", "incomplete")
    assert body["output"][0]["content"][0]["text"].strip()


def last_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_readme_token_command_works_beside_serve(clone: ServedClone):
    token = last_line(clone.run(TOKEN_COMMAND))
    assert token.startswith("lmsp_")
    assert generate(clone, token)["output"]
    scraped = httpx.get(
        f"{clone.base_url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=60
    )
    assert scraped.status_code == 200, scraped.text
    assert 'lmsp_output_tokens_total{model="smollm2:135m"}' in scraped.text


def admin_login(client: httpx.Client, username: str, password: str) -> httpx.Response:
    page = client.get("/admin/login/?next=/admin/")
    assert page.status_code == 200
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    return client.post(
        "/admin/login/?next=/admin/",
        data={
            "csrfmiddlewaretoken": csrf,
            "username": username,
            "password": password,
            "next": "/admin/",
        },
        headers={"Referer": f"{client.base_url}/admin/login/"},
    )


def test_readme_admin_path(clone: ServedClone):
    """createsuperuser beside the running service, log in at /admin/, see the responses."""
    created = clone.run(
        ".venv/bin/python manage.py createsuperuser --no-input",
        DJANGO_SUPERUSER_USERNAME="boss",
        DJANGO_SUPERUSER_EMAIL="boss@example.com",
        DJANGO_SUPERUSER_PASSWORD="a long admin passphrase",
    )
    assert created.returncode == 0, created.stdout + created.stderr
    stored = generate(clone, clone.dev_token, store=True)
    with httpx.Client(base_url=clone.base_url, timeout=60) as client:
        logged_in = admin_login(client, "boss", "a long admin passphrase")
        assert logged_in.status_code == 302 and logged_in.headers["location"] == "/admin/"
        listing = client.get("/admin/responses_app/response/")
        assert listing.status_code == 200
        assert "/admin/login/" not in str(listing.url)
        assert stored["id"] in listing.text


def test_ctrl_c_stops_every_process_serve_started(clone: ServedClone):
    assert (clone.folder / ".data" / "postgres" / "postmaster.pid").exists()
    assert processes_of(clone.folder), "the embedded services should be running"
    os.killpg(clone.process.pid, signal.SIGINT)
    assert clone.process.wait(90) == 0, clone.output()[-5000:]
    deadline = time.monotonic() + 30
    left = processes_of(clone.folder, pgid=clone.process.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_of(clone.folder, pgid=clone.process.pid)
    assert not left, "\n".join(left) + "\n" + clone.output()[-3000:]


def test_manage_py_works_with_the_service_stopped(clone: ServedClone):
    """The embedded PostgreSQL is started for the command and stopped after it."""
    assert clone.process.poll() is not None
    token = last_line(clone.run(TOKEN_COMMAND))
    assert token.startswith("lmsp_")
    revoked = clone.run(".venv/bin/python manage.py lmsp_token revoke " + token.split("_")[1])
    assert revoked.returncode == 0, revoked.stdout + revoked.stderr
    pruned = clone.run(".venv/bin/python manage.py lmsp_prune_events")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert processes_of(clone.folder) == []
