"""External check of our SnapKV, StreamingLLM and Recency scorers against NVIDIA kvpress 0.5.5.

kvpress needs transformers < 5.3, so it lives in its own environment and the check runs in two
stages, neither of which imports the other's packages (see docs/kvpress.md):

    python3 -m venv .venv-kvpress
    .venv-kvpress/bin/pip install torch==2.13.0 'transformers<5.3' kvpress==0.5.5
    HF_HUB_OFFLINE=1 .venv-kvpress/bin/python eval/kvpress_check.py export --out /tmp/kvpress_ref.npz
    .venv/bin/python -m randkv_jax.eval.kvpress_check compare --ref /tmp/kvpress_ref.npz

Stage `export` (torch, transformers, kvpress; no jax): one attention layer of a tiny random Qwen3
(4 query heads, 2 KV heads, head_dim 16), random hidden states [b, T, E] and random post-RoPE
keys [b, k, T, d]. It runs kvpress' own code (`kvpress/presses/snapkv_press.py`,
`streaming_llm_press.py`, `scorer_press.py`):
  - `SnapKVPress(window_size=w, kernel_size=5).score` twice: as kvpress runs it (window queries
    recomputed from the hidden states, `compute_window_attention`), and through its `attentions`
    argument with the window attention softmaxed over the T - w non-window keys only (our
    convention), so that kvpress' mean / avg_pool1d / group-mean code scores our softmax;
  - `StreamingLLMPress(n_sink=4)` and `(n_sink=0)`;
  - each press's `compress` at `--ratio`, with values[..., t, :] = t so that the values it
    gathers name the slots it keeps.
It saves the window's post-RoPE queries as kvpress computes them (checked against
`compute_window_attention`), the keys, kvpress' window attention, scores and keep sets.

Stage `compare` (jax, randkv_jax): our pure functions and policies on the same tensors, where
the definitions coincide (exit 1 past a relative tolerance of 1e-5, or on any keep-set
difference):
  1. `scoring.candidate_attention` (candidates = non-window slots) against kvpress' window
     attention renormalised over the non-window keys;
  2. `snapkv.snapkv_scores(kernel=5, pool="avg", group="mean")` against kvpress' score of that
     softmax, on the non-window slots;
  3. `SnapKV(preset="paper", protect="none", buffer=w).keep_mask` against that press's
     `compress`; `StreamingLLM` (sinks:4) and `Recency` (protect "none") against
     `StreamingLLMPress(n_sink=4 / 0).compress`, with the same number of kept entries: our
     `budget` counts the window and the sinks, as kvpress' kept count does, so budget = n_kept
     (window = interval = w; one due round on a buffer holding all T tokens).
It also reports, without failing, how far kvpress' own SnapKV convention (window keys in the
softmax denominator, causal among the window queries) is from ours: score differences, rank
correlation and keep-set overlap.
"""

from __future__ import annotations

import argparse
import sys

TOL = 1e-5
KERNEL = 5
N_SINK = 4


def export(out: str, seed: int, tokens: int, window: int, ratio: float, batch: int) -> None:
    """Run kvpress on random tensors and save its inputs, scores and keep sets to `out` (npz)."""
    import numpy as np
    import torch
    from kvpress import SnapKVPress, StreamingLLMPress
    from kvpress.utils import get_prerope_query_states
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

    from importlib.metadata import version

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4 * tokens)
    model = Qwen3ForCausalLM(config).float().eval()
    module = model.model.layers[0].self_attn
    h, k, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    t, w = tokens, window

    hidden = torch.randn(batch, t, config.hidden_size)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(t)[None].expand(batch, -1))
    kwargs = {"position_embeddings": (cos, sin)}
    keys = torch.randn(batch, k, t, d)
    values = torch.arange(t, dtype=torch.float32)[None, None, :, None].expand(batch, k, t, d).contiguous()

    def kept(press, attentions=None):
        """The slots `press.compress` keeps, as a [b, k, T] mask (its gathered values are slot ids)."""
        _, gathered = press.compress(module, hidden, keys, values, attentions, kwargs)
        ids = gathered[..., 0].long()
        mask = torch.zeros(batch, k, t, dtype=torch.bool)
        return mask.scatter_(2, ids, True).numpy()

    with torch.no_grad():
        # The window queries exactly as SnapKVPress.compute_window_attention builds them.
        q = get_prerope_query_states(module, hidden[:, -w:])
        q = q * cos[:, -w:].unsqueeze(1) + rotate_half(q) * sin[:, -w:].unsqueeze(1)
        attn = SnapKVPress.compute_window_attention(module, hidden, keys, w, (cos, sin))  # [b, h, w, T-w]
        logits = q @ repeat_kv(keys, h // k).transpose(2, 3) / d**0.5
        causal = torch.triu(torch.full_like(logits, float("-inf")), diagonal=t - w + 1)
        mine = torch.softmax(logits + causal, dim=-1)[..., :-w]
        assert torch.allclose(mine, attn, rtol=1e-6, atol=1e-9), "exported queries are not kvpress' queries"

        # Our convention through kvpress' `attentions` path: softmax over the non-window keys only.
        restricted = torch.zeros(batch, h, t, t)
        restricted[..., -w:, :-w] = torch.softmax(logits[..., :-w], dim=-1)

        snap = SnapKVPress(window_size=w, kernel_size=KERNEL)
        snap_c = SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=KERNEL)
        stream = {n: StreamingLLMPress(compression_ratio=ratio, n_sink=n) for n in (N_SINK, 0)}
        arrays = dict(
            queries=q.numpy(),
            keys=keys.numpy(),
            snapkv_attention=attn.numpy(),
            snapkv_scores=snap.score(module, hidden, keys, values, None, kwargs).numpy(),
            snapkv_keep=kept(snap_c),
            snapkv_scores_restricted=snap.score(module, hidden, keys, values, restricted, kwargs).numpy(),
            snapkv_keep_restricted=kept(snap_c, restricted),
            streaming_scores=stream[N_SINK].score(module, hidden, keys, values, None, kwargs).numpy(),
            streaming_keep=kept(stream[N_SINK]),
            streaming0_keep=kept(stream[0]),
        )
    n_kept = int(arrays["snapkv_keep"][0, 0].sum())
    versions = ", ".join(f"{p} {version(p)}" for p in ("kvpress", "transformers", "torch"))
    np.savez(out, window=w, kernel=KERNEL, n_sink=N_SINK, ratio=ratio, n_kept=n_kept, versions=versions, **arrays)
    print(versions)
    print(f"wrote {out}: b={batch} h={h} k={k} d={d} T={t} window={w} kernel={KERNEL} "
          f"ratio={ratio} n_kept={n_kept}")


def compare(ref: str) -> int:
    """Compare the exported kvpress results with ours; 0 if the coinciding definitions agree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from randkv_jax.buffer import KVBuffer
    from randkv_jax.observations import Observations
    from randkv_jax.policies.recency import Recency
    from randkv_jax.policies.scoring import candidate_attention
    from randkv_jax.policies.snapkv import SnapKV, snapkv_scores
    from randkv_jax.policies.streaming import StreamingLLM

    z = np.load(ref)
    q, keys = z["queries"], z["keys"]
    w, n_kept, n_sink = int(z["window"]), int(z["n_kept"]), int(z["n_sink"])
    b, k, t, d = keys.shape
    print(f"reference: {z['versions']}; b={b} h={q.shape[1]} k={k} d={d} T={t} window={w} "
          f"kernel={int(z['kernel'])} ratio={float(z['ratio'])} n_kept={n_kept}")
    failures = []

    def close(name, ours, theirs):
        ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
        diff = np.abs(ours - theirs)
        rel = float((diff / np.abs(theirs)).max())
        ok = bool(np.all(diff <= TOL * np.abs(theirs)))
        print(f"  {name}: max abs diff {diff.max():.3e}, max rel diff {rel:.3e} -> {'OK' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)

    def same_keep(name, ours, theirs):
        ours = np.asarray(ours)
        n_diff = int((ours != theirs).sum())
        ok = n_diff == 0 and bool(np.all(ours.sum(-1) == theirs.sum(-1)))
        print(f"  {name}: {n_diff} slots differ of {theirs.size} -> {'OK' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)

    # A one-layer buffer at a round: slots 0..T-1 hold positions 0..T-1, the last w are the
    # window, n_generated a positive multiple of the interval w, all T > n_kept tokens held (the round is due).
    n_generated = w * max((t - w) // (2 * w), 1)
    prompt = t - n_generated
    buffer = KVBuffer(
        keys=jnp.asarray(keys)[None], values=jnp.zeros((1, b, k, t, d), jnp.float32),
        positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, b, k, t)),
        prompt_lens=jnp.full((b,), prompt, jnp.int32), fill=jnp.full((b,), t, jnp.int32),
        generated=jnp.full((b,), n_generated, jnp.int32))
    seeds = jnp.zeros((b,), jnp.int32)
    platform = jax.default_backend()  # "cpu", "gpu" or "tpu": what the keep masks are built for
    non_window = jnp.arange(t) < t - w
    candidates = jnp.broadcast_to(non_window, (b, k, t))

    print("SnapKV, coinciding definition (softmax over the non-window keys):")
    ours_attn = np.asarray(candidate_attention(jnp.asarray(q), jnp.asarray(keys), candidates))
    theirs_attn = z["snapkv_attention"] / z["snapkv_attention"].sum(-1, keepdims=True)
    close("window attention vs kvpress' renormalised", ours_attn[..., :t - w], theirs_attn)
    ours = np.asarray(snapkv_scores(jnp.asarray(q), jnp.asarray(keys), candidates,
                                    kernel=KERNEL, pool="avg", group="mean"))
    close("snapkv_scores vs SnapKVPress.score(attentions=...)", ours[..., :t - w],
          z["snapkv_scores_restricted"][..., :t - w])
    snapkv = SnapKV(budget=n_kept, buffer=w, protect="none", preset="paper")
    keep = snapkv.keep_mask(buffer, seeds, Observations(queries=jnp.asarray(q)[None]), platform=platform)[0]
    same_keep(f"SnapKV keep_mask vs compress (ratio {float(z['ratio'])})", keep, z["snapkv_keep_restricted"])

    print("StreamingLLM / Recency keep sets:")
    same_keep(f"StreamingLLM(sinks:{n_sink}) vs StreamingLLMPress(n_sink={n_sink})",
              StreamingLLM(budget=n_kept, buffer=w).keep_mask(buffer, seeds, platform=platform)[0],
              z["streaming_keep"])
    same_keep("Recency(protect=none) vs StreamingLLMPress(n_sink=0)",
              Recency(budget=n_kept, buffer=w, protect="none").keep_mask(buffer, seeds, platform=platform)[0],
              z["streaming0_keep"])

    print("SnapKV, kvpress' own convention (window keys in the denominator, causal window) - reported only:")
    ours_nw, theirs_nw = ours[..., :t - w], z["snapkv_scores"][..., :t - w]
    diff, ratio = np.abs(ours_nw - theirs_nw), ours_nw / theirs_nw
    print(f"  scores: max abs diff {diff.max():.3e}, max rel diff {(diff / theirs_nw).max():.3e}, "
          f"ratio ours/kvpress in [{ratio.min():.3f}, {ratio.max():.3f}]")
    ranks = lambda x: np.argsort(np.argsort(x, axis=-1), axis=-1).astype(np.float64)  # noqa: E731
    ro, rt = ranks(ours_nw), ranks(theirs_nw)
    ro, rt = ro - ro.mean(-1, keepdims=True), rt - rt.mean(-1, keepdims=True)
    rho = (ro * rt).sum(-1) / np.sqrt((ro**2).sum(-1) * (rt**2).sum(-1))
    print(f"  Spearman rank correlation per (row, KV head): min {rho.min():.4f}, mean {rho.mean():.4f}")
    padded = bool(np.all(z["snapkv_scores"][..., t - w:] == theirs_nw.max() + 1))
    print(f"  kvpress window slots scored max+1: {padded}")
    keep, theirs_keep = np.asarray(keep), z["snapkv_keep"]
    overlap = (keep & theirs_keep)[..., :t - w].sum(-1)
    print(f"  keep sets: windows both kept: {bool(keep[..., t - w:].all() and theirs_keep[..., t - w:].all())}; "
          f"non-window kept in common per (row, KV head): {overlap.ravel().tolist()} of {n_kept - w}")

    print("PASS" if not failures else f"FAIL: {', '.join(failures)}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    ex = sub.add_parser("export", help="run kvpress (its own venv) and save the reference npz")
    ex.add_argument("--out", required=True)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--tokens", type=int, default=64, help="sequence length T")
    ex.add_argument("--window", type=int, default=8, help="SnapKV window w (= our window and interval)")
    ex.add_argument("--ratio", type=float, default=0.5, help="kvpress compression ratio for the keep sets")
    ex.add_argument("--batch", type=int, default=2)
    cmp = sub.add_parser("compare", help="compare the npz with randkv_jax (project venv)")
    cmp.add_argument("--ref", required=True)
    args = parser.parse_args(argv)
    if args.stage == "export":
        export(args.out, args.seed, args.tokens, args.window, args.ratio, args.batch)
        return 0
    return compare(args.ref)


if __name__ == "__main__":
    sys.exit(main())
