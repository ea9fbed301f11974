"""Test-wide settings (no hub access, 8 CPU devices so sharding can be exercised) and shared fixtures."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402  (after the environment: jax reads XLA_FLAGS at import)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (untied head, seed 3), loaded in float32."""
    import randkv_jax
    from tests.hf_tiny import save_tiny

    directory = tmp_path_factory.mktemp("qwen3_untied")
    save_tiny("qwen3_untied", directory, seed=3)
    return randkv_jax.load_model(directory, dtype="float32")
