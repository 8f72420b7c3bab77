"""The ways the service is run agree: compose.yaml runs the Procfile's
commands, waits for migrations, has a GPU worker, health checks and secrets
from an env file (parsed: no Docker engine runs here); beat keeps its schedule
in LMSP_DATA_DIR; the health command that compose uses answers."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from generation.registry import parse_registry
from ops_app.management.commands.lmsp_health import worker_alive

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = ("web", "worker", "ops")


def procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    entries = (re.match(r"^([A-Za-z0-9_-]+):\s*(.+)$", line) for line in lines)
    return {m.group(1): m.group(2) for m in entries if m}


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def expand(command: str, env: dict[str, str]) -> list[str]:
    """The Procfile line as its shell would run it with ``env``."""

    def value(match: re.Match) -> str:
        return str(env.get(match.group(1), match.group(2) or ""))

    return shlex.split(re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", value, command))


def test_compose_runs_the_procfile_commands():
    services = compose()["services"]
    for name, command in procfile().items():
        service = services[name]
        assert service["command"] == expand(command, service["environment"]), name
    assert services["worker-gpu"]["command"] == services["worker"]["command"]
    # the web listens on every interface in its container, on 127.0.0.1 under scripts/serve
    assert "0.0.0.0" in services["web"]["command"]
    assert "127.0.0.1" in expand(procfile()["web"], {})


def test_web_and_workers_wait_for_the_one_shot_migration():
    services = compose()["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["python", "manage.py", "migrate", "--no-input"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in (*PROCESSES, "worker-gpu"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        assert depends["postgres"]["condition"] == "service_healthy", name
        assert depends["redis"]["condition"] == "service_healthy", name


def test_gpu_worker_reserves_a_gpu_and_builds_the_cuda_torch():
    services = compose()["services"]
    gpu = services["worker-gpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert gpu["build"]["args"]["TORCH"].startswith("cu")
    assert gpu["profiles"] == ["gpu"]  # only where asked for: most hosts have no GPU
    for name in PROCESSES:
        assert services[name]["build"]["args"]["TORCH"] == "cpu"
        assert services[name]["image"] != gpu["image"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH=cpu$", dockerfile, re.M)
    assert 'TORCH_INDEX_URL="https://download.pytorch.org/whl/${TORCH}" scripts/install' in (
        dockerfile
    )
    install = (ROOT / "scripts" / "install").read_text()
    assert '"torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in install


def test_the_upstream_override_gives_every_lmsp_service_its_models():
    """compose.upstream.yaml (docs/upstream.md) over compose.yaml: a vLLM
    service with a health check, and the models file and tokenizer folder in
    every service that reads the registry; the worker alone gets the key."""
    override = yaml.safe_load((ROOT / "compose.upstream.yaml").read_text())["services"]
    assert set(override) - {"vllm"} <= set(compose()["services"])
    for name in ("web", "worker", "ops"):
        assert override[name]["environment"]["LMSP_MODELS_FILE"] == "/app/models.upstream.toml"
        assert "./models.upstream.toml:/app/models.upstream.toml:ro" in override[name]["volumes"]
    [spec] = parse_registry((ROOT / "models.upstream.toml").read_text()).values()
    assert spec.upstream is not None and spec.upstream.base_url == "http://vllm:8000/v1"
    assert spec.upstream.api_key_env in override["worker"]["environment"]
    assert spec.upstream.api_key_env not in override["web"]["environment"]
    vllm = override["vllm"]
    served = vllm["command"][vllm["command"].index("--served-model-name") + 1]
    assert served == spec.upstream.model and "healthcheck" in vllm
    folder = f"{Path(spec.path).parent}"
    assert any(volume.split(":")[1].startswith(folder) for volume in vllm["volumes"])


def test_every_long_running_service_has_a_health_check():
    services = compose()["services"]
    for name in ("postgres", "redis", *PROCESSES, "worker-gpu"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and len(test) > 1, name
    assert "/healthz" in " ".join(services["web"]["healthcheck"]["test"])
    assert services["worker"]["healthcheck"]["test"][-2:] == ["lmsp_health", "worker"]
    assert services["ops"]["healthcheck"]["test"][-2:] == ["lmsp_health", "ops"]


def test_secrets_come_from_an_env_file():
    text = (ROOT / "compose.yaml").read_text()
    services = compose()["services"]
    for name in (*PROCESSES, "migrate", "worker-gpu"):
        assert services[name]["env_file"] == [{"path": ".env", "required": True}], name
        assert "LMSP_SECRET_KEY" not in services[name]["environment"], name
    assert "change-me" not in text
    assert "${POSTGRES_PASSWORD:?" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert "${POSTGRES_PASSWORD:?" in services["web"]["environment"]["DATABASE_URL"]
    example = (ROOT / ".env.example").read_text()
    assert "LMSP_SECRET_KEY=" in example and "POSTGRES_PASSWORD=" in example
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


@pytest.mark.e2e
def test_the_web_takes_the_tls_proxy_settings_from_the_env_file():
    """Behind a proxy that terminates TLS (README, "Operations") compose's web
    gets them from .env, which documents them; the image runs plain HTTP."""
    web = compose()["services"]["web"]["environment"]
    example = (ROOT / ".env.example").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name in ("LMSP_BEHIND_TLS_PROXY", "LMSP_CSRF_TRUSTED_ORIGINS", "LMSP_HSTS_SECONDS"):
        assert web[name].startswith("${" + name + ":-"), name
        assert f"\n{name}=" in example, name
    assert "LMSP_BEHIND_TLS_PROXY=0" in dockerfile and "LMSP_HSTS_SECONDS=0" in dockerfile


def test_ops_keeps_beat_schedule_in_the_data_dir(stack, tmp_path: Path):
    """The Procfile's ops line, run as honcho runs it (a shell in the checkout),
    with LMSP_DATA_DIR elsewhere: beat writes its schedule there and keeps running."""
    data = tmp_path / "data"
    data.mkdir()
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**stack.env, "LMSP_DATA_DIR": str(data), "PATH": path}
    log = tmp_path / "ops.log"
    with open(log, "w") as out:
        ops = subprocess.Popen(
            ["/bin/sh", "-c", procfile()["ops"]],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while not list(data.glob("celerybeat-schedule*")):
            assert ops.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(2)  # beat has started ticking: it must still be there
        assert ops.poll() is None, log.read_text()
    finally:
        os.killpg(ops.pid, signal.SIGTERM)
        ops.wait(30)


def manage(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.e2e
def test_health_command_sees_this_host_worker_and_a_fresh_sweeper(stack):
    worker = manage(stack, "lmsp_health", "worker")
    assert worker.returncode == 0, worker.stderr
    deadline = time.monotonic() + 60
    ops = manage(stack, "lmsp_health", "ops")
    while ops.returncode != 0 and time.monotonic() < deadline:  # the first sweep may be due
        time.sleep(1)
        ops = manage(stack, "lmsp_health", "ops")
    assert ops.returncode == 0, ops.stderr
    assert not worker_alive("some-other-host")
