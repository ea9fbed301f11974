"""Test-wide settings: no hub access, and 4 CPU devices so sharding can be exercised."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
