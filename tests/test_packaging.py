"""`models/`, `kernels/`, `eval/` import as `randkv_jax.*` from editable and regular installs."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import randkv_jax.eval
import randkv_jax.kernels
import randkv_jax.models

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"models": randkv_jax.models, "kernels": randkv_jax.kernels, "eval": randkv_jax.eval}


def test_editable_install_maps_top_level_folders():
    for folder, module in SUBPACKAGES.items():
        assert Path(module.__file__) == ROOT / folder / "__init__.py"


def test_regular_install_imports(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        check=True, capture_output=True,
    )
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "import randkv_jax, randkv_jax.models, randkv_jax.kernels, randkv_jax.eval\n"
        "assert randkv_jax.models.__file__.startswith(sys.argv[1]), randkv_jax.models.__file__\n"
        "assert callable(randkv_jax.load_model)\n"
    )
    # -S: no site processing, so the editable install's import hook is not active.
    subprocess.run([sys.executable, "-S", "-c", code, str(target), *site.getsitepackages()],
                   check=True, cwd=tmp_path)
