"""`examples/bench_accelerator.sh` end to end, at a tiny size on CPU: its flags are the CLI's, every
arm runs, and bench.json records where it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from tests.hf_tiny import save_tiny

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_accelerator.sh"


@pytest.mark.slow  # about a minute: every arm of the bench, bfloat16 on CPU
def test_bench_accelerator_script_runs(tmp_path):
    save_tiny("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["max_position_embeddings"] = 512  # room for the script's fixed 64-token window and interval
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    sizes = dict(BATCH="2", PROMPT="8", GEN="160", BUDGET="96", MEMORY_GEN="96", MAX_BATCH="4", REQUESTS="3",
                 SERVING_MAX_LEN="96", LIMIT="600")
    env = {**os.environ, **sizes, "CONFIG": str(tmp_path / "config.json"), "OUT": str(out), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"jax {jax.__version__} ")
    result = json.loads((out / "bench.json").read_text())
    assert (result["jax_version"], result["dtype"], result["gen"], result["budget"]) == (
        jax.__version__, "bfloat16", 160, 96)
    assert list(result["policies"]) == ["full", "random", "triattention"]
    assert result["random_vs_full"] > 0 and result["eviction_overhead"] > 0 and "hf" not in result
    assert {r["policy"] for r in result["equal_memory"]["runs"]} == {"full", "random", "triattention"}
    assert {r["policy"] for r in result["serving"]} == {"full", "random", "triattention"}
    assert (out / "bench.md").is_file() and (out / "bench.png").is_file()
