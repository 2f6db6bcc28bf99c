"""The `llama-cpp` system of `cosine bench compare`: llama.cpp's server on the same target weights.

The system a CPU user would otherwise pick. It runs only where a `llama-server` binary is given
(`--llama-server PATH`, else $COSINE_LLAMA_SERVER, else `llama-server` on PATH); without one the
bench skips it and says so in its notes. The weights are the zoo's target converted to GGUF in the
precision of the run (f32, or bf16 where the cluster runs bf16): `--llama-gguf PATH` /
$COSINE_LLAMA_GGUF names a converted file, else the bench converts the target once with
llama.cpp's `convert_hf_to_gguf.py` (next to the binary's source tree, or $COSINE_LLAMA_CONVERT),
run by $COSINE_LLAMA_PYTHON (it needs the `gguf` and `sentencepiece` packages), into the cache.

Requests go to the server's `/completion` endpoint, streamed (server-sent events), greedy
(temperature 0, top_k 1), the prompt as the same token ids the other systems get, one server
slot per client (`-np`), `-t` threads as the transformers baselines. Records are the same
`RequestRecord`s as every other system's, so every figure is computed alike.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cosine.bench.stats import RequestRecord

BUILD_HINT = ("build llama.cpp's server (README, 'llama.cpp in the comparison': about 25 minutes on 2 cores) and pass "
              "--llama-server PATH or set COSINE_LLAMA_SERVER")


def find_server(explicit: str | None = None) -> Path | None:
    """The llama-server binary: the option, else $COSINE_LLAMA_SERVER, else on PATH; None if none is executable."""
    for candidate in (explicit, os.environ.get("COSINE_LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def gguf_outtype(dtype_name: str) -> str:
    """convert_hf_to_gguf's --outtype for a torch dtype name: the same precision as the cluster's weights."""
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype_name]


def find_converter(server: Path) -> Path | None:
    """convert_hf_to_gguf.py: $COSINE_LLAMA_CONVERT, else in the source tree the binary was built in."""
    env = os.environ.get("COSINE_LLAMA_CONVERT")
    if env:
        return Path(env) if Path(env).is_file() else None
    for parent in server.resolve().parents:  # llama.cpp/build/bin/llama-server → llama.cpp/, or a sibling llama.cpp/
        for script in (parent / "convert_hf_to_gguf.py", parent / "llama.cpp" / "convert_hf_to_gguf.py"):
            if script.is_file():
                return script
    return None


def convert_command(converter: Path, target_dir: Path, out: Path, outtype: str, python: str | None = None) -> list[str]:
    return [python or os.environ.get("COSINE_LLAMA_PYTHON") or sys.executable, str(converter), str(target_dir),
            "--outfile", str(out), "--outtype", outtype]


def ensure_gguf(server: Path, target_dir: Path, outtype: str, cache_dir: Path, explicit: str | None = None) -> Path:
    """The target as GGUF in `outtype`: the given file, or a conversion cached under cache_dir."""
    given = explicit or os.environ.get("COSINE_LLAMA_GGUF")
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"GGUF file {given} does not exist")
        return Path(given)
    out = cache_dir / f"{target_dir.name}-{outtype}.gguf"
    if out.is_file():
        return out
    converter = find_converter(server)
    if converter is None:
        raise FileNotFoundError("convert_hf_to_gguf.py not found next to the llama-server source tree: set "
                                "COSINE_LLAMA_CONVERT, or give a converted file with --llama-gguf")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    proc = subprocess.run(convert_command(converter, target_dir, tmp, outtype), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"converting {target_dir} to GGUF failed: {' | '.join(tail)} (the converter needs the "
                           f"gguf and sentencepiece packages: set COSINE_LLAMA_PYTHON to a python that has them)")
    tmp.rename(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on a loopback port, stopped by its own handle."""

    def __init__(self, binary: Path, gguf: Path, threads: int, parallel: int, context: int, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-np", str(parallel), "-c", str(context * parallel)]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_healthy(self.url, timeout_s, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until GET /health answers 200 (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server at {url} was not healthy within {timeout_s:.0f} s")


def completion_body(prompt_ids: list[int], max_new: int) -> dict:
    """Greedy, streamed, the prompt as token ids, the output as token ids too."""
    return {"prompt": list(prompt_ids), "n_predict": int(max_new), "temperature": 0.0, "top_k": 1,
            "stream": True, "return_tokens": True, "cache_prompt": False}


def complete(url: str, prompt_ids: list[int], max_new: int, rec: RequestRecord, t0: float, timeout: float = 900) -> RequestRecord:
    """One streamed /completion into `rec` (token ids and their arrival times on the clock of t0)."""
    req = urllib.request.Request(url + "/completion", data=json.dumps(completion_body(prompt_ids, max_new)).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:].strip())
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                ids = [int(t) for t in event.get("tokens") or []]
                if ids:
                    now = time.perf_counter() - t0
                    rec.token_ids += ids
                    rec.token_times_s += [now] * len(ids)
                if event.get("stop"):
                    break
    except (urllib.error.URLError, OSError, ValueError, RuntimeError) as exc:
        rec.error = f"llama-server: {exc}"
    rec.end_s = time.perf_counter() - t0
    return rec


class LlamaCppSystem:
    """Closed-loop and Poisson load against a running llama-server, as the other systems are driven."""

    name = "llama-cpp"

    def __init__(self, url: str, prompt_ids: dict[int, list[int]]):
        self.url = url
        self.ids = prompt_ids

    def warm_up(self, prompt_index: int) -> None:
        complete(self.url, self.ids[prompt_index], 4, RequestRecord(prompt_index, "", 0.0), time.perf_counter())

    def closed_loop(self, workload, order: list[int], concurrency: int, max_new: int, bar=None) -> tuple[list[RequestRecord], float]:
        from cosine.bench.client import run_closed_loop

        def send(p: int, t0: float) -> RequestRecord:
            rec = RequestRecord(prompt_index=p, domain=workload[p].domain, arrival_s=time.perf_counter() - t0)
            complete(self.url, self.ids[p], max_new, rec, t0)
            return rec

        return run_closed_loop(order, concurrency, send, bar)

    def poisson(self, workload, order: list[int], arrivals: list[float], max_new: int, bar=None) -> tuple[list[RequestRecord], float]:
        t0 = time.perf_counter()

        def one(i, p):
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            rec = RequestRecord(prompt_index=p, domain=workload[p].domain, arrival_s=arrivals[i])
            complete(self.url, self.ids[p], max_new, rec, t0)
            if bar is not None:
                bar.update(1)
            return rec

        with ThreadPoolExecutor(max_workers=max(1, len(order))) as pool:
            records = list(pool.map(lambda ip: one(*ip), enumerate(order)))
        return records, time.perf_counter() - t0
