"""The worker protocol: every message round-trips over a real socket pair; bad frames are refused (no model)."""

from __future__ import annotations

import asyncio
import socket
import typing

import msgspec
import numpy as np
import pytest

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.framing import FrameStream, parse_address
from contract.model_facts import EngineRuntime, ModelInfo
from contract.options import CaptureOptions, SamplingParams

RUNTIME = EngineRuntime(
    backend="CPU", devices=["CPU (x86)"], n_gpu_layers=0, n_layers_offloaded=0, extra_bufts=[], use_extra_bufts=False,
    repack_reason="requested (--no-repack)", flash_attn=False, type_k="f16", type_v="f16", kv_unified=True,
    n_threads=2, n_seq_max=6, capture="graph", self_check_ms=3.5, system_info="AVX2 = 1",
)  # fmt: skip
INFO = ModelInfo(
    model_name="m", model_path="/m.gguf", architecture="llama", description="d", fingerprint="f" * 16,
    vocab_size=49152, num_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, n_ctx=512,
    n_ctx_train=8192, n_kv_cells=1536, n_slots=2, attention_layers=[0, 1], rope_freq_base=1e5, rope_freq_scale=1.0, bos_token_id=1,
    eos_token_id=2, eot_token_id=2, eog_token_ids=[2], special_tokens={"bos": "<s>", "bos_id": 1},
    chat_template="{{ x }}", n_params=134_515_008, size_bytes=1 << 20, llama_cpp_version="0.3.36", runtime=RUNTIME,
)  # fmt: skip
PARAMS = SamplingParams(seed=3, temperature=0.0, stop_strings=["\n\n"], n_probs=2, logprobs=True)
GRAMMAR_PARAMS = SamplingParams(
    grammar='root ::= "yes" | "no"', logit_bias=[(7, float("-inf")), (8, 2.5)], mirostat=2, dry_multiplier=0.8,
    dry_sequence_breakers=["\n"], presence_penalty=0.5, json_schema='{"type": "object"}',
)  # fmt: skip
CAPTURE = CaptureOptions(attention=True, format="aggregated", dtype="float16", layers=[0, 29])
ATTENTION = np.random.default_rng(0).random((2, 9, 17), dtype=np.float32)
HIDDEN = np.linspace(-1, 1, 576, dtype=np.float32)
STATE = np.arange(100_000, dtype=np.uint32).astype(np.uint8).tobytes()
LOGITS = np.array([[0.5, -1.0], [2.0, 0.25]], dtype=np.float32)

# One example of every message, with the buffers it describes.
REQUESTS: list[tuple[proto.Message, list[bytes]]] = [
    (proto.Generate(1, 0, "generate", [5, 6], PARAMS, CAPTURE, progress=True), []),
    (proto.Generate(2, -1, "preview", [5], PARAMS, CaptureOptions(), append=[7, 8]), []),
    (proto.Cancel(3, 1), []),
    (proto.Ack(3, 1, 5), []),
    (proto.Release(3, [0, 4096]), []),
    (proto.Tokenize(4, "héllo <|im_end|>", True, False), []),
    (proto.Detokenize(5, [1, 2, 3]), []),
    (proto.Tokens(6, 0), []),
    (proto.Erase(7, 1), []),
    (proto.Truncate(8, 1, 12), []),
    (proto.Fork(9, 0, 1), []),
    (proto.ContextShift(10, 0, 4, 16), []),
    (proto.SaveState(11, 1), []),
    (proto.SaveFile(13, 1, "/tmp/slots/a.bin"), []),
    (proto.LoadFile(14, 2, "/tmp/slots/a.bin"), []),
    (proto.RestoreState(12, 1, [1, 2, 3], proto.Tensor.raw(STATE)), [STATE]),
    (proto.Classify(13, ["a", "b"]), []),
    (proto.Status(14), []),
    (proto.Shutdown(15), []),
    (proto.CheckSampling(16, GRAMMAR_PARAMS), []),
    (proto.ReadKV(17, 1, [proto.KVRange(0, 0, 256), proto.KVRange(1, 128, 256)]), []),
]
REPLIES: list[tuple[proto.Message, list[bytes]]] = [
    (proto.Starting(0, "loading_model", 0.25), []),
    (proto.Ready(0, INFO, [b"<s>", b"\xe2\x82"]), []),
    (
        proto.Token(
            1, 0, 42, b"\xe2\x82", -0.5, [(42, -0.5)], 17, proto.Tensor.of(ATTENTION, 0), proto.Tensor.of(HIDDEN, 1)
        ),
        [ATTENTION.tobytes(), HIDDEN.tobytes()],
    ),
    (proto.Token(1, 1, 43, b"a", hidden=proto.Tensor.of(HIDDEN, 0)), [HIDDEN.tobytes()]),
    (proto.Progress(1, 300, 44, 256, 12.5), []),
    (proto.Done(1, "stop_string", 10, 2, 8, 3, 1.5, 2.5, stop_string="\n\n", seq_tokens=13), []),
    (proto.Error(1, ErrorCode.SLOT_BUSY, "sequence 0 is generating"), []),
    (proto.TokenizeResult(4, [1, 2], [b"h", b"\xc3"]), []),
    (proto.DetokenizeResult(5, "héllo"), []),
    (proto.SeqTokens(6, 0, [1, 2, 3]), []),
    (proto.StateBlob(11, 1, [1, 2, 3], 0.5, proto.Tensor.raw(STATE)), [STATE]),
    (proto.StateRestored(12, 1, 3, 7.5), []),
    (proto.StateRestored(14, 2, 3, 7.5, 4096), []),
    (proto.KVRecords(17, 1, [1, 2, 3], 0.5, [proto.Tensor.raw(STATE)]), [STATE]),
    (proto.FileSaved(13, 1, 3, 4096, 9.5), []),
    (proto.Classified(13, [4, 5], proto.Tensor.of(LOGITS, 0)), [LOGITS.tobytes()]),
    (proto.EngineState(14, [0]), []),
    (proto.EngineState(14, [0], 1 << 26, 1 << 25, 7, 1), []),
    (proto.Stopped(15), []),
    (proto.SamplingChecked(16), []),
]


def _name(case: tuple[proto.Message, list[bytes]]) -> str:
    return type(case[0]).__name__


def test_every_message_has_an_example() -> None:
    assert {type(m) for m, _ in REQUESTS} == set(typing.get_args(proto.Request))
    assert {type(m) for m, _ in REPLIES} == set(typing.get_args(proto.Reply))

    # every message of the protocol is in one of the two unions (a process may extend one for its own use,
    # as the orchestrator's DoneOut extends Done: that is no message)
    def leaves(cls: type) -> set[type]:
        subs = [s for s in cls.__subclasses__() if s.__module__ == proto.__name__]
        return set().union(*map(leaves, subs)) if subs else {cls}

    assert leaves(proto.Message) == set(typing.get_args(proto.Request)) | set(typing.get_args(proto.Reply))


@pytest.mark.parametrize("case", REQUESTS, ids=_name)
def test_request_round_trip(case: tuple[proto.Message, list[bytes]]) -> None:
    msg, bufs = case
    a, b = socket.socketpair()
    with a, b:
        proto.send_frame(a, msg, bufs)
        got, got_bufs = proto.recv_request(b)
    assert got == msg and type(got) is type(msg)
    assert [bytes(x) for x in got_bufs] == bufs
    if isinstance(got, proto.RestoreState):
        assert got.state.take(got_bufs) == STATE


@pytest.mark.parametrize("case", REPLIES, ids=_name)
def test_reply_round_trip(case: tuple[proto.Message, list[bytes]]) -> None:
    msg, bufs = case

    async def main() -> tuple[proto.Reply, list[bytes]]:
        a, b = socket.socketpair()
        _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
        proto.send_frame(a, msg, bufs)
        try:
            return await proto.read_reply(stream)
        finally:
            a.close()
            stream.close()

    got, got_bufs = asyncio.run(main())
    assert got == msg and type(got) is type(msg)
    assert got_bufs == bufs


def test_tensors_describe_their_buffers() -> None:
    """A receiver reads each tensor from its description alone, whatever the buffers' order."""
    tok = proto.Token(1, 0, 42, b"x", attention=proto.Tensor.of(ATTENTION, 1), hidden=proto.Tensor.of(HIDDEN, 0))
    bufs = [HIDDEN.tobytes(), ATTENTION.tobytes()]
    assert tok.attention is not None and tok.hidden is not None
    att = np.frombuffer(tok.attention.take(bufs), dtype=tok.attention.dtype).reshape(tok.attention.shape)
    assert np.array_equal(att, ATTENTION)
    assert np.array_equal(np.frombuffer(tok.hidden.take(bufs), dtype=tok.hidden.dtype), HIDDEN)
    half = ATTENTION.astype(np.float16)
    assert proto.Tensor.of(half, 0) == proto.Tensor(0, "float16", (2, 9, 17))
    with pytest.raises(proto.ProtocolError, match="needs"):  # a buffer of the wrong size
        proto.Tensor.of(ATTENTION, 0).take([half.tobytes()])
    with pytest.raises(proto.ProtocolError, match="buffer 2"):  # a buffer that is not there
        proto.Tensor(2, "uint8", (4,)).take(bufs)
    with pytest.raises(ValueError, match="float64"):  # nothing else is sent
        proto.Tensor.of(np.zeros(3), 0)


def _raw_frame(meta: bytes) -> bytes:
    """A frame around hand-made msgpack ``meta`` (no buffers)."""
    return len(meta).to_bytes(4, "little") + b"\x00\x00\x00\x00" + meta


@pytest.mark.parametrize(
    "meta",
    [
        msgspec.msgpack.encode(["SeqOp", 1, "erase", 0, 0, 0]),  # the old generic op: an unknown tag
        msgspec.msgpack.encode(["Bogus", 1]),
        msgspec.msgpack.encode(["Token", 1, 0, 1, b"x"]),  # a reply sent as a request
        msgspec.msgpack.encode(["Generate", 1, 0, "sample", [1], {}, {}]),  # a mode that is not a Literal value
        msgspec.msgpack.encode(["Truncate", 1, 0, -1]),  # n_keep < 0
        msgspec.msgpack.encode(["RestoreState", 1, 0, [1], [0, "int8", [4]]]),  # a dtype we do not send
        msgspec.msgpack.encode({"req": 1}),  # not a tagged array
    ],
    ids=["old-seq-op", "unknown", "reply-as-request", "bad-mode", "negative", "bad-dtype", "untagged"],
)
def test_unknown_or_malformed_requests_are_refused(meta: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_raw_frame(meta))
        with pytest.raises(proto.ProtocolError, match="bad request frame"):
            proto.recv_request(b)


def test_unknown_replies_and_error_codes_are_refused() -> None:
    async def read(meta: bytes) -> None:
        a, b = socket.socketpair()
        _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
        a.sendall(_raw_frame(meta))
        try:
            await proto.read_reply(stream)
        finally:
            a.close()
            stream.close()

    for meta in (
        msgspec.msgpack.encode(["SeqInfo", 1, -1, []]),  # Shutdown's old answer
        msgspec.msgpack.encode(["Error", 1, "NO_SUCH_CODE", "x"]),
        msgspec.msgpack.encode(["Done", 1, "eos", 1, 0, 1, 0, 0.0, 0.0]),  # not a finish reason
        msgspec.msgpack.encode(["Generate", 1, 0, "generate", [1], {}, {}]),  # a request sent as a reply
    ):
        with pytest.raises(proto.ProtocolError, match="bad reply frame"):
            asyncio.run(read(meta))


def test_garbage_frames_are_rejected() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
        with pytest.raises(proto.ProtocolError):
            proto.recv_request(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\xff\xff\xff\x7f\x00\x00\x00\x00")  # absurd meta length
        with pytest.raises(proto.ProtocolError):
            proto.recv_request(b)
    a, b = socket.socketpair()
    with b:
        a.sendall(b"\x10\x00")
        a.close()
        with pytest.raises(proto.ProtocolError):
            proto.recv_request(b)


def test_worker_addresses() -> None:
    assert parse_address("unix:/tmp/w.sock") == (socket.AF_UNIX, "/tmp/w.sock")
    assert parse_address("tcp:10.0.0.2:7000") == (socket.AF_INET, ("10.0.0.2", 7000))
    assert parse_address("tcp::7000") == (socket.AF_INET, ("127.0.0.1", 7000))
    for bad in ("http://x", "unix:", "tcp:host:port", "tcp:host"):
        with pytest.raises(ValueError):
            parse_address(bad)
