"""Host memory and time of checkpoint loading, measured side by side on one synthetic checkpoint.

    python -m randkv_jax.eval.bench_loading [--layers 8] [--hidden 1024] [--dtype bfloat16]

Writes a random Qwen3-shaped safetensors checkpoint (bfloat16, like real ones) to a temporary
directory, then, each step in a fresh subprocess so peaks do not mix:
  1. `load_model(hf_dir)`: peak resident memory above the post-import baseline, divided by the
     bytes of the loaded parameters (on CPU the parameters themselves live in host memory);
  2. `randkv convert` to an Orbax checkpoint;
  3. `load_model(converted_dir)`: the same peak ratio and the time, against step 1's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import jax, numpy as np
import randkv_jax
from randkv_jax.models.model import init_params  # warm the import path (not timed)

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

jax.numpy.zeros(1).block_until_ready()
base = rss_kib()
start = time.perf_counter()
model = randkv_jax.load_model(sys.argv[1], dtype=sys.argv[2])
jax.block_until_ready(model.params)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
param_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
largest = max(x.nbytes for x in jax.tree.leaves(model.params))
print(json.dumps(dict(seconds=seconds, peak_over_base_bytes=(peak - base) * 1024,
                      param_bytes=param_bytes, largest_leaf_bytes=largest)))
"""


def write_checkpoint(directory: Path, layers: int, hidden: int) -> None:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    heads, kv, head_dim, ffn, vocab = hidden // 64, max(hidden // 256, 1), 128, 3 * hidden, 32000
    config = {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
               "model.norm.weight": w(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": w(hidden), p + "post_attention_layernorm.weight": w(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": w(head_dim), p + "self_attn.k_norm.weight": w(head_dim),
            p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
        })
    save_file(tensors, str(directory / "model.safetensors"))


def measure(path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, converted = Path(tmp) / "hf", Path(tmp) / "converted"
        hf_dir.mkdir()
        write_checkpoint(hf_dir, args.layers, args.hidden)
        direct = measure(hf_dir, args.dtype)
        subprocess.run([sys.executable, "-m", "randkv_jax.cli", "convert", str(hf_dir), "--out",
                        str(converted), "--dtype", args.dtype], check=True, capture_output=True)
        restored = measure(converted, args.dtype)
    gib = 2**30
    print(f"parameters: {direct['param_bytes'] / gib:.3f} GiB ({args.dtype}), "
          f"largest leaf {direct['largest_leaf_bytes'] / gib:.3f} GiB")
    for name, r in (("safetensors load", direct), ("converted restore", restored)):
        print(f"{name:18s}: {r['seconds']:6.2f} s, peak host memory above baseline "
              f"{r['peak_over_base_bytes'] / r['param_bytes']:.2f}x the parameters")
    print(f"restore / safetensors load time: {restored['seconds'] / direct['seconds']:.2f}")


if __name__ == "__main__":
    main()
