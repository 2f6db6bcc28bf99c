"""A native Llama-family decoder (Llama, SmolLM, Qwen2-style) over a slot-based KV cache.

It loads an ordinary `transformers` checkpoint directory (config.json plus
safetensors shards, or a pytorch_model.bin): grouped-query attention, the
config's RoPE settings (any static `rope_type` transformers knows: default,
linear, llama3, yarn, ...), rms_norm_eps, tied or separate embeddings, and the
q/k/v/o biases Qwen2-style checkpoints carry.

`forward(batch, cache)` runs ONE pass over a ragged batch: each `Seq` brings
its own new tokens, their RoPE positions, the cache slot they extend and,
optionally, tree parents (node i sees the slot's cached prefix, its ancestors
and itself; without parents the new tokens are causal). The new tokens' KV is
written at the slot's next positions, [length, length + n), in the order given;
the caller decides afterwards what length to keep (see NativeTarget).

Per layer the work is a handful of large ops: q/k/v as one matmul, RoPE on q
and k together, the KV write, one SDPA call with the query heads of a KV group
folded into the query length (no repeated K/V), o, gate/up as one matmul, down.
On CPU with oneDNN's prepacked weights the residual adds ride inside the o and
down matmuls as post-ops. Tokens are packed (no padding) everywhere except
inside attention. This module prepares a pass (positions, masks, where each
row's K/V goes, the logits wanted); the layers' arithmetic lives in
`cosine.engine.layers`, which TorchScript runs on CPU.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from cosine.engine import kernels, layers
from cosine.engine.greedy_head import GreedyHead
from cosine.engine.hugepages import on_huge_pages
from cosine.engine.kv_cache import SlotKVCache
from cosine.engine.sampling import greedy_tokens

log = logging.getLogger(__name__)

LLAMA_FAMILY = {"llama", "qwen2", "mistral", "smollm", "smollm2", "smollm3"}


@dataclass
class Seq:
    """One request's part of a forward pass."""

    slot: int
    tokens: list[int]
    positions: list[int]  # RoPE position of each new token
    parents: list[int] | None = None  # None: causal chain; else local parent index (-1 = cached prefix)
    # "all", "last" or "none": which new tokens need logits; "greedy": every new token's row, but only its greedy
    # token (the first index of its logits' maximum), returned as int64 [n] instead of logits
    logits: str = "all"
    # Rows of a prompt's prefill: their numbers need only be a function of this Seq's own tokens and
    # cache (the same prompt prefilled alone or beside others gives the same bits), not equal to each
    # token decoded alone. A row-invariant (bf16) forward whose Seqs are all prompts then attends once
    # per request instead of once per row (see forward); elsewhere it changes nothing.
    prompt: bool = False


@dataclass
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    rope: dict = field(default_factory=dict)


def spec_from_config(config) -> LlamaSpec:
    n_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return LlamaSpec(
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        n_layers=int(config.num_hidden_layers),
        n_heads=n_heads,
        n_kv_heads=int(getattr(config, "num_key_value_heads", None) or n_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        hidden_act=str(getattr(config, "hidden_act", "silu")),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope=dict(getattr(config, "rope_parameters", None) or {}),
    )


def rope_inv_freq(config, spec: LlamaSpec, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], attention scaling) as transformers computes them."""
    params = spec.rope or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        dim = spec.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope") and max_positions > spec.max_position_embeddings:
        raise NotImplementedError(f"rope_type {rope_type!r} beyond max_position_embeddings is not supported natively")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    state = {}
    for f in bins:
        state.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return state


@functools.lru_cache(maxsize=8)
def _mkldnn_linear_works(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear (what torch.compile's CPU backend uses), checked against F.linear."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol))
    except Exception:  # noqa: BLE001 - any failure means: use F.linear
        return False


# The attention's key count is a multiple of this (see NativeLlama.forward); caches round their length up
# to it so that the last positions keep the property.
KEY_BLOCK = 16


# A prompt's prefill of at least this many rows multiplies them in calls of their own (NativeLlama._prompt_calls).
WHOLE_PROMPT_ROWS = 64


def whole_key_blocks(n: int) -> int:
    """n rounded up to a multiple of KEY_BLOCK."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


@functools.lru_cache(maxsize=256)
def ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """[n, n] bool: row i is True at i and at every ancestor of i (parents[i] < i; -1 = the cached prefix)."""
    rows: list[list[bool]] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come first")
        row = list(rows[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


class _Layer:
    __slots__ = ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gate_up_w", "gate_up_b", "down_w", "down_b",
                 "qkv_p", "o_p", "gate_up_p", "down_p")  # *_p: the plain weights, for few-row steps (small_rows)


class NativeLlama:
    """Weights plus a forward over a SlotKVCache. Not an nn.Module: plain tensors, inference only."""

    def __init__(self, spec: LlamaSpec, state: dict[str, torch.Tensor], config=None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                 linear: str = "auto", small_rows: int | None = None, exact_rows: bool = True,
                 attention: str = "auto", fused_step: bool = True, greedy_head: bool = True):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        # linear: "auto" (CoSine's kernel where it runs and pays, see below; else oneDNN's prepacked weights on
        # CPU where they work: about 2x faster small-batch fp32 GEMMs than F.linear on an AMD EPYC), "kernel"
        # (CoSine's kernel, required), "mkldnn" (oneDNN, never the kernel) or "torch" (F.linear).
        if linear not in ("auto", "kernel", "mkldnn", "torch"):
            raise ValueError(f"linear must be auto, kernel, mkldnn or torch, got {linear!r}")
        self.packed = linear != "torch" and _mkldnn_linear_works(self.device, dtype)
        if linear == "mkldnn" and not self.packed:
            raise RuntimeError("oneDNN prepacked linear layers are not available here")
        # kernel: every matmul is CoSine's kernel (`kernels`: fp32 on AVX-512, bf16 on AVX512-BF16) on weights
        # packed for it. Row-invariant by construction, and on an AMD EPYC faster than oneDNN at 1-300 rows
        # (tools/measure_kernel_vs_onednn.py, the target's layers, 2 threads: fp32 1 row 9.9 against 10.8 ms,
        # 64 rows 36.6 against 42.9). "auto" takes it in fp32 wherever it runs, and in bf16 where oneDNN's bf16
        # matmuls are not row-invariant (row_chunk below is 0; on an Intel Xeon with AMX they were, and use AMX
        # tiles, which the kernel does not).
        kernel_shapes = [(spec.hidden_size, spec.vocab_size), (spec.hidden_size, spec.hidden_size),  # (in, out)
                         (spec.hidden_size, (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim),
                         (spec.hidden_size, 2 * spec.intermediate_size), (spec.intermediate_size, spec.hidden_size)]
        may_kernel = (linear in ("auto", "kernel") and kernels.available(self.device, dtype)
                      and all(n % 16 == 0 and (k % 2 == 0 or dtype == torch.float32) for k, n in kernel_shapes))
        if linear == "kernel" and not may_kernel:
            raise RuntimeError("CoSine's kernel is not available here (fp32 on a CPU with AVX-512 or bf16 with "
                               "AVX512-BF16, the kernels built, every weight's rows a multiple of 16, bf16 columns "
                               "even)")
        self.kernel = may_kernel and (dtype == torch.float32 or linear == "kernel")
        # attention: "auto" (CoSine's `attention_rows` for every step that is not a prompt's prefill, where it
        # runs: a row's bits depend on the keys it sees in their logical order alone, so a draft tree's node
        # gets what plain decoding gives it, and it is cheaper than SDPA at a step's shapes), "kernel"
        # (required) or "sdpa" (PyTorch's, never the kernel).
        if attention not in ("auto", "kernel", "sdpa"):
            raise ValueError(f"attention must be auto, kernel or sdpa, got {attention!r}")
        may_attend = (attention != "sdpa" and kernels.available(self.device, dtype) and spec.head_dim % 16 == 0
                      and spec.head_dim <= 256 and spec.n_heads % spec.n_kv_heads == 0
                      and spec.n_heads // spec.n_kv_heads <= 16)
        if attention == "kernel" and not may_attend:
            raise RuntimeError("CoSine's attention kernel is not available here (fp32 on a CPU with AVX-512 or bf16 "
                               "with AVX512-BF16, the kernels built, head_dim a multiple of 16 up to 256, at most "
                               "16 query heads per kv head)")
        self.attention_kernel = may_attend
        if self.kernel:
            self.packed = False
        # bf16 under "auto": oneDNN's packing now, the kernel's after the check below if it fails
        defer_kernel = may_kernel and not self.kernel
        unpacked: dict[str, torch.Tensor] = {}  # the weights as loaded, while the kernel may still take them
        # small_rows: steps of at most this many rows multiply the layers' plain weights with F.linear
        # (MKL's GEMV) instead of the prepacked ones. None: measured at load where it can pay (fp32 with
        # prepacked weights under "auto"; on an Intel Xeon with AMX, one row: 16 ms against 25 for the
        # target's layers, 2 threads, while oneDNN wins from 4 rows up); 0: never. The plain weights are
        # kept only when used: the layers' fp32 weights twice.
        keep_plain = self.packed and (small_rows is None and linear == "auto" and dtype == torch.float32
                                      or bool(small_rows))
        self.small_rows = 0
        self.max_positions = int(max_positions or spec.max_position_embeddings)
        s = spec
        if spec.hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act {spec.hidden_act!r}")

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in state else None

        prefix = "model." if "model.embed_tokens.weight" in state else ""
        self.embed = w(f"{prefix}embed_tokens.weight")
        self.norm = w(f"{prefix}norm.weight")
        head = w("lm_head.weight") if ("lm_head.weight" in state and not spec.tie_word_embeddings) else self.embed
        self.lm_head = self._pack(head)
        if defer_kernel:
            unpacked["head"] = head
        # the head's plain weight for few-row steps (head_small_rows, measured apart from the layers': one
        # fp32 row through the target's head, 2 threads: 2.7 ms against 3.6 prepacked); tied: the embedding
        self.head_plain = head if keep_plain else None
        self.head_small_rows = 0
        self.layers: list[_Layer] = []
        for i in range(s.n_layers):
            p = f"{prefix}layers.{i}."
            L = _Layer()
            L.ln1 = w(p + "input_layernorm.weight")
            L.ln2 = w(p + "post_attention_layernorm.weight")
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
            L.qkv_w = self._pack(qkv)
            biases = [opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            if any(b is not None for b in biases):
                sizes = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim)
                biases = [b if b is not None else torch.zeros(n, device=self.device, dtype=dtype) for b, n in zip(biases, sizes)]
                L.qkv_b = torch.cat(biases).contiguous()
            else:
                L.qkv_b = None
            o = w(p + "self_attn.o_proj.weight")
            L.o_w = self._pack(o)
            L.o_b = opt(p + "self_attn.o_proj.bias")
            # gate and up as one matmul: measured 5-12% faster here than two with SiLU and the product as
            # oneDNN post-ops (30 layers, M = 1 and 17, fp32 and bf16)
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]).contiguous()
            L.gate_up_w = self._pack(gate_up)
            gb, ub = opt(p + "mlp.gate_proj.bias"), opt(p + "mlp.up_proj.bias")
            L.gate_up_b = torch.cat([gb, ub]).contiguous() if gb is not None else None
            down = w(p + "mlp.down_proj.weight")
            L.down_w = self._pack(down)
            L.down_b = opt(p + "mlp.down_proj.bias")
            L.qkv_p, L.o_p, L.gate_up_p, L.down_p = (qkv, o, gate_up, down) if keep_plain else (None,) * 4
            if defer_kernel:
                unpacked.update({f"{i}.qkv": qkv, f"{i}.o": o, f"{i}.gate_up": gate_up, f"{i}.down": down})
            self.layers.append(L)

        inv_freq, scaling = rope_inv_freq(config, spec, self.max_positions)
        pos = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = spec.head_dim // 2
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half(x)*sin == roll(x)*sin_signed
        self.cos = cos.to(device=self.device, dtype=dtype)
        self.sin = sin_signed.to(device=self.device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        # SDPA backends to allow (None: PyTorch's choice). On a busy CPU the fused flash kernel's
        # thread pool can stall on tiny problems; [SDPBackend.MATH] is the decomposed path.
        self.sdpa_backends = None
        # row_chunk: in bf16/fp16 on prepacked weights, every matmul takes at most this many rows per call.
        # oneDNN's kernel for up to 32 rows gives each row the same bits whatever else is in the call; its
        # kernel for more rows does not, and bf16 rounding turns those last bits into different tokens
        # (speculative output departing from plain decoding). Checked at load on this CPU's kernels; 0
        # where no size passes (then bf16 here is not row-invariant) and in fp32, which does not need it.
        # exact_rows=False: nothing needs a row's bits independent of its company (a drafter's forwards:
        # whatever it drafts is verified), so matmuls take every row in one call and attention is shared.
        self.row_chunk = 0
        if exact_rows and self.packed and dtype in (torch.bfloat16, torch.float16):
            self.row_chunk = self._find_row_chunk(warn=not defer_kernel)
        if defer_kernel and not self.row_chunk:
            self.kernel, self.packed = True, False
            self.lm_head = self._pack(unpacked["head"])
            for i, L in enumerate(self.layers):
                L.qkv_w, L.o_w = self._pack(unpacked[f"{i}.qkv"]), self._pack(unpacked[f"{i}.o"])
                L.gate_up_w, L.down_w = self._pack(unpacked[f"{i}.gate_up"]), self._pack(unpacked[f"{i}.down"])
        unpacked.clear()
        if self.kernel and self.device.type == "cpu":  # the kernel's packed weights on huge pages (`hugepages`)
            self._huge_pages()
        # greedy_head: rows that need only their greedy token take it from a bf16 screen of the fp32 head and the
        # few close candidates exact (`GreedyHead`: bitwise the full head's argmax, half its bytes; one decode
        # row's head 2.5 against 1.5 ms here). fp32 on CoSine's kernels, where the CPU also runs the bf16 one;
        # COSINE_GREEDY_HEAD=0 turns it off (every row's full logits, as before).
        greedy_head = greedy_head and os.environ.get("COSINE_GREEDY_HEAD", "1") != "0"
        self.greedy_head = (GreedyHead(self.lm_head) if greedy_head and self.kernel and dtype == torch.float32
                            and GreedyHead.supported(self.device) else None)
        # exact: a row's bits must not depend on the rows that share its step, and here they do not (matmuls in
        # row_chunk calls, or CoSine's kernel): each new token then attends as its own problem. bf16/fp16 only:
        # fp32 rounds the last bits of a different order into a different token too rarely to pay for it
        # (measured lossless against transformers; see row_invariant).
        self.exact = dtype != torch.float32 and (self.row_chunk > 0 or (self.kernel and exact_rows))
        # fused_step: a step that the attention kernel serves, on the matmul kernel, runs every layer in one C++
        # call (`decoder_step`: norms, RoPE, cache writes and SwiGLU as loops over each row's own elements,
        # instead of ~40 TorchScript ops a layer). A row's numbers still depend on that row alone.
        self.fused_step = (fused_step and self.attention_kernel and self.kernel and spec.hidden_size % 16 == 0
                           and spec.intermediate_size % 16 == 0)
        if keep_plain:
            for kind in ("qkv_p", "o_p", "gate_up_p", "down_p"):
                if self._column_major_faster([getattr(L, kind) for L in self.layers]):
                    for L in self.layers:
                        setattr(L, kind, getattr(L, kind).t().contiguous().t())
            pairs = [(w_, p_) for L in self.layers for w_, p_ in ((L.qkv_w, L.qkv_p), (L.o_w, L.o_p),
                                                                  (L.gate_up_w, L.gate_up_p), (L.down_w, L.down_p))]
            self.small_rows = int(small_rows) if small_rows is not None else self._measure_small_rows(pairs)
            self.head_small_rows = (int(small_rows) if small_rows is not None
                                    else self._measure_small_rows([(self.lm_head, self.head_plain)]))
            if not self.small_rows:
                for L in self.layers:
                    L.qkv_p = L.o_p = L.gate_up_p = L.down_p = None
            if not self.head_small_rows:
                self.head_plain = None
        self._weights = self._weight_lists()
        # TorchScript on CPU (the same ops and bits without Python between them); plain Python elsewhere
        self._decoder = layers.scripted_decoder_layers if self.device.type == "cpu" else layers.decoder_layers

    @property
    def row_invariant(self) -> bool:
        """Does a row get the same logits whatever rows share its step? (fp32: to its last bits only
        nearly; measured lossless against transformers. bf16/fp16: exactly, where row_chunk > 0 or on CoSine's
        kernel.)"""
        return self.dtype == torch.float32 or self.exact

    @torch.inference_mode()
    def _find_row_chunk(self, sizes: tuple[int, ...] = (32, 16, 8), warn: bool = True) -> int:
        """The largest row count per matmul call for which each row of a call equals that row alone, on
        this model's weight shapes (random inputs; every call size up to the candidate, at two offsets)."""
        gen = torch.Generator().manual_seed(0)
        layer = self.layers[0]
        shapes = [(layer.qkv_w, self.spec.hidden_size), (layer.down_w, self.spec.intermediate_size),
                  (self.lm_head, self.spec.hidden_size)]

        def invariant(weight: torch.Tensor, k: int, size: int) -> bool:
            x = torch.randn(2 * size, k, generator=gen).to(device=self.device, dtype=self.dtype)
            alone = torch.cat([self._lin_call(x[i:i + 1], weight, None) for i in range(2 * size)])
            return all(torch.equal(self._lin_call(x[off:off + m], weight, None), alone[off:off + m])
                       for m in range(2, size + 1) for off in (0, size))

        for size in sizes:
            if all(invariant(weight, k, size) for weight, k in shapes):
                return size
        if warn:
            log.warning("%s matmuls are not row-invariant on this CPU: speculative output may depart from plain "
                        "decoding in this dtype", self.dtype)
        return 0

    @staticmethod
    def _best_times(variants, rounds: int) -> list[float]:
        """Each variant's fastest wall time over `rounds`, run interleaved round by round (noise falls on all alike)."""
        times = [float("inf")] * len(variants)
        with torch.inference_mode():
            for _ in range(rounds):
                for i, run in enumerate(variants):
                    started = time.perf_counter()
                    run()
                    times[i] = min(times[i], time.perf_counter() - started)
        return times

    def _column_major_faster(self, weights: list[torch.Tensor], rounds: int = 7) -> bool:
        """Does one row through these plain weights (F.linear, MKL) run faster with each weight stored column-
        major (the same [out, in] tensor, transposed in memory)? On an Intel Xeon with AMX, 2 threads, fp32:
        about 10% for the target's gate/up, not for down."""
        x = torch.zeros(1, weights[0].shape[1], dtype=self.dtype, device=self.device)
        other = [w.t().contiguous().t() for w in weights]
        row, column = self._best_times([lambda: [F.linear(x, w) for w in weights],
                                        lambda: [F.linear(x, w) for w in other]], rounds)
        return column < 0.97 * row

    def _measure_small_rows(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: tuple[int, ...] = (1, 2),
                            rounds: int = 5, margin: float = 0.9) -> int:
        """The most rows (of `rows`, in order) at which the matmuls of `pairs` (prepacked weight, the same
        plain) take under `margin` of the prepacked time with F.linear on the plain weights; 0 when none."""
        best = 0
        for m in rows:
            x = {k: torch.zeros(m, k, dtype=self.dtype, device=self.device) for k in {p.shape[1] for _, p in pairs}}
            plain, packed = self._best_times([lambda: [F.linear(x[p.shape[1]], p) for _, p in pairs],
                                              lambda: [layers.linear_call(x[p.shape[1]], w, None, True) for w, p in pairs]],
                                             rounds)
            if plain >= margin * packed:
                break
            best = m
        return best

    # -- loading ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto",
                        max_positions: int | None = None, linear: str = "auto",
                        small_rows: int | None = None, exact_rows: bool = True,
                        attention: str = "auto", fused_step: bool = True,
                        greedy_head: bool = True) -> "NativeLlama":
        from transformers import AutoConfig

        path = Path(path)
        config = AutoConfig.from_pretrained(str(path))
        if getattr(config, "model_type", "") not in LLAMA_FAMILY:
            raise NotImplementedError(f"model_type {config.model_type!r} is not a Llama-family decoder")
        if isinstance(dtype, str):
            from cosine.engine.models import resolve_dtype

            dtype = resolve_dtype(dtype, device)
        spec = spec_from_config(config)
        return cls(spec, _load_state_dict(path), config, device=device, dtype=dtype, max_positions=max_positions,
                   linear=linear, small_rows=small_rows, exact_rows=exact_rows, attention=attention,
                   fused_step=fused_step, greedy_head=greedy_head)

    @staticmethod
    def supports(path: str | Path) -> bool:
        try:
            cfg = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return cfg.get("model_type") in LLAMA_FAMILY

    def new_cache(self, n_slots: int, max_len: int | None = None) -> SlotKVCache:
        s = self.spec
        max_len = whole_key_blocks(int(max_len or self.max_positions))
        return SlotKVCache(s.n_layers, n_slots, s.n_kv_heads, max_len, s.head_dim,
                           dtype=self.dtype, device=self.device)

    # -- the forward --------------------------------------------------------------------

    def _huge_pages(self) -> None:
        """Move the layers' and the head's packed weights into one huge-page mapping (`on_huge_pages`)."""
        names = ("qkv_w", "o_w", "gate_up_w", "down_w")
        moved = on_huge_pages([getattr(L, n) for L in self.layers for n in names] + [self.lm_head])
        self.lm_head = moved.pop()
        for i, L in enumerate(self.layers):
            for j, n in enumerate(names):
                setattr(L, n, moved[i * len(names) + j])

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return torch.ops.cosine.pack_weight(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight, 16) if self.packed else weight

    def _lin(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """linear(x) as the layers do it (the lm head's; chunked where rows must stay row-invariant)."""
        return layers.linear(x, weight, bias, None, 0, self.packed, self.row_chunk, None, self.kernel)

    def _lin_call(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layers.linear_call(x, weight, bias, self.packed, self.kernel)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return layers.rms(x, weight, self.spec.rms_norm_eps)

    def _weight_lists(self) -> tuple:
        """The layers' weights as the lists `layers.decoder_layers` takes (ln1, ln2, then q/k/v, o, gate/up,
        down each as weights, biases, plain weights)."""
        Ls = self.layers
        return ([L.ln1 for L in Ls], [L.ln2 for L in Ls],
                [L.qkv_w for L in Ls], [L.qkv_b for L in Ls], [L.qkv_p for L in Ls],
                [L.o_w for L in Ls], [L.o_b for L in Ls], [L.o_p for L in Ls],
                [L.gate_up_w for L in Ls], [L.gate_up_b for L in Ls], [L.gate_up_p for L in Ls],
                [L.down_w for L in Ls], [L.down_b for L in Ls], [L.down_p for L in Ls])

    @torch.inference_mode()
    def forward(self, batch: list[Seq], cache: SlotKVCache, hidden: bool | str = False) -> list:
        """One pass over the batch; returns per Seq its logits [n_rows, vocab] (float32) or None. With ``hidden``,
        per Seq (logits, the same rows' final hidden states [n_rows, hidden_size], normed as the head reads them)
        or None; with ``hidden="only"`` the hidden states alone."""
        s = self.spec
        dev = self.device
        nh, nkv, hd = s.n_heads, s.n_kv_heads, s.head_dim
        nrep = nh // nkv
        B = len(batch)
        if B == 0:
            return []
        # CoSine's attention kernel for every pass but a prefill of prompts (there SDPA's blocked attention
        # over many rows is cheaper, and a prompt's rows need only depend on the prompt): each row over the keys
        # it sees, in logical order, read where they are stored; nothing past them is read.
        use_rows = self.attention_kernel and not all(q.prompt and q.parents is None for q in batch)
        order = list(range(B)) if use_rows else sorted(range(B), key=lambda i: batch[i].slot)
        if order != list(range(B)):  # SDPA: slot order lets the attention view the cache in place
            out = self.forward([batch[i] for i in order], cache, hidden)
            result: list = [None] * B
            for j, i in enumerate(order):
                result[i] = out[j]
            return result
        lengths = [len(q.tokens) for q in batch]
        if min(lengths) < 1:
            raise ValueError("every Seq needs at least one new token")
        starts = [cache.lengths[q.slot] for q in batch]
        T = max(lengths)
        # Keys the attention reads: up to the longest row, rounded up to a multiple of KEY_BLOCK (masked
        # keys past a row's own are exact zeros in its softmax). With the count of keys on a block
        # boundary, a row's attention is bitwise the same whichever rows share its step (a one-token step,
        # a draft tree, other requests): SDPA's reductions over keys then never end in a tail whose
        # order depends on the length. Without it, bf16 speculative output departed from plain decoding.
        L = min(whole_key_blocks(max(st + n for st, n in zip(starts, lengths))), cache.max_len)
        slots = [q.slot for q in batch]
        if len(set(slots)) != B:
            raise ValueError("a slot appears twice in one batch")
        if not use_rows:
            for q in batch:
                cache.expose(q.slot, L)

        # Attention rows: a contiguous range of slots, viewed in place (no gather of the cache).
        lo, hi = min(slots), max(slots)
        span = hi - lo + 1
        use_view = span <= 2 * B + 2
        if use_view:
            rows = [sl - lo for sl in slots]
            R = span
        else:
            rows = list(range(B))
            R = B
        slot_index = None if use_view or use_rows else torch.tensor(slots, device=dev)

        flat_tok: list[int] = []
        flat_pos: list[int] = []
        flat_slot: list[int] = []
        flat_store: list[int] = []
        flat_row: list[int] = []  # index into [R*T] padded attention layout
        for q, st, n, r in zip(batch, starts, lengths, rows):
            if len(q.positions) != n:
                raise ValueError("positions and tokens differ in length")
            flat_tok.extend(q.tokens)
            flat_pos.extend(q.positions)
            flat_slot.extend([q.slot] * n)
            flat_store.extend(range(st, st + n))
            flat_row.extend(range(r * T, r * T + n))
        N = len(flat_tok)
        if max(flat_pos) >= self.max_positions:
            raise ValueError(f"position {max(flat_pos)} beyond the model's {self.max_positions}")
        tok_t = torch.tensor(flat_tok, device=dev)
        pos_t = torch.tensor(flat_pos, device=dev)
        slot_t = torch.tensor(flat_slot, device=dev)
        store_t = torch.tensor(flat_store, device=dev)
        dense = use_view and R == B and N == R * T and rows == list(range(B))
        row_t = None if dense or use_rows else torch.tensor(flat_row, device=dev)  # SDPA's padded layout only

        row_keys = self._row_keys(batch, starts, lengths) if use_rows else None
        each = None
        calls = None
        per_row = False
        bias = None
        if row_keys is None:
            # Mask [R, 1, T, L]: keys < start are the cached prefix; new keys by causality or tree ancestry.
            starts_r = [0] * R
            for st, r in zip(starts, rows):
                starts_r[r] = st
            st_t = torch.tensor(starts_r, device=dev)
            key = torch.arange(L, device=dev)
            qpos = st_t[:, None] + torch.arange(T, device=dev)[None, :]  # storage index of each query row
            mask = key[None, None, :] <= qpos[:, :, None]  # causal, [R, T, L]
            for q, st, n, r in zip(batch, starts, lengths, rows):
                if q.parents is not None:
                    mask[r, :n, st:st + n] = ancestor_mask(tuple(q.parents)).to(dev)
            # Row-invariant attention (with row_chunk, a step of several rows per request): each new token is its
            # own attention problem over its request's keys (the rows as query heads of grouped-query attention:
            # no copy of the keys), exactly the shape of a one-token step, so SDPA computes the same numbers for it
            # whichever rows share the step. SDPA's kernel for several query rows of a request picks its blocking
            # and GEMM path from the shape, which changes a row's last bits.
            # A prefill of prompts only needs each request's rows to depend on that request alone, not to equal
            # decoding: one attention problem per request, shaped by its own rows and keys (`each`), is that,
            # and cheaper than a problem per row (16 real-target prompts, 770 tokens: 465 -> 348-396 ms in bf16).
            each = None
            if self.exact and T > 1 and all(q.prompt and q.parents is None for q in batch):
                each = []
                off = 0
                for q, st, n in zip(batch, starts, lengths):
                    Lq = min(whole_key_blocks(st + n), cache.max_len)
                    visible = key[None, :Lq] <= (st + torch.arange(n, device=dev))[:, None]  # [n, Lq], causal
                    b = torch.zeros((n, Lq), dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
                    each.append((off, n, q.slot, Lq, b[None].expand(nrep, n, Lq).reshape(1, 1, nrep * n, Lq)))
                    off += n
            calls = self._prompt_calls(lengths) if each is not None else None
            per_row = self.exact and T > 1 and each is None
            if each is not None:
                bias = None
            elif per_row:  # [R, nkv * T, 1, L]: query head (kv head, row) sees its row's keys
                bias = torch.zeros((R, T, L), dtype=self.dtype, device=dev).masked_fill_(~mask, float("-inf"))
                bias = bias[:, None, :, None, :].expand(R, nkv, T, 1, L).reshape(R, nkv * T, 1, L)
            else:
                mask = mask[:, None].expand(R, nrep, T, L).reshape(R, 1, nrep * T, L)
                bias = torch.zeros(mask.shape, dtype=self.dtype, device=dev).masked_fill_(~mask, float("-inf"))

        # Row of each new token's (kv head) in a layer's cache viewed as [slots * nkv * max_len, hd].
        kv_index = ((slot_t[:, None] * nkv + torch.arange(nkv, device=dev)[None, :]) * cache.max_len
                    + store_t[:, None]).reshape(-1)
        cos = self.cos[pos_t][:, None, :]  # [N, 1, hd]
        sin = self.sin[pos_t][:, None, :]

        x = self.embed[tok_t]  # [N, H]
        if row_keys is not None and self.fused_step:
            W = self._weights
            x = torch.ops.cosine.decoder_step(x, W[0], W[1], W[2], W[3], W[5], W[6], W[8], W[9], W[11], W[12],
                                              cache.k, cache.v, self.cos[pos_t], self.sin[pos_t], kv_index,
                                              *row_keys, nh, nkv, hd, s.intermediate_size, s.rms_norm_eps, self.scale)
            return self._finish(x, batch, cache, starts, lengths, N, hidden)
        args = (x, *self._weights, cache.k, cache.v, cos, sin, kv_index, bias, nh, nkv, hd, s.intermediate_size,
                s.rms_norm_eps, self.scale, self.small_rows, self.packed, self.row_chunk, self.kernel, R, T, dense,
                row_t, use_view,
                lo, hi, L, slot_index, per_row, each, calls, row_keys)
        if self.sdpa_backends is not None:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(self.sdpa_backends):
                x = self._decoder(*args)
        else:
            x = self._decoder(*args)
        return self._finish(x, batch, cache, starts, lengths, N, hidden)

    def _row_keys(self, batch: list[Seq], starts: list[int], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        """The keys each new row sees, for `attention_rows`: (slot, prefix, offsets, index). A row sees the
        first `prefix` positions of its slot's cache, then the positions index[offsets[n]:offsets[n + 1]], in
        that order: a causal row the committed tokens and the step's rows up to itself (all a prefix); a tree
        node the committed tokens, then its ancestors root first, then itself, wherever they are stored: the
        sequence plain decoding of the same tokens attends over."""
        slot_l: list[int] = []
        prefix_l: list[int] = []
        offsets_l = [0]
        index_l: list[int] = []
        for q, st, n in zip(batch, starts, lengths):
            slot_l.extend([q.slot] * n)
            if q.parents is None:
                prefix_l.extend(range(st + 1, st + n + 1))
                offsets_l.extend([offsets_l[-1]] * n)
                continue
            paths: list[list[int]] = []
            for i, par in enumerate(q.parents):
                if not -1 <= par < i:
                    raise ValueError(f"node {i} has parent {par}: parents must come first")
                path = (paths[par] if par >= 0 else []) + [st + i]
                paths.append(path)
                prefix_l.append(st)
                index_l.extend(path)
                offsets_l.append(len(index_l))
        dev = self.device
        return (torch.tensor(slot_l, device=dev), torch.tensor(prefix_l, device=dev),
                torch.tensor(offsets_l, device=dev), torch.tensor(index_l, dtype=torch.long, device=dev))

    @staticmethod
    def _prompt_calls(lengths: list[int]) -> list[tuple[int, int, bool]] | None:
        """How a prefill of prompts multiplies its rows: a request of at least WHOLE_PROMPT_ROWS rows in one
        call of its own (its bits then depend on it alone, and one call costs less than its 32-row chunks:
        real target, bf16, 128 rows 23 against 41 ms), the shorter ones' rows together in calls of row_chunk
        (row-invariant). None: all in row_chunk calls."""
        calls, lo, off = [], 0, 0
        for n in lengths:
            if n >= WHOLE_PROMPT_ROWS:
                if off > lo:
                    calls.append((lo, off, False))
                calls.append((off, off + n, True))
                lo = off + n
            off += n
        if off > lo:
            calls.append((lo, off, False))
        return calls if any(whole for *_, whole in calls) else None

    def _finish(self, x, batch, cache, starts, lengths, N, hidden: bool | str = False):
        dev = self.device
        B = len(batch)
        for q, st, n in zip(batch, starts, lengths):
            cache.set_length(q.slot, st + n)

        # Logits only for the rows that need them.
        want: list[int] = []
        spans: list[tuple[int, int] | None] = []
        off = 0
        for q, n in zip(batch, lengths):
            if q.logits in ("all", "greedy"):
                spans.append((len(want), n))
                want.extend(range(off, off + n))
            elif q.logits == "last":
                spans.append((len(want), 1))
                want.append(off + n - 1)
            else:
                spans.append(None)
            off += n
        if not want:
            return [None] * B
        hx = x if len(want) == N else x[torch.tensor(want, device=dev)]
        h = self._rms(hx, self.norm)
        if hidden == "only":  # the features alone (a drafter's training data): no head
            return [None if sp is None else h[sp[0]: sp[0] + sp[1]] for sp in spans]
        greedy = [q.logits == "greedy" for q in batch]
        rows = {True: [], False: []}  # the rows of h each kind reads, greedy (True) or logits
        for sp, g in zip(spans, greedy):
            if sp is not None:
                rows[g].extend(range(sp[0], sp[0] + sp[1]))
        h_of = {g: h if len(r) == len(want) else h[torch.tensor(r, device=dev)] for g, r in rows.items() if r}
        logits = self._logits(h_of[False]) if False in h_of else None
        tokens = None
        if True in h_of:
            if self.greedy_head is not None:
                tokens = self.greedy_head.tokens(h_of[True], self._logits)
            else:
                tokens = torch.tensor(greedy_tokens(self._logits(h_of[True])), dtype=torch.long, device=dev)
        result: list = []
        at = {True: 0, False: 0}
        for sp, g in zip(spans, greedy):
            if sp is None:
                result.append(None)
                continue
            part = (tokens if g else logits)[at[g]: at[g] + sp[1]]
            at[g] += sp[1]
            result.append((part, h[sp[0]: sp[0] + sp[1]]) if hidden else part)
        return result

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's fp32 logits [R, vocab] of final hidden states h [R, hidden] (normed)."""
        if self.head_plain is not None and h.shape[0] <= self.head_small_rows:
            return F.linear(h, self.head_plain).float()
        return self._lin(h, self.lm_head, None).float()
