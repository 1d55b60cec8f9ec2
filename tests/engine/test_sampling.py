"""engine/core/sampling.py's batched sampler: the distribution it draws from (against softmax with the
filters written out here), seeded determinism independent of the batch, and the logprobs."""
import random

import torch

from burstserve.engine.core.sampling import RowSampling, SamplingParams, noise_seed, row_sampling, rows_logprobs, sample_rows


def _filtered_probs(logits, temperature, top_k, top_p):
    """The distribution a row should be drawn from: softmax(logits / T) over the top_k most likely,
    then the smallest most-likely set reaching top_p, renormalized (written out, one token at a time)."""
    p = torch.softmax(logits / temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    kept_p = p[keep] / p[keep].sum()
    chosen, total = [], 0.0
    for tok, q in zip(keep, kept_p.tolist()):
        if total >= top_p:
            break
        chosen.append(tok)
        total += q
    out = torch.zeros_like(p)
    out[chosen] = p[chosen] / p[chosen].sum()
    return out


def test_draws_follow_the_filtered_distribution():
    v, n = 12, 40000
    logits = torch.randn(v) * 2
    for temperature, top_k, top_p in ((1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (1.0, 6, 0.7)):
        rule = RowSampling(temperature, top_k, top_p)
        tokens = sample_rows(logits.expand(n, v).contiguous(), [rule] * n)
        freq = torch.bincount(tokens, minlength=v).float() / n
        expect = _filtered_probs(logits, temperature, top_k, top_p)
        assert (freq[expect == 0] == 0).all(), (temperature, top_k, top_p)
        assert (freq - expect).abs().max() < 0.015, (temperature, top_k, top_p, freq, expect)


def test_greedy_rows_and_degenerate_filters_take_the_argmax():
    logits = torch.randn(5, 300)
    rows = [RowSampling(), RowSampling(0.9, 1, 1.0), RowSampling(0.9, -1, 1e-6), RowSampling(),
            RowSampling(1.0, 1, 1.0, noise_seed(7, 3))]
    assert torch.equal(sample_rows(logits, rows), logits.argmax(-1))


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    v = 1000
    target = torch.randn(v)
    seed = random.randrange(1 << 30)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    alone = [int(sample_rows(target[None], [row_sampling(params, step)])[0]) for step in range(20)]
    for others in (1, 7):
        batch = torch.randn(others + 1, v)
        batch[others // 2] = target
        rows = [RowSampling(1.0) for _ in range(others + 1)]
        got = []
        for step in range(20):
            rows[others // 2] = row_sampling(params, step)
            got.append(int(sample_rows(batch, rows)[others // 2]))
        assert got == alone
    assert len(set(alone)) > 1                     # the steps draw different noise
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=seed + 1)
    assert [int(sample_rows(target[None], [row_sampling(other, s)])[0]) for s in range(20)] != alone


def test_rows_logprobs_are_the_models_log_softmax():
    logits = torch.randn(3, 50)
    tokens = torch.tensor([4, 9, 49])
    entries = rows_logprobs(logits, tokens, [0, 3, 1])
    logp = torch.log_softmax(logits, dim=-1)
    for r, entry in enumerate(entries):
        top = [0, 3, 1][r]
        expect = set(torch.topk(logp[r], top).indices.tolist()) | {int(tokens[r])}
        assert set(entry) == expect
        for tok, lp in entry.items():
            assert abs(lp - float(logp[r, tok])) < 1e-6
