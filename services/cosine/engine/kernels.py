"""CoSine's own CPU kernels (`csrc/`), built once per machine with torch's C++ extension tooling.

`packed_linear` (`torch.ops.cosine.packed_linear(x, wp, bias, residual)` over a weight from
`torch.ops.cosine.pack_weight(w)`): an fp32 (AVX-512) or bf16 (AVX512-BF16) matmul whose every row has the
same bits whatever rows share its call, and on an AMD EPYC faster than oneDNN's at 1-300 rows (see
`csrc/packed_linear.cpp`). `NativeLlama` multiplies with it in fp32 wherever it runs, and in bf16 where
oneDNN's bf16 matmuls are not row-invariant (on an Intel Xeon with AMX they were, and use AMX tiles, which
this kernel does not).

The build (some seconds with g++ and ninja) goes to ``$COSINE_CACHE/kernels/<torch>-<hash>/`` (or
``$COSINE_KERNELS_DIR/<torch>-<hash>/``: the image builds it there) and is reused by every later process;
`scripts/install.sh` runs it (`python -m cosine.engine.kernels`). Where it cannot be built (no C++
compiler, no ninja) or the CPU lacks AVX-512, the ops' schemas are still defined, so that TorchScript
compiles the layers that name them, and the engine keeps oneDNN: `available()` says which.
`COSINE_KERNELS=0` turns them off.

`attention_rows` (`csrc/attention_rows.cpp`): each new row of a step attends over the keys it sees, listed in
plain decoding's order wherever the cache stores them, with every sum in that order: a row's bits depend on those
keys alone, so a draft tree's nodes get plain decoding's logits (in bf16 too), and it is about 2x cheaper than
SDPA at a step's shapes. `decoder_step` (`csrc/decoder_step.cpp`): every decoder layer of such a step in one call
over the two (norms, RoPE, cache writes and SwiGLU as loops over each row's own elements): real target, 2 threads,
bf16 one-token step 5.6 against 6.9 ms through the TorchScript layers. `greedy_tokens` (`csrc/greedy_head.cpp`):
a greedy row's token from a bf16 screen of the fp32 head, bitwise the full head's argmax (`greedy_head.py`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "cosine_kernels"
HEADER = Path(__file__).parent / "csrc" / "cosine_kernels.h"
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("packed_linear.cpp", "attention_rows.cpp", "decoder_step.cpp", "greedy_head.cpp")]
# -fopenmp: at::parallel_for's OpenMP backend is inline in ATen's headers (without it: one thread)
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
SCHEMAS = ["kernel_supported(ScalarType dtype) -> bool", "pack_weight(Tensor w) -> Tensor",
           "packed_linear(Tensor x, Tensor wp, Tensor? bias=None, Tensor? residual=None) -> Tensor",
           "attention_rows(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor prefix, Tensor offsets, Tensor index, "
           "float scale) -> Tensor",
           "decoder_step(Tensor x, Tensor[] ln1, Tensor[] ln2, Tensor[] qkv_w, Tensor?[] qkv_b, Tensor[] o_w, "
           "Tensor?[] o_b, Tensor[] gate_up_w, Tensor?[] gate_up_b, Tensor[] down_w, Tensor?[] down_b, "
           "Tensor cache_k, Tensor cache_v, Tensor cos, Tensor sin, Tensor kv_index, Tensor slots, Tensor prefix, "
           "Tensor offsets, Tensor index, int nh, int nkv, int hd, int intermediate, float eps, float scale) -> Tensor",
           "greedy_tokens(Tensor x, Tensor screen, Tensor packed, float w_norm, float wb_norm, float d_norm, "
           "int max_candidates) -> (Tensor, Tensor)"]
_schemas_only = None  # keeps the schema-only library alive when the build is missing


def build_dir() -> Path:
    """Where this source, these flags and this torch build their library: under $COSINE_KERNELS_DIR (the
    image sets it: built at image build time), else $COSINE_CACHE/kernels."""
    from cosine.zoo.registry import cache_root

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*SOURCES, HEADER]) + " ".join(CFLAGS + LDFLAGS).encode())
    root = Path(os.environ["COSINE_KERNELS_DIR"]) if os.environ.get("COSINE_KERNELS_DIR") else cache_root() / "kernels"
    return root / f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:12]}"


def build() -> None:
    """Compile and load the kernels (torch's C++ extension tooling: g++ and ninja; a lock file serialises
    processes that build at once)."""
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, wherever pip put its scripts (a --user install's bin may not be on PATH)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=NAME, sources=[str(p) for p in SOURCES], build_directory=str(out),
                       extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False)


@functools.lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per machine) and load the kernels; True when loaded (`available` says for which dtype they
    run on this CPU). Never raises: without them the schemas alone are defined (and the engine does not call
    them)."""
    global _schemas_only
    if os.environ.get("COSINE_KERNELS", "1") == "0":
        log.info("COSINE_KERNELS=0: CoSine's CPU kernels are off")
    else:
        try:
            library = build_dir() / f"{NAME}.so"
            if library.exists():  # built before (by install.sh, or another process): no compiler needed
                torch.ops.load_library(str(library))
            else:
                build()
            return True
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a refused build: oneDNN instead
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            log.warning("CoSine's CPU kernels could not be built here (%s: %s); the engine keeps oneDNN's matmuls "
                        "(with g++ installed, `python -m cosine.engine.kernels` builds them)",
                        type(e).__name__, first)
    if not hasattr(torch.ops.cosine, "packed_linear"):
        _schemas_only = torch.library.Library("cosine", "FRAGMENT")
        for schema in SCHEMAS:
            _schemas_only.define(schema)
    return False


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `packed_linear` can serve a model of this dtype on this device (fp32: AVX-512; bf16:
    AVX512-BF16)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load() \
        and bool(torch.ops.cosine.kernel_supported(dtype))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cpu = torch.device("cpu")
    runs = [name for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)) if available(cpu, dt)]
    state = f"built, they run here in {' and '.join(runs)}" if runs else \
        ("built, but this CPU lacks AVX-512: the engine uses oneDNN" if load() else "not built: the engine uses oneDNN")
    print(f"cosine kernels: {state} ({build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
