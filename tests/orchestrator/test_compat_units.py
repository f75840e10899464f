"""Units of the client-compatible APIs: stop-string hold-back, chat-template rendering and the Kobold
routes' cache-reuse default."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from orchestrator.api.common import kobold
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.config import Settings
from orchestrator.generation.chat_template import ChatTemplate
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.service_error import ServiceError
from orchestrator.services import Services


def feed_all(stops: list[str], parts: list[str], stop: str) -> list[str]:
    f = StopTextFilter(stops)
    return [f.feed(p) for p in parts] + [f.finish(stop)]


def test_stop_text_never_sent() -> None:
    out = feed_all(["\nUser:"], ["Hello", " there", "\n", "Us", "er:"], "\nUser:")
    assert out == ["Hello", " there", "", "", "", ""]  # the partial "\nUs" was held, then dropped


def test_held_text_released_when_it_is_not_a_stop() -> None:
    out = feed_all(["\nUser:"], ["a", "\n", "Usual", " text"], "")
    assert "".join(out) == "a\nUsual text" and out[1] == ""


def test_no_stops_passes_everything() -> None:
    assert feed_all([], ["a", "b"], "") == ["a", "b", ""]


def test_stop_in_the_middle_of_a_token() -> None:
    assert "".join(feed_all(["END"], ["foo EN", "Dbar"], "END")) == "foo "


def test_real_template_renders_chatml(model) -> None:  # type: ignore[no-untyped-def]
    t = ChatTemplate(model.chat_template, "", "<|im_end|>")
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    assert t.render([{"role": "user", "content": parts}]) == t.render([{"role": "user", "content": "Hi"}])


def test_template_errors_are_client_errors() -> None:
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x", "", "")
    with pytest.raises(ServiceError, match="user first"):
        t.render([{"role": "assistant", "content": "no"}])
    assert t.render([{"role": "user", "content": "ok"}]) == "x"
    with pytest.raises(ServiceError):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ServiceError):
        ChatTemplate("", "", "")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", "", "")
    with pytest.raises(ServiceError):
        sandboxed.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("settings", "body", "expected"),
    [
        ({}, {}, 64),  # KoboldCpp's ContextShift default
        ({"noshift": True}, {}, None),  # --noshift: the server's --cache-reuse (0: off)
        ({}, {"n_cache_reuse": 0}, 0),  # the request's own value wins
        ({"noshift": True}, {"n_cache_reuse": 32}, 32),
        ({"worker": {"engine": {"cache_reuse": 256}}}, {}, None),  # --cache-reuse N: N applies, as elsewhere
    ],
)
def test_kobold_cache_reuse_default(settings: dict[str, Any], body: dict[str, Any], expected: int | None) -> None:
    """What ``n_cache_reuse`` a Kobold body gets (the engine behaviour is tested end to end in
    tests/orchestrator/test_kobold_api.py); None means the server's ``--cache-reuse``."""
    services = cast(Services, SimpleNamespace(settings=msgspec.convert(settings, Settings)))
    data = msgspec.convert({"prompt": "Hi", **body}, GenerateRequest)
    assert asyncio.run(kobold.prepare(services, data)).n_cache_reuse == expected
