"""randkv_jax's decode loop inside your own `jax.pmap` or `jax.shard_map` (data parallel).

`randkv_jax.decode` is a set of pure functions over (params, loop state): `prefill` a prompt,
`insert` it into a slot of a `LoopState` (which holds the `KVBuffer`), `decode_chunk` to run
decode steps with eviction rounds inside. This script builds one loop state per device, stacks
them on a leading device axis, and maps `decode_chunk` over that axis, first with `jax.pmap`, then
with `jax.shard_map` over a 1-D mesh. Each device's rows must produce exactly the tokens they
produce in one batch on one device (`randkv_jax.generate`); `--check` exits 1 otherwise.

    python examples/shard_decode.py --devices 8 --check            # random weights, offline
    python examples/shard_decode.py --model CHECKPOINT --devices 8 --rows-per-device 2

On a CPU the devices are simulated (`--xla_force_host_platform_device_count`, set below before
jax is imported); on GPUs or TPUs pass --devices up to the local device count.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint directory (default: a small model with random weights)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rows-per-device", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--check", action="store_true", help="compare with one device; exit 1 on a mismatch")
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:  # simulated CPU devices must be requested before jax starts
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from randkv_jax import decode, generate, load_model
    from randkv_jax.models.config import ModelConfig, RopeConfig
    from randkv_jax.models.model import Model, init_params
    from randkv_jax.policies import RandomAttention
    from randkv_jax.sampling import SamplingParams

    if jax.local_device_count() < args.devices:
        parser.error(f"--devices {args.devices}: this process has {jax.local_device_count()} devices")
    if args.model:
        model = load_model(args.model, dtype="float32")
    else:
        config = ModelConfig(
            architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4),
            max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True,
        )
        params = jax.tree.map(lambda x: 2 * x if x.ndim > 1 else x, init_params(config, jax.random.key(0)))
        model = Model(config, params, None, jnp.float32)

    policy = RandomAttention(budget=48, window=16, interval=16)
    sampling = SamplingParams(temperature=0.7, top_p=0.95, top_k=0)
    spec = decode.DecodeSpec(model.config, model.dtype, policy, sampling, chunk=32, platform="cpu")
    n_dev, rows, max_new = args.devices, args.rows_per_device, args.max_new_tokens
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, size=int(n)).tolist()
               for n in rng.integers(4, 60, size=n_dev * rows)]
    seeds = list(range(100, 100 + len(prompts)))
    capacity = decode.padded_capacity(policy, 64, max_new)
    no_stop = jnp.full((decode.MAX_STOP_IDS,), -1, jnp.int32)  # fixed-length generation

    def device_state(first: int):
        """One device's loop state: prompts first .. first + rows - 1 in its slots."""
        state = decode.empty_state(spec, rows, capacity)
        for slot in range(rows):
            ids = prompts[first + slot]
            tokens = jnp.zeros((1, 64), jnp.int32).at[0, : len(ids)].set(jnp.asarray(ids, jnp.int32))
            prompt = decode.prefill(model.params, tokens, jnp.asarray([len(ids)], jnp.int32), spec=spec)
            state, _ = decode.insert(state, prompt, jnp.int32(0), jnp.int32(slot), jnp.int32(seeds[first + slot]),
                                     jnp.int32(max_new), no_stop, spec=spec)
        return state

    def stacked_states():
        """Every device's loop state, stacked on a leading device axis (pmap's and shard_map's input)."""
        states = [device_state(d * rows) for d in range(n_dev)]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *states)

    def chunk(params, state):
        return decode.decode_chunk(params, state, jnp.int32(spec.chunk), spec=spec)

    def run(step) -> list[list[int]]:
        """Chunks until no row is active; the tokens of each row (the first one from `insert`)."""
        state = stacked_states()
        tokens = [[int(t)] for t in np.asarray(state.last).reshape(-1)]
        while bool(np.asarray(state.active).any()):
            state = step(model.params, state)
            emitted = np.asarray(state.emitted).reshape(n_dev * rows, -1)
            for row, new in enumerate(emitted):
                tokens[row].extend(int(t) for t in new[new >= 0])
        return tokens

    devices = jax.local_devices()[:n_dev]
    pmapped = jax.pmap(chunk, in_axes=(None, 0), devices=devices)
    mesh = jax.make_mesh((n_dev,), ("devices",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    # each device holds a [1, ...] block of the stacked state: drop the axis, run, put it back
    shard_mapped = jax.jit(jax.shard_map(
        lambda params, state: jax.tree.map(lambda x: x[None], chunk(params, jax.tree.map(lambda x: x[0], state))),
        mesh=mesh, in_specs=(P(), P("devices")), out_specs=P("devices"), check_vma=False,
    ))
    results = {"pmap": run(pmapped), "shard_map": run(shard_mapped)}
    reference = generate(model, prompts, policy=policy, max_new_tokens=max_new, temperature=sampling.temperature,
                         top_p=sampling.top_p, seed=seeds, chat=False, ignore_eos=True, capacity=capacity).tokens
    ok = True
    for name, tokens in results.items():
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"{name}: {n_dev} devices x {rows} rows, {max_new} tokens each; "
              f"{same}/{len(reference)} rows equal to one device")
        ok &= same == len(reference)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
