"""The type check: mypy with django-stubs over the service and the client, as
``[tool.mypy]`` in pyproject.toml sets it (strict for every package but
tasks_app and responses_app, which are checked, not yet strict), reports
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "lmsp_project.settings"}
    checked = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found" in checked.stdout
