"""TriAttention: its score and aggregation against NumPy, its calibration against transformers,
the `randkv calibrate` round trip and generation under the policy on a tiny model."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import randkv_jax
from randkv_jax import calibration
from randkv_jax.buffer import KVBuffer
from randkv_jax.calibration import load_stats, query_statistics, save_stats
from randkv_jax.cli import main
from randkv_jax.kernels.hash_prng import eviction_draws
from randkv_jax.models.config import ModelConfig, RopeConfig
from randkv_jax.models.rope import apply_rope, inverse_frequencies, rope_angles
from randkv_jax.policies.triattention import TriAttention, aggregate_per_head, frequency_scores
from tests.hf_tiny import TEXT, save_tiny, save_tokenizer

OFFSETS = [2.0**i for i in range(17)]  # 1 .. 65536


def _config(layers=2, heads=4, kv_heads=2, head_dim=16, rope=None, rotary=1.0):
    rope = rope or RopeConfig(theta=1e4, partial_rotary_factor=rotary)
    return ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope=rope,
        max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True,
    )


def np_key_scores(keys, positions, t, q_mean, q_abs, inv_freq, scaling, offsets=OFFSETS):
    """The published per-key score, literally: loops over rows, query heads, slots and offsets."""
    b, k, s, d = keys.shape
    h, f = q_mean.shape
    w = inv_freq.astype(np.float64)
    out = np.full((b, h, s), np.nan)
    for bi in range(b):
        for hi in range(h):
            j = hi // (h // k)
            for si in range(s):
                p = positions[bi, j, si]
                if p < 0:
                    continue
                x = keys[bi, j, si].astype(np.float64)
                k_f = (x[:f] + 1j * x[f:]) * np.exp(-1j * w * p) / scaling  # invert RoPE
                amp = np.abs(q_mean[hi]) * np.abs(k_f)
                phi = np.angle(q_mean[hi] * np.conj(k_f))
                extra = (q_abs[hi] - np.abs(q_mean[hi])) * np.abs(k_f)
                per_offset = [np.sum(amp * scaling**2 * np.cos(w * (t[bi] - p + delta) + phi))
                              + np.sum(extra * scaling**2) for delta in offsets]
                out[bi, hi, si] = np.mean(per_offset)
    return out


def np_aggregate(scores, candidates, noise):
    """z-normalise per (layer, row, head) over candidates, + 1e-6 noise, group max, layer mean."""
    l, b, h, s = scores.shape
    k = candidates.shape[2]
    g = h // k
    out = np.zeros((b, k, s))
    for bi in range(b):
        for j in range(k):
            per_layer = []
            for li in range(l):
                cand = candidates[li, bi, j]
                zs = []
                for hi in range(j * g, (j + 1) * g):
                    x = scores[li, bi, hi].astype(np.float64)
                    std = max(x[cand].std(), 1e-6) if cand.any() else 1e-6
                    mean = x[cand].mean() if cand.any() else 0.0
                    zs.append((x - mean) / std + 1e-6 * noise[li, bi, hi])
                per_layer.append(np.where(cand, np.max(zs, axis=0), 0.0))
            out[bi, j] = np.mean(per_layer, axis=0)
    return out


def _random_stats(rng, layers, heads, f):
    q_mean = rng.normal(size=(layers, heads, f)) + 1j * rng.normal(size=(layers, heads, f))
    q_abs = np.abs(q_mean) + rng.uniform(0, 1, size=(layers, heads, f))
    return q_mean.astype(np.complex64), q_abs.astype(np.float32)


def _positions(rng, b, k, s, t):
    """Increasing distinct positions < t per (row, head), with -1 holes."""
    pos = np.stack([np.stack([np.sort(rng.choice(t[bi], size=s, replace=False)) for _ in range(k)])
                    for bi in range(b)])
    return np.where(rng.uniform(size=pos.shape) < 0.15, -1, pos).astype(np.int32)


@pytest.mark.parametrize("heads,kv_heads,scaling", [(4, 2, 1.0), (8, 2, 1.0), (4, 4, 1.3)])
def test_frequency_scores_equal_numpy(heads, kv_heads, scaling):
    rng = np.random.default_rng(heads + kv_heads)
    b, s, d = 2, 12, 16
    t = np.array([300, 41])
    inv_freq, _ = inverse_frequencies(_config(head_dim=d))
    keys = rng.normal(size=(b, kv_heads, s, d)).astype(np.float32)
    positions = _positions(rng, b, kv_heads, s, t)
    q_mean, q_abs = _random_stats(rng, 1, heads, d // 2)
    score = jax.jit(lambda *a: frequency_scores(*a, inv_freq, scaling))
    ours = score(keys, positions, jnp.asarray(t, jnp.int32), q_mean[0].real, q_mean[0].imag, q_abs[0])
    ref = np_key_scores(keys, positions, t, q_mean[0], q_abs[0], inv_freq, scaling)
    valid = ~np.isnan(ref)
    np.testing.assert_allclose(np.asarray(ours)[valid], ref[valid], rtol=1e-4, atol=1e-4 * np.abs(ref[valid]).max())


def test_score_with_one_offset_is_the_rope_logit_of_the_mean_query():
    """With D = {1}, one query (q_mean = q, E|q| = |q|): S(k) = RoPE(q, t + 1) . RoPE(k, p), the
    model's own rotation: checks the sign of phi and the direction of the inversion."""
    rng = np.random.default_rng(0)
    config = _config(head_dim=16, rope=RopeConfig(theta=1e4, rope_type="yarn", factor=4.0,
                                                  original_max_position_embeddings=64))
    inv_freq, scaling = inverse_frequencies(config)
    assert scaling != 1.0
    q_pre, k_pre = rng.normal(size=(2, 16)).astype(np.float32)
    t, p = 97, 23

    def rot(x, pos):  # the model's RoPE at one position
        return apply_rope(jnp.asarray(x)[None, None, None], *rope_angles(config, jnp.array([[pos]])))[0, 0, 0]

    k_post = rot(k_pre, p)
    logit = float(jnp.dot(rot(q_pre, t + 1), k_post))
    q_c = q_pre[:8] + 1j * q_pre[8:]
    score = jax.jit(lambda *a: frequency_scores(*a, inv_freq, scaling, offset_max=1))(
        k_post[None, None, None], jnp.array([[[p]]]), jnp.array([t]), q_c.real[None], q_c.imag[None],
        np.abs(q_c)[None])
    np.testing.assert_allclose(float(score[0, 0, 0]), logit, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_aggregation_equals_numpy(group):
    rng = np.random.default_rng(group)
    l, b, k, s = 3, 2, 2, 20
    scores = rng.normal(size=(l, b, k * group, s)).astype(np.float32) * 5
    scores[:, :, :, 3] = scores[:, :, :, 4]  # ties broken by the noise only
    candidates = np.broadcast_to(rng.uniform(size=(1, b, k, s)) < 0.7, (l, b, k, s)).copy()
    candidates[:, 0, 0, 0] = candidates[:, 0, 0, -1] = True  # edges
    candidates[:, 1, 1] = False  # a head with no candidate
    noise = rng.uniform(size=scores.shape).astype(np.float32)
    ours = jax.jit(aggregate_per_head)(scores, candidates, noise)
    np.testing.assert_allclose(np.asarray(ours), np_aggregate(scores, candidates, noise), rtol=1e-5, atol=1e-5)


def _synthetic_stats(tmp_path, config, seed=0):
    rng = np.random.default_rng(seed)
    q_mean, q_abs = _random_stats(rng, config.num_layers, config.num_heads, config.head_dim // 2)
    return save_stats(tmp_path / "stats", config, {"q_mean_real": q_mean.real, "q_mean_imag": q_mean.imag,
                                                   "q_abs_mean": q_abs}, tokens=0)


def test_keep_mask_equals_numpy(tmp_path):
    """A round on a simulated buffer keeps the pinned prompt (inside the budget), the window and the
    n_select = K_sel - pinned eligible slots with the best NumPy score, the same slots in every
    layer, so that each head then holds exactly T; a row that is not due keeps everything."""
    config = _config(layers=2, heads=8, kv_heads=2)
    stats_dir = _synthetic_stats(tmp_path, config)
    T, r = 20, 4  # K_sel = 16
    policy = TriAttention(budget=T, buffer=r, stats=str(stats_dir), seed=5)
    rng = np.random.default_rng(1)
    # row 0: short prompt, all of it pinned; row 1: prompt 20 > K_sel, pinned 0..14 and its tail
    # competes; row 2: generated 27, off the interval: not due
    prompt_lens, generated = np.array([5, 20, 7]), np.array([28, 28, 27])
    n_pinned = np.minimum(prompt_lens, T - r - 1)
    b, l, k, d, cap = 3, 2, 2, 16, 48
    positions = np.full((l, b, k, cap), -1, np.int32)
    for bi in range(b):
        t = prompt_lens[bi] + generated[bi]
        for j in range(k):  # pinned prefix, 14 surviving older entries (prompt tail included), the window
            kept = np.sort(rng.choice(np.arange(n_pinned[bi], t - r), size=14, replace=False))
            row = np.concatenate([np.arange(n_pinned[bi]), kept, np.arange(t - r, t)])
            positions[:, bi, j, : row.size] = row
    fill = (positions[0, :, 0] >= 0).sum(-1)
    keys = rng.normal(size=(l, b, k, cap, d)).astype(np.float32)
    buf = KVBuffer(keys=jnp.asarray(keys), values=jnp.asarray(keys), positions=jnp.asarray(positions),
                   prompt_lens=jnp.asarray(prompt_lens, jnp.int32), fill=jnp.asarray(fill, jnp.int32),
                   generated=jnp.asarray(generated, jnp.int32))
    seeds = jnp.array([3, 4, 6], jnp.int32)
    due = np.asarray(jax.jit(policy.due)(buf))
    np.testing.assert_array_equal(due, [True, True, False])
    keep = np.asarray(jax.jit(functools.partial(policy.keep_mask, platform="cpu"))(buf, seeds))

    st = load_stats(stats_dir)
    t = prompt_lens + generated
    q_mean = st.q_mean_real + 1j * st.q_mean_imag
    raw = np.stack([np_key_scores(keys[li], positions[li], t, q_mean[li], st.q_abs_mean[li], st.inv_freq,
                                  st.attention_scaling) for li in range(l)])
    row = lambda x: x[None, :, None, None]  # noqa: E731
    valid = positions >= 0
    pinned = valid & (positions < row(n_pinned))
    window = valid & (positions >= row(t - r))
    eligible = valid & ~pinned & ~window
    assert (eligible[:, 1] & (positions[:, 1] < prompt_lens[1])).any()  # the prompt's tail competes
    draws = jax.jit(eviction_draws)(5, row(seeds), np.arange(l)[:, None, None, None],
                                    np.arange(8)[None, None, :, None], row(generated),
                                    np.arange(cap)[None, None, None, :])
    noise = (np.asarray(draws, np.int64) // 2 + 0.5) / 2**23  # hash_prng.open_uniform
    agg = np_aggregate(np.nan_to_num(raw), eligible, noise)
    n_select = T - r - n_pinned
    for li in range(l):
        for bi in range(b):
            for j in range(k):
                pos, kp = positions[li, bi, j], keep[li, bi, j]
                if not due[bi]:
                    np.testing.assert_array_equal(kp, pos >= 0)
                    continue
                assert np.all(kp[pinned[li, bi, j] | window[li, bi, j]]) and not np.any(kp[pos < 0])
                assert kp.sum() == T
                chosen = kp & eligible[li, bi, j]
                assert chosen.sum() == n_select[bi]
                dropped = eligible[li, bi, j] & ~kp
                assert agg[bi, j][chosen].min() >= agg[bi, j][dropped].max() - 1e-4
    assert np.array_equal(keep[0], keep[1])  # one keep-set per KV head, shared by the layers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen3")
    hf_model = save_tiny("qwen3_untied", directory, seed=2)
    save_tokenizer(directory, TEXT)
    return directory, hf_model, randkv_jax.load_model(directory, dtype="float32")


def _hf_query_stats(hf_model, ids, chunk):
    """Mean complex pair and mean modulus of the q_norm outputs (pre-RoPE queries) of transformers."""
    layers = hf_model.model.layers
    captured = {i: [] for i in range(len(layers))}
    hooks = [layer.self_attn.q_norm.register_forward_hook(
        lambda mod, args, out, i=i: captured[i].append(out[0].detach().numpy().astype(np.float64)))
        for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for start in range(0, len(ids), chunk):
                hf_model(input_ids=torch.tensor([ids[start : start + chunk]]))
    finally:
        for h in hooks:
            h.remove()
    q = np.stack([np.concatenate(captured[i], axis=0) for i in range(len(layers))])  # [l, T, h, d]
    f = q.shape[-1] // 2
    z = q[..., :f] + 1j * q[..., f:]
    return z.mean(axis=1), np.abs(z).mean(axis=1)


@pytest.mark.parametrize("n_tokens,chunk,block", [(40, 16, 512), (56, None, 16), (70, 24, 16)])
def test_calibration_equals_transformers_queries(tiny, monkeypatch, n_tokens, chunk, block):
    _, hf_model, model = tiny
    monkeypatch.setattr(calibration, "QUERY_BLOCK", block)
    ids = np.random.default_rng(n_tokens).integers(0, 256, n_tokens).tolist()
    ours = query_statistics(model, ids, chunk)
    q_mean, q_abs = _hf_query_stats(hf_model, ids, chunk or n_tokens)
    assert ours["q_abs_mean"].shape == (2, 4, 8)
    np.testing.assert_allclose(ours["q_mean_real"], q_mean.real, atol=2e-5)
    np.testing.assert_allclose(ours["q_mean_imag"], q_mean.imag, atol=2e-5)
    np.testing.assert_allclose(ours["q_abs_mean"], q_abs, atol=2e-5)


def test_cli_round_trip_and_generation(tiny, tmp_path):
    directory, _, model = tiny
    text_file = tmp_path / "calib.txt"
    text_file.write_text(TEXT)
    assert main(["calibrate", "--model", str(directory), "--text", str(text_file), "--max-tokens", "300"]) == 0
    out = directory / "triattention_stats"
    meta = json.loads((out / "stats.json").read_text())
    assert meta["tokens"] == min(300, len(model.tokenizer.encode(TEXT)))
    assert meta["num_layers"] == 2 and meta["num_heads"] == 4 and meta["head_dim"] == 16
    stats = load_stats(out)
    stats.check_model(model.config)
    assert load_stats(directory) == stats  # the checkpoint directory resolves to its stats
    ids = model.tokenizer.encode(TEXT)[:300]
    np.testing.assert_allclose(stats.q_abs_mean, query_statistics(model, ids)["q_abs_mean"], rtol=1e-6)

    T, r, n_new = 32, 8, 80  # K_sel = 24
    policy = TriAttention(budget=T, buffer=r, stats=str(directory))
    assert hash(policy) == hash(dataclasses.replace(policy))
    # the 30-token prompt is longer than K_sel: its first K_sel - 1 = 23 entries are pinned
    prompts = [[5, 9, 11, 3, 7, 8, 10, 12, 4, 6, 13, 14], [21, 22, 23, 24, 25], list(range(30, 60))]
    result = randkv_jax.generate(model, prompts, policy=policy, max_new_tokens=n_new, ignore_eos=True,
                                 chat=False, return_state=True)
    for p, st in zip(prompts, result.stats):
        assert st.new_tokens == n_new and st.evictions > 0
        assert st.held_after_round == T  # a round compacts every head to exactly T
        assert st.peak_slots <= policy.capacity(len(p), n_new) == max(len(p), T) + r
    buf = result.state.buffer
    positions = np.asarray(buf.positions)
    assert np.array_equal(positions[0], positions[1])  # layers share the keep-set
    pinned = np.asarray(policy.rule.n_pinned(jnp.asarray([len(p) for p in prompts])))
    np.testing.assert_array_equal(pinned, [12, 5, 23])
    for row, n in enumerate(pinned):
        assert np.all(positions[:, row, :, :n] == np.arange(n))  # the pinned prompt is kept


def test_bad_inputs(tiny, tmp_path):
    directory, _, model = tiny
    with pytest.raises(FileNotFoundError, match="randkv calibrate"):
        TriAttention(budget=8, buffer=4, stats=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs calibration statistics"):
        TriAttention(budget=8, buffer=4)
    other = _synthetic_stats(tmp_path, _config(layers=3, heads=4, kv_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="another model"):
        load_stats(other).check_model(model.config)
    with pytest.raises(ValueError, match="another model"):  # generate checks before compiling
        randkv_jax.generate(model, [[1, 2, 3]], policy=TriAttention(budget=8, buffer=4, stats=str(other)),
                            max_new_tokens=16, chat=False)
    with pytest.raises(ValueError, match="do not fit this model"):  # the scores check the buffer too
        TriAttention(budget=8, buffer=4, stats=str(other)).keep_mask(
            KVBuffer.empty(model.config, 1, 8, jnp.float32), jnp.zeros((1,), jnp.int32), platform="cpu")
    with pytest.raises(ValueError, match="must exceed the window"):  # T counts the window
        TriAttention(budget=4, buffer=4, stats=str(other))
    with pytest.raises(ValueError, match="convention= is gone"):
        TriAttention(budget=8, buffer=4, stats=str(other), convention="text")
    with pytest.raises(ValueError, match="offset_max must be a positive integer"):
        TriAttention(budget=8, buffer=4, stats=str(other), offset_max=0)
    with pytest.raises(ValueError, match="partial rotary"):
        calibration.check_supported(_config(rotary=0.5))
    assert main(["calibrate", "--model", str(directory), "--text", str(tmp_path / "nope.txt")]) == 2
