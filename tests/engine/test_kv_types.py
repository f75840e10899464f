"""KV cache types (``--cache-type-k`` / ``--cache-type-v``): an engine with an f32 cache.

* A state records its K/V types (``slotstate/seq_state.py``: a ``k_type`` / ``v_type`` per
  layer), so a state saved under one cache type is refused by an engine with another one
  (``BAD_STATE``), and the target sequence keeps what it held.
* With f32 K and V the captured attention matches transformers' eager float32 attention
  (``hf_reference``) within the bounds of ``test_hf_reference`` (per head: correlation
  > 0.98, mean abs diff < 0.01); the default f16 cache is reported beside it.  On CPU
  an f32 cache does not bring the rows closer: measured with this prompt, min per-head
  correlation f16 0.9935 / f32 0.9848, worst head mean abs diff 0.0055 / 0.0072.  The
  difference is the comparison's noise floor (llama.cpp's Q8_1 activation rounding,
  amplified layer after layer; see ``hf_reference``), not the cache's precision.
"""

from __future__ import annotations

import pytest

from contract.settings import EngineSettings
from engine.engine import Engine
from engine.errors import EngineError
from tests.conftest import CHAT
from tests.engine.enginekit import Result, Runner, llama_state

N_NEW = 8


@pytest.fixture(scope="module")
def engine_f32(model):  # type: ignore[no-untyped-def]
    eng = Engine(
        model,
        EngineSettings(n_ctx=512, n_slots=2, n_spare=1, n_threads=2, verify_cells=True, type_k="f32", type_v="f32"),
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:  # type: ignore[no-untyped-def]
    return model.tokenize(CHAT.format("What is the capital of France?"), False, True)


def test_f32_cache_is_in_force(engine_f32: Engine, engine: Engine) -> None:
    assert (engine_f32.type_k, engine_f32.type_v) == (0, 0)  # GGML_TYPE_F32
    assert (engine.type_k, engine.type_v) == (1, 1)  # GGML_TYPE_F16, the default
    assert engine_f32.fingerprint != engine.fingerprint


def test_state_of_another_cache_type_is_refused(engine_f32: Engine, engine: Engine, prompt: list[int]) -> None:
    engine.erase(0)
    Runner(engine).generate(0, prompt, max_new_tokens=2)
    tokens16, blob16 = engine.save_state(0)
    Runner(engine_f32).generate(0, prompt, max_new_tokens=2)
    tokens32, blob32 = engine_f32.save_state(0)
    assert len(blob32) > len(blob16)  # 4 bytes per K/V value instead of 2
    kept32 = list(engine_f32.tokens[0])
    with pytest.raises(EngineError) as err:
        engine_f32.restore_state(0, tokens16, bytes(blob16), check_values=True)
    assert err.value.code == "BAD_STATE"
    assert engine_f32.tokens[0] == kept32 and llama_state(engine_f32.ctx, 0) == blob32  # the cache itself
    kept16 = list(engine.tokens[0])
    with pytest.raises(EngineError) as err:
        engine.restore_state(0, tokens32, bytes(blob32), check_values=True)
    assert err.value.code == "BAD_STATE"
    assert engine.tokens[0] == kept16
    engine_f32.restore_state(1, tokens32, bytes(blob32), check_values=True)  # the same type is taken
    assert engine_f32.tokens[1] == tokens32
    for eng in (engine, engine_f32):
        eng.erase(0)
    engine_f32.erase(1)


@pytest.mark.slow
def test_f32_cache_attention_matches_transformers(
    engine_f32: Engine,
    engine: Engine,
    model_path,  # type: ignore[no-untyped-def]
    prompt: list[int],
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from tests.engine.hf_reference import generated_rows_vs_reference, load_reference, reference_forward

    results: dict[str, Result] = {}
    for name, eng in (("f16", engine), ("f32", engine_f32)):
        eng.erase(0)
        results[name] = Runner(eng).generate(0, prompt, max_new_tokens=N_NEW, ignore_eos=True)
        eng.erase(0)
    assert results["f16"].tokens[:4] == results["f32"].tokens[:4]
    ids = prompt + results["f32"].tokens
    att, _ = reference_forward(load_reference(model_path), ids)
    stats = {name: generated_rows_vs_reference(res.attention, att, len(prompt)) for name, res in results.items()}
    print(f"\n[kv-types] min per-head correlation / worst head mean abs diff vs transformers fp32: {stats}")
    assert stats["f32"][0] > 0.98
    assert stats["f32"][1] < 0.01
