"""The admin feed's reduction of attention rows and its fan-out (no model: hand-made rows)."""

from __future__ import annotations

import numpy as np

from orchestrator.generation.events import TokenOut
from orchestrator.generation.feed import QUEUE_ROWS, AttentionFeed, reduce_row

L, H, N = 3, 2, 5


def token(arr: np.ndarray, index: int = 0) -> TokenOut:
    return TokenOut(
        index=index,
        token_id=7,
        piece=b"x",
        text="x",
        logprob=None,
        top=[],
        attention=arr.tobytes(),
        attention_shape=list(arr.shape),
        hidden=None,
        is_stop=False,
    )


def rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    arr = rng.random((L, H, N)).astype(np.float32)
    return arr / arr.sum(axis=-1, keepdims=True)


def test_reduce_per_layer_rows() -> None:
    arr = rows()
    t = token(arr)
    np.testing.assert_allclose(reduce_row(t, "per_layer", "float32", None, None), arr.mean(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(reduce_row(t, "per_layer", "float32", None, 2), arr[2].mean(axis=0), rtol=1e-6)
    # captured layers [4, 9, 1]: model layer 9 is the second row
    np.testing.assert_allclose(reduce_row(t, "per_layer", "float32", [4, 9, 1], 9), arr[1].mean(axis=0), rtol=1e-6)
    assert reduce_row(t, "per_layer", "float32", [4, 9, 1], 2) is None  # not captured


def test_reduce_aggregated_and_float16() -> None:
    agg = rows().mean(axis=(0, 1)).astype(np.float16)
    t = token(agg)
    out = reduce_row(t, "aggregated", "float16", None, None)
    assert out is not None and out.dtype == np.float32
    np.testing.assert_allclose(out, agg.astype(np.float32))
    assert reduce_row(t, "aggregated", "float16", None, 0) is None  # no layer in an aggregated row
    assert (
        reduce_row(TokenOut(0, 1, b"", "", None, [], None, [], None, False), "per_layer", "float32", None, None) is None
    )


def test_feed_fans_out_and_drops_the_oldest() -> None:
    feed = AttentionFeed()
    arr = rows()
    feed.publish("a", token(arr), "per_layer", "float32", None)  # nobody listens: nothing kept
    mean, one = feed.subscribe(None), feed.subscribe(1)
    for i in range(QUEUE_ROWS + 5):
        feed.publish("a", token(arr, i), "per_layer", "float32", None)
    assert mean.queue.qsize() == QUEUE_ROWS and one.queue.qsize() == QUEUE_ROWS
    first = mean.queue.get_nowait()
    assert first.index == 5 and first.slot_id == "a" and first.layer is None  # the 5 oldest were dropped
    assert one.queue.get_nowait().layer == 1
    feed.unsubscribe(mean)
    feed.publish("b", token(arr, 99), "per_layer", "float32", None)
    assert mean.queue.qsize() == QUEUE_ROWS - 1 and one.queue.qsize() == QUEUE_ROWS
