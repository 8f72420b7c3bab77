"""A newcomer's first hour: a fresh clone, the README's commands, nothing exported.

The repository is cloned into a temporary folder and ``scripts/serve`` runs
there as the README says (it builds the clone's own .venv, starts an embedded
PostgreSQL and a private Redis under the clone's .data/): begun at
collection, see tests/fresh_clone.py. The tests then use the service as a
user would: the dev token it prints, the README's ``manage.py`` commands
beside it, the admin, the metrics; and finally Ctrl-C (SIGINT to its process
group) must leave no process behind, and ``manage.py`` must still work with
the service stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from .conftest import request_body
from .fresh_clone import ServedClone, processes_of

pytestmark = pytest.mark.e2e

# What the README tells a user to run for a token (verbatim but for the user name).
TOKEN_COMMAND = (
    ".venv/bin/python manage.py lmsp_token create --user me "
    "--scopes models:read,responses:write,responses:read,tasks:write,tasks:read,metrics:read"
)


def generate(fresh_clone: ServedClone, token: str, **extra: object) -> dict:
    answer = httpx.post(
        f"{fresh_clone.base_url}/lmsp/v1/responses",
        headers={"Authorization": f"Bearer {token}"},
        json=request_body(max_output_tokens=8, **extra),
        timeout=180,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_serve_answers_a_generation_with_the_dev_token_it_printed(fresh_clone: ServedClone):
    body = generate(fresh_clone, fresh_clone.dev_token)
    assert body["status"] in ("completed", "incomplete")
    assert body["output"][0]["content"][0]["text"].strip()


def last_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_readme_token_command_works_beside_serve(fresh_clone: ServedClone):
    token = last_line(fresh_clone.run(TOKEN_COMMAND))
    assert token.startswith("lmsp_")
    assert generate(fresh_clone, token)["output"]
    scraped = httpx.get(
        f"{fresh_clone.base_url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=60
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


def test_readme_admin_path(fresh_clone: ServedClone):
    """createsuperuser beside the running service, log in at /admin/, see the responses."""
    created = fresh_clone.run(
        ".venv/bin/python manage.py createsuperuser --no-input",
        DJANGO_SUPERUSER_USERNAME="boss",
        DJANGO_SUPERUSER_EMAIL="boss@example.com",
        DJANGO_SUPERUSER_PASSWORD="a long admin passphrase",
    )
    assert created.returncode == 0, created.stdout + created.stderr
    stored = generate(fresh_clone, fresh_clone.dev_token, store=True)
    with httpx.Client(base_url=fresh_clone.base_url, timeout=60) as client:
        logged_in = admin_login(client, "boss", "a long admin passphrase")
        assert logged_in.status_code == 302 and logged_in.headers["location"] == "/admin/"
        listing = client.get("/admin/responses_app/response/")
        assert listing.status_code == 200
        assert "/admin/login/" not in str(listing.url)
        assert stored["id"] in listing.text


def test_ctrl_c_stops_every_process_serve_started(fresh_clone: ServedClone):
    assert (fresh_clone.folder / ".data" / "postgres" / "postmaster.pid").exists()
    assert processes_of(fresh_clone.folder), "the embedded services should be running"
    os.killpg(fresh_clone.process.pid, signal.SIGINT)
    assert fresh_clone.process.wait(90) == 0, fresh_clone.output()[-5000:]
    deadline = time.monotonic() + 30
    left = processes_of(fresh_clone.folder, pgid=fresh_clone.process.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_of(fresh_clone.folder, pgid=fresh_clone.process.pid)
    assert not left, "\n".join(left) + "\n" + fresh_clone.output()[-3000:]


def test_manage_py_works_with_the_service_stopped(fresh_clone: ServedClone):
    """The embedded PostgreSQL is started for the command and stopped after it."""
    assert fresh_clone.process.poll() is not None
    token = last_line(fresh_clone.run(TOKEN_COMMAND))
    assert token.startswith("lmsp_")
    revoked = fresh_clone.run(".venv/bin/python manage.py lmsp_token revoke " + token.split("_")[1])
    assert revoked.returncode == 0, revoked.stdout + revoked.stderr
    pruned = fresh_clone.run(".venv/bin/python manage.py lmsp_prune_events")
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert processes_of(fresh_clone.folder) == []
