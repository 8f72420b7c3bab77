"""Small C functions of our own (``decode_attention``, ``row_products``),
built with the machine's C compiler the first time a worker needs them and
loaded through ctypes.

Why built here rather than shipped built: each is compiled for the machine's
own instruction set (``-march=native``: AVX-512 on one machine, AVX2 on
the next), and without torch's headers it builds in under a second; a
library is kept in ``cache_dir()`` under a name that changes with its
source, the flags, the compiler and the CPU. The caller falls back to
torch's own operators where there is no compiler or the build fails.

Why the cache is checked before anything in it is loaded: loading a library
runs its constructors, as the worker, whose environment holds the database
password. So the folder and the library must belong to the worker's user and
be writable by nobody else (else the caller falls back, as for a failed
build); a library is built under a temporary name in the folder and renamed
whole; and its name carries the sha256 of its bytes, taken when it was built,
which its bytes must still match before it is loaded (else it is removed and
built again).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built libraries are kept: ``LMSP_KERNEL_CACHE``, else the user's cache."""
    configured = os.environ.get("LMSP_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmsp"


def compiler() -> str | None:
    """The C compiler to build with: ``CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def function(
    source: Path,
    compile_flags: Sequence[str],
    link_flags: Sequence[str],
    name: str,
    restype: type[ctypes._SimpleCData[Any]] | None,
    argtypes: Sequence[type[ctypes._SimpleCData[Any]]],
) -> Callable[..., Any]:
    """The C function ``name`` of ``source`` built with these flags (into
    ``cache_dir()`` unless an intact build is there), loaded, with its
    argument and result types; raises ``OSError`` where it cannot be built
    or the cache may not be trusted."""
    try:
        library = ctypes.CDLL(str(_built(source, compile_flags, link_flags)))
    except subprocess.SubprocessError as error:
        raise OSError(f"the C compiler failed: {error}") from error
    built = getattr(library, name)
    built.restype = restype
    built.argtypes = argtypes
    return cast(Callable[..., Any], built)


def _built(source: Path, compile_flags: Sequence[str], link_flags: Sequence[str]) -> Path:
    compiler_path = compiler()
    if compiler_path is None:
        raise OSError("no C compiler (cc or gcc) on the PATH")
    version = subprocess.run(
        [compiler_path, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256(
        "\n".join([source.read_text(), *compile_flags, *link_flags, version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _refuse_unless_private(folder, "folder")
    for found in sorted(folder.glob(f"{source.stem}-{key}-*.so")):
        _refuse_unless_private(found, "library")
        if _digest(found) == found.stem.rpartition("-")[2]:
            return found
        log.warning("%s does not match its digest; built again.", found)
        found.unlink()
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        obj, library = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        # Two commands: a flag such as -ffast-math at the link would add
        # startup code that turns on flush-to-zero for the whole process.
        for command in (
            [compiler_path, *compile_flags, "-c", str(source), "-o", str(obj)],
            [compiler_path, "-shared", str(obj), "-o", str(library), *link_flags],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        library.chmod(0o755)  # writable by its owner alone, whatever the umask
        target = folder / f"{source.stem}-{key}-{_digest(library)}.so"
        os.replace(library, target)  # whole, even with another worker building it too
    return target


def _refuse_unless_private(path: Path, what: str) -> None:
    """Raise unless ``path`` (not a link) belongs to this process's user and
    no other user or group may write to it."""
    status = path.lstat()
    if stat.S_ISLNK(status.st_mode):
        raise OSError(f"the kernel cache {what} {path} is a symbolic link")
    if status.st_uid != os.geteuid():
        raise OSError(
            f"the kernel cache {what} {path} belongs to user {status.st_uid}, not this one"
        )
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(
            f"the kernel cache {what} {path} is writable by its group or others "
            f"(mode {stat.filemode(status.st_mode)}; chmod go-w it)"
        )


def _digest(library: Path) -> str:
    """The sha256 of the library's bytes."""
    with library.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _cpu_flags() -> str:
    """What ``-march=native`` builds for: the CPU's flags where Linux lists them."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()
