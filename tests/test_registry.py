"""How a model runs, from its entry in models.toml: the settings, their
defaults, and the entries refused (``generation.registry``); the token
budget a GPU's memory leaves (``workers.loading.derived_budget``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from generation.registry import ModelSpec, parse_registry
from workers.loading import derived_budget

ENTRY = """
[[models]]
id = "m"
source = "folder"
path = "/models/m"
context_window = 4096
max_output_tokens = 1024
"""


def test_a_models_settings_default_to_what_suits_its_device():
    (spec,) = parse_registry(ENTRY).values()
    assert (spec.dtype, spec.device, spec.attention) == ("auto", "auto", "sdpa")
    assert spec.linear == "auto"  # packed on a CPU, torch's own layers on a GPU
    assert spec.cpu_threads == 0  # every core
    assert (spec.kv_budget_tokens, spec.prefill_chunk_tokens) == (0, 0)  # from the device
    assert spec.prefix_cache and spec.max_batch == 8 and spec.gpu_memory_fraction == 0.85


def test_every_setting_is_read():
    settings = """
dtype = "bfloat16"
device = "cuda:1"
attention = "eager"
linear = "torch"
cpu_threads = 6
kv_budget_tokens = 65536
gpu_memory_fraction = 0.5
prefill_chunk_tokens = 1024
prefix_cache = false
max_batch = 32
"""
    (spec,) = parse_registry(ENTRY + settings).values()
    assert spec == ModelSpec(
        id="m",
        source="folder",
        path="/models/m",
        context_window=4096,
        max_output_tokens=1024,
        capabilities=(),
        dtype="bfloat16",
        device="cuda:1",
        attention="eager",
        linear="torch",
        cpu_threads=6,
        kv_budget_tokens=65536,
        gpu_memory_fraction=0.5,
        prefill_chunk_tokens=1024,
        prefix_cache=False,
        max_batch=32,
    )


@pytest.mark.parametrize(
    "line, reason",
    [
        ('dtype = "float8"', "dtype 'float8'"),
        ('device = "tpu"', "device 'tpu'"),
        ('device = "cuda:x"', "device 'cuda:x'"),
        ('attention = "flash"', "attention 'flash'"),
        ('linear = "int8"', "linear 'int8'"),
        ("kv_budget_tokens = 4095", "kv_budget_tokens below the context window"),
        ("gpu_memory_fraction = 1.5", "gpu_memory_fraction"),
        ("cpu_threads = -1", "cpu_threads below 0"),
        ("prefill_chunk_tokens = -1", "prefill_chunk_tokens"),
        ("max_batch = 0", "max_batch"),
        ('capabilities = ["telepathy"]', "capabilities ['telepathy']"),
    ],
)
def test_a_bad_setting_is_refused_with_its_reason(line, reason):
    with pytest.raises(ValueError, match="bad entry 'm'") as refused:
        parse_registry(ENTRY + line + "\n")
    assert reason in str(refused.value)


def test_a_prefix_cache_is_shared_across_owners_only_when_said_in_so_many_words():
    (default,) = parse_registry(ENTRY).values()
    assert default.share_prefix_cache is False
    (shared,) = parse_registry(ENTRY + "share_prefix_cache = true\n").values()
    assert shared.share_prefix_cache is True
    # a string Python would call true is no yes
    for line in ('share_prefix_cache = "false"', "share_prefix_cache = 0", 'prefix_cache = "no"'):
        with pytest.raises(ValueError, match="bad entry 'm': .* must be true or false"):
            parse_registry(ENTRY + line + "\n")


def test_a_gpu_budget_is_what_its_memory_fraction_leaves_after_weights_and_a_step():
    spec = parse_registry(ENTRY).get("m")
    config = SimpleNamespace(intermediate_size=1536, hidden_size=576, vocab_size=49152)
    gib = 1 << 30
    # 80 GiB device, 70 GiB free once the weights are in, 0.85 of it ours
    budget = derived_budget(spec, config, 2 * 30 * 3 * 64 * 2, 2, 70 * gib, 80 * gib, 512)
    usable = 70 * gib - 0.15 * 80 * gib
    step = 4 * 512 * (1536 + 4 * 576) * 2 + 8 * 49152 * 4 * 2
    assert budget == int((usable - step) // (2 * 30 * 3 * 64 * 2))
    # a device already full leaves nothing, never a negative budget
    assert derived_budget(spec, config, 1000, 2, 1 * gib, 80 * gib, 512) == 0


UPSTREAM_ENTRY = """
[[models]]
id = "m:vllm"
source = "folder"
path = "/srv/m"
context_window = 4096
max_output_tokens = 512
capabilities = ["tools"]
[models.upstream]
base_url = "http://gpu:8000/v1/"
model = "m"
"""


def test_an_upstream_entry_names_its_server_and_keeps_no_key():
    [spec] = parse_registry(UPSTREAM_ENTRY + 'api_key_env = "M_KEY"\n').values()
    assert spec.upstream is not None
    assert (spec.upstream.base_url, spec.upstream.model, spec.upstream.engine) == (
        "http://gpu:8000/v1",
        "m",
        "vllm",
    )
    assert spec.upstream.api_key_env == "M_KEY"  # the variable's name, never its value
    # An unavailable server is waited for, by default ten minutes, tried again every 10 s at most.
    assert (spec.upstream.unavailable_timeout_seconds, spec.upstream.retry_seconds) == (600, 10)


def test_an_upstream_entry_sets_how_long_its_tasks_wait_for_it():
    extra = "unavailable_timeout_seconds = 90\nretry_seconds = 2.5\n"
    [spec] = parse_registry(UPSTREAM_ENTRY + extra).values()
    assert spec.upstream is not None
    assert (spec.upstream.unavailable_timeout_seconds, spec.upstream.retry_seconds) == (90, 2.5)


def test_a_server_asked_in_text_serves_a_model_without_tools_or_structured_output():
    entry = UPSTREAM_ENTRY.replace('capabilities = ["tools"]', 'capabilities = ["conversations"]')
    [spec] = parse_registry(entry + 'engine = "openai"\n').values()
    assert spec.upstream is not None and spec.upstream.engine == "openai"


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ('engine = "tgi"\n', "upstream engine 'tgi'"),
        ('engine = "openai"\n', "'openai', which cannot constrain output"),
        ('api_key = "secret"\n', "unknown upstream settings ['api_key']"),
        ("read_timeout_seconds = 0\n", "timeouts must be positive"),
        ("unavailable_timeout_seconds = -1\n", "timeouts must be positive"),
    ],
)
def test_a_bad_upstream_entry_is_refused(extra: str, refused: str):
    with pytest.raises(ValueError, match=refused.replace("[", r"\[").replace("]", r"\]")):
        parse_registry(UPSTREAM_ENTRY + extra)
