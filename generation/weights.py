"""Where a model's weights and tokenizer are: each GGUF file converted once to disk.

Loading SmolLM2 from its GGUF file dequantizes every tensor (about 15 s);
the converted safetensors folder in ``LMSP_MODEL_CACHE`` loads in about a
second. ``save_pretrained`` refuses a GGUF-loaded model, so the model is
rebuilt from its config without the quantization marker first.

transformers is imported only inside the conversion, so that the web process
(which needs the folder for the tokenizer files) imports neither torch nor
transformers.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from pathlib import Path

from django.conf import settings

from .registry import ModelSpec

log = logging.getLogger(__name__)

READY_MARKER = ".lmsp-ready"


def _converted(spec: ModelSpec) -> Path:
    return Path(settings.LMSP_MODEL_CACHE) / spec.slug


def is_ready(spec: ModelSpec) -> bool:
    """Whether ``weights_folder`` would answer at once (nothing to convert)."""
    source = spec.source_location()
    if source is None or spec.source == "folder":
        return source is not None
    return (_converted(spec) / READY_MARKER).exists()


def weights_folder(spec: ModelSpec) -> Path:
    """A folder ``from_pretrained`` loads quickly, converting a GGUF file once."""
    source = spec.source_location()
    if source is None:
        raise FileNotFoundError(f"The weights of {spec.id} are not on this machine.")
    if spec.source == "folder":
        return source
    target = _converted(spec)
    if (target / READY_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{spec.slug}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per machine
        if not (target / READY_MARKER).exists():
            _convert_gguf(spec, source, target)
    return target


def _convert_gguf(spec: ModelSpec, source: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s from %s (once)", spec.id, source / spec.file)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=spec.file)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=spec.file)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / READY_MARKER).touch()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
