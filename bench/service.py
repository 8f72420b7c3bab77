"""The service for a bench, started as the Procfile starts it (honcho: web,
model worker, ops worker with beat), on the embedded PostgreSQL and Redis
unless DATABASE_URL / REDIS_URL are set.

    with procfile_service({"LMSP_MODELS_FILE": path}) as service:
        httpx.get(service.base_url + "/lmsp/v1/models", headers=service.headers)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LOGS = ROOT / "test-artifacts" / "bench"
SCOPES = "models:read,responses:write,responses:read,tasks:write,tasks:read,metrics:read"


@dataclass(frozen=True)
class Service:
    base_url: str
    token: str
    env: dict[str, str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextlib.contextmanager
def procfile_service(settings: dict[str, str] | None = None, models: int = 1) -> Iterator[Service]:
    """The service, ready once ``models`` models are served by a live worker;
    ``settings`` are added to its environment."""
    from lmsp_project.devstack import free_port, services

    with services() as started:
        port = free_port()
        python_dir = str(Path(sys.executable).parent)
        env = {
            **os.environ,
            **started,
            "LMSP_DEVELOPMENT": "1",
            "LMSP_PORT": str(port),
            "PATH": os.pathsep.join([python_dir, os.environ.get("PATH", "")]),
            **(settings or {}),
        }
        python = sys.executable
        subprocess.run(
            [python, "manage.py", "migrate", "--no-input", "-v", "0"], cwd=ROOT, env=env, check=True
        )
        created = subprocess.run(
            [python, "manage.py", "lmsp_token", "create", "--user", "bench", "--scopes", SCOPES],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        token = created.stdout.strip().splitlines()[-1]
        LOGS.mkdir(parents=True, exist_ok=True)
        log = open(LOGS / "procfile.log", "w")  # noqa: SIM115 - honcho's children keep it
        honcho = subprocess.Popen(
            [python, "-m", "honcho", "start", "-f", str(ROOT / "Procfile")],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        service = Service(f"http://127.0.0.1:{port}", token, env)
        try:
            _wait_until_served(service, models, honcho)
            yield service
        finally:
            os.killpg(honcho.pid, signal.SIGTERM)
            honcho.wait(60)
            log.close()


def _wait_until_served(service: Service, models: int, honcho: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if honcho.poll() is not None:
            raise RuntimeError(f"the service stopped; see {LOGS / 'procfile.log'}")
        with contextlib.suppress(httpx.HTTPError):
            metrics = httpx.get(f"{service.base_url}/metrics", headers=service.headers).text
            alive = [
                line
                for line in metrics.splitlines()
                if line.startswith("lmsp_workers_alive{") and not line.endswith(" 0.0")
            ]
            if len(alive) >= models:
                return
        time.sleep(0.5)
    raise RuntimeError(f"no worker served the models in time; see {LOGS / 'procfile.log'}")
