"""Engine settings are declared once (contract/settings.py): both command lines and the worker's hand-over agree."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from contract import settings
from contract.settings import EngineSettings
from orchestrator.cli import build_parser, worker_options
from orchestrator.engine_client.launch import WorkerOptions


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _worker(*argv: str) -> EngineSettings:
    from engine.worker import parse_args

    return parse_args(["--connect", "unix:/tmp/x.sock", *argv])[1]


def test_defaults_are_the_structs() -> None:
    assert worker_options(_serve()).engine == EngineSettings()
    assert _worker() == EngineSettings()


# llama-server's names and short aliases, and the switches of the old command lines
FLAGS = [
    (["-m", "/m.gguf"], {"model": "/m.gguf"}),
    (["-c", "512"], {"n_ctx": 512}),
    (["--ctx-size", "512"], {"n_ctx": 512}),
    (["-np", "2"], {"n_slots": 2}),
    (["--parallel", "2"], {"n_slots": 2}),
    (["--spare", "0"], {"n_spare": 0}),
    (["-t", "3"], {"n_threads": 3}),
    (["-b", "64", "-ub", "32"], {"n_batch": 64, "n_ubatch": 32}),
    (["-ngl", "99"], {"n_gpu_layers": 99}),
    (["--verify-cells"], {"verify_cells": True}),
    (["--repack"], {"repack": True}),
    (["--no-repack"], {"repack": False}),
    (["-fa", "off"], {"flash_attn": "off"}),
    (["--flash-attn", "on", "-ctv", "q8_0"], {"flash_attn": "on", "type_v": "q8_0"}),
    # llama-server's multi-GPU flags
    (["--device", "CUDA0,CUDA1"], {"device": ("CUDA0", "CUDA1")}),
    (["-dev", "CUDA1", "-dev", "CUDA0"], {"device": ("CUDA1", "CUDA0")}),
    (["-dev", "none"], {"device": ("none",)}),
    (["-sm", "row", "-mg", "1"], {"split_mode": "row", "main_gpu": 1}),
    (["--split-mode", "none"], {"split_mode": "none"}),
    (["-ts", "3,1"], {"tensor_split": "3,1"}),
]


@pytest.mark.parametrize(("argv", "want"), FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_both_command_lines_take_every_engine_flag(argv: list[str], want: dict[str, object]) -> None:
    expect = msgspec.structs.replace(EngineSettings(), **want)
    assert worker_options(_serve(*argv)).engine == expect
    assert _worker(*argv) == expect


def test_worker_only_flags_are_not_on_serve() -> None:
    assert _worker("--classifier", "--no-capture") == EngineSettings(classifier=True, capture=False)
    for flag in ("--classifier", "--no-capture"):
        with pytest.raises(SystemExit):
            _serve(flag)


def test_the_worker_gets_the_settings_whole() -> None:
    """What ``serve`` parsed is what the spawned worker runs with (``--settings JSON``)."""
    engine = worker_options(_serve("-c", "1024", "-np", "3", "--no-repack", "-m", "/x.gguf")).engine
    argv = WorkerOptions(engine).argv("unix:/tmp/w.sock")
    assert argv[1:5] == ["-m", "engine.worker", "--connect", "unix:/tmp/w.sock"]
    assert _worker(*argv[5:]) == engine
    # a flag beside --settings overrides it (a standalone worker started by hand)
    assert _worker(*argv[5:], "-c", "256").n_ctx == 256


@pytest.mark.parametrize(
    "argv",
    [
        ["-c", "0"],
        ["-np", "-1"],
        ["-b", "0"],
        ["--spare", "-2"],
        ["-c", "many"],
        ["-sm", "diagonal"],
        ["-mg", "-1"],
        ["-ts", "3,x"],
        ["-ts", "0,0"],
        ["-ts", "1,-1"],
        ["-ts", "nan"],
    ],
)
def test_bad_values_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _worker(*argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2


def test_tensor_split_reads_as_proportions() -> None:
    assert EngineSettings(tensor_split="3,1").tensor_split_values == (3.0, 1.0)
    assert EngineSettings(tensor_split="1/2/0").tensor_split_values == (1.0, 2.0, 0.0)  # llama-server splits on / too
    assert EngineSettings().tensor_split_values == ()
    with pytest.raises(msgspec.ValidationError, match="tensor-split"):
        settings.decode('{"tensor_split": "a,b"}')


def test_settings_json_is_checked() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        settings.decode('{"n_ctx": 512, "n_ctxx": 1}')
    with pytest.raises(msgspec.ValidationError):
        settings.decode('{"n_slots": 0}')
    with pytest.raises(SystemExit):
        _worker("--settings", '{"n_ctx": "big"}')
    s = EngineSettings(n_ctx=300, n_slots=2, n_spare=1)
    assert settings.decode(settings.encode(s)) == s
    assert (s.n_seq_max, s.n_ctx_seq) == (3, 512)


def test_every_field_has_help_and_unique_flags() -> None:
    seen: list[str] = []
    for name, _kind, flag, _default in settings._fields():
        assert flag.help and flag.flags[0].startswith("--"), name
        seen += flag.flags
    assert len(seen) == len(set(seen))
    assert {f.name for f in msgspec.structs.fields(EngineSettings)} == {n for n, *_ in settings._fields()}
