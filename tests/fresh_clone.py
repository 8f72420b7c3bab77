"""A fresh clone of the repository served as the README says, for
tests/test_fresh_clone.py: ``scripts/serve`` run in a temporary clone by
someone who has set nothing.

Why a module of its own: the clone's install and start take minutes (pip
builds its .venv, the model is converted, an embedded PostgreSQL and a
private Redis start under its .data/), so the suite begins it at
collection (tests/conftest.py), in the background, and its tests find it
ready instead of waiting for it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from lmsp_project.devstack import free_port

ROOT = Path(__file__).resolve().parent.parent
# Installing the clone's .venv from pip's cache, converting the model and
# starting everything: a few minutes; beyond this something is wrong.
SERVE_READY_SECONDS = 900


@dataclass
class ServedClone:
    folder: Path
    process: subprocess.Popen
    log: Path
    port: int
    env: dict[str, str]
    dev_token: str = ""

    @classmethod
    def begin(cls) -> ServedClone:
        """Clone the repository and start ``scripts/serve`` in it; returns at
        once (``wait_until_served`` waits for it)."""
        # Not under pytest's base folder: as root, the embedded PostgreSQL runs
        # as its own user, which must traverse the folders above the clone, and
        # pytest makes /tmp/pytest-of-root private again whenever any session
        # starts.
        folder = Path(tempfile.mkdtemp(prefix="lmsp-fresh-clone-")) / "lmsp"
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
        return cls(folder, process, log, port, env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until_served(self) -> None:
        """Until the web process and the model worker say they are ready;
        the dev token ``scripts/serve`` printed is then kept."""
        wait_for(
            lambda: (
                "Application startup complete" in self.output()
                and re.search(r"worker\.1 .*ready\.", self.output())
            ),
            SERVE_READY_SECONDS,
            "scripts/serve ready",
            self,
        )
        match = re.search(r"shown only this once:\s*\n(lmsp_\S+)", self.output())
        assert match, self.output()
        self.dev_token = match.group(1)

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

    def end(self) -> None:
        """Nothing left running from the clone (a test failed before Ctrl-C,
        or the session ended before its tests), and its folder removed."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        for pid_line in processes_of(self.folder):
            try:
                os.kill(int(pid_line.split(":", 1)[0]), signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.folder.parent, ignore_errors=True)


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


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, clone: ServedClone | None = None
) -> None:
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
