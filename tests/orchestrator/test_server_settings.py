"""``slotserve serve``'s flags are generated from :class:`orchestrator.config.Settings` (declared once)."""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.cli import build_parser, main, settings_from_args
from orchestrator.config import Settings


def serve(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_no_flags_give_the_declared_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLOTSERVE_API_KEY", "SLOTSERVE_ADMIN_KEY", "SLOTSERVE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    got = serve()
    assert msgspec.structs.replace(got, worker=Settings().worker) == Settings()


def test_flags_set_their_fields() -> None:
    got = serve(
        "--no-slots", "--no-persist", "--allowed-origins", "http://a, http://b", "--cors-origin", "http://c",
        "--state-dir", "/tmp/st", "-n", "5", "--lease-ms", "900", "--header-timeout", "2.5",
        "--classifier-model", "c.gguf", "--ctx-size", "512",
    )  # fmt: skip
    assert (got.slots_endpoint, got.persist, got.n_predict, got.lease_ms) == (False, False, 5, 900)
    assert got.allowed_origins == ("http://a", "http://b", "http://c")
    assert str(got.state_dir) == "/tmp/st" and got.read_limits.header_timeout_s == 2.5
    assert got.worker.engine.n_ctx == 512
    assert got.classifier is not None and got.classifier.engine.model == "c.gguf" and got.classifier.engine.classifier


def test_the_environment_gives_keys_the_flags_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_API_KEY", "from-env")
    assert serve().api_key == "from-env"
    assert serve("--api-key", "from-flag").api_key == "from-flag"


@pytest.mark.parametrize("argv", [["--queue-size", "-1"], ["--codec", "gzip"], ["--header-timeout", "0"]])
def test_a_value_out_of_range_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err
