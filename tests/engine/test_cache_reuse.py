"""Cache reuse (llama-server's ``n_cache_reuse``): a context pruned in its middle keeps the chunks it still has.

A slot holds ``A X B Y C``; the next request is ``A B C`` plus a new message (Halo Weave prunes ``X`` and
``Y`` by attention).  With reuse, ``B`` and ``C`` are moved into place by a KV shift (llama.cpp's
``seq_rm`` / ``seq_add``): only the new message is prefilled, the reused tokens count as cached, and the
sequence is an exact description of its cache afterwards (tokens, the cell mirror checked against
llama.cpp on every row, a state whose positions are ``0..n-1``).  Its attention differs from a full prefill
of the same tokens only by the moved chunks' old context (docs/api.md has the figures of a longer trace).
Without reuse (the engine's default) everything after the common prefix is prefilled again.
"""

from __future__ import annotations

import numpy as np

from slotstate import seq_state
from tests.engine.enginekit import Result, Runner

MIN_CHUNK = 8


def test_pruned_context_reuses_its_chunks(engine, model) -> None:  # type: ignore[no-untyped-def]
    def text(t: str) -> list[int]:
        return model.tokenize(t, False, False)

    a = model.tokenize("<|im_start|>system\nYou keep long notes about animals.<|im_end|>\n", True, True)
    x = text(" The first note says that foxes are quick and dogs are lazy, mostly.")
    b = text(" The second note lists the planets from Mercury out to Neptune in order.")
    y = text(" A third note about the weather, which was rainy all week long.")
    c = text(" The last note asks what colour the sky is on a clear day at noon.")
    new = text(" Now answer:")
    full, pruned = [*a, *x, *b, *y, *c], [*a, *b, *c, *new]
    common = next(i for i, (p, q) in enumerate(zip(full, pruned, strict=False)) if p != q)
    run = Runner(engine)
    seq = 0

    def turn(cache_reuse: int | None) -> Result:
        engine.erase(seq)
        assert run.generate(seq, full, max_new_tokens=1, ignore_eos=True).error is None
        return run.generate(seq, pruned, max_new_tokens=4, ignore_eos=True, cache_reuse=cache_reuse)

    res = turn(MIN_CHUNK)
    assert res.error is None and res.done is not None
    assert res.done.n_cached >= len(a) + len(b) + len(c) - 2, "b and c were moved into place, not prefilled"
    assert res.done.n_cached + res.done.n_prefilled == len(pruned)
    assert engine.tokens[seq] == [*pruned, *res.tokens]
    _, state = engine.save_state(seq)
    positions = seq_state.parse(state, engine.layout).positions
    np.testing.assert_array_equal(np.sort(positions), np.arange(len(engine.tokens[seq])))

    engine.erase(seq)
    exact = run.generate(seq, pruned, max_new_tokens=4, ignore_eos=True)
    assert exact.done is not None and exact.done.n_cached == 0
    got, want = res.attention[0], exact.attention[0]
    assert got.shape == want.shape
    corr = [float(np.corrcoef(got[layer, h], want[layer, h])[0, 1]) for layer in range(got.shape[0])
            for h in range(got.shape[1])]  # fmt: skip
    print(f"\nreuse vs full prefill: min per-head corr {min(corr):.4f}, mean {np.mean(corr):.4f}, "
          f"mean abs diff {np.abs(got - want).mean():.2e}, tokens {res.tokens} vs {exact.tokens}")  # fmt: skip
    # the prefix's rows at layer 0: the same K/V (other cells: float rounding)
    np.testing.assert_allclose(got[0, :, : len(a)], want[0, :, : len(a)], atol=1e-4)
    assert not np.allclose(got, want, atol=1e-4), "moved K/V keep their old context: not a full prefill's"

    off = turn(None)  # the engine's default, --cache-reuse 0: exact
    assert off.done is not None and off.done.n_cached == common
    assert off.tokens == exact.tokens
