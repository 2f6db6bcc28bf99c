"""The decoder layers' arithmetic, written once, run by TorchScript on CPU (pure functions over tensors).

`NativeLlama.forward` prepares a pass (positions, masks, where each new row's keys go) and hands the
30-odd layers to `decoder_layers`. A layer is some 40 small tensor ops around four matmuls and the
attention; at one row each small op costs a few microseconds of Python and dispatch, about a third of
a decode step of the 135M target on 2 cores. TorchScript runs the same ops, the same ATen kernels and
so the same bits, without the Python interpreter between them: decode b1 23.3 -> 19.7 ms in bf16 and
28.6 -> 26.4 ms in fp32 (Intel Xeon with AMX, 2 threads). It neither fuses nor reorders anything on a
CPU (no CPU fuser is enabled), which `tests/unit/engine/test_layers.py` checks bit for bit against the
same functions run as plain Python. On other devices the functions run as plain Python (a GPU fuser
could change the arithmetic), and wherever TorchScript cannot compile them.

Where CoSine's matmul and attention kernels both run, decode and verify steps do not come here: one C++ call
(`decoder_step`, `csrc/decoder_step.cpp`) runs all their layers; prompts' prefills, and every step elsewhere, do.

Everything here is TorchScript-compatible Python: module-level functions, typed arguments, no closures.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from cosine.engine import kernels

log = logging.getLogger(__name__)

# oneDNN's unary linear takes a list of post-op scalars (none here), typed as TorchScript wants it
_Scalars = List[Optional[Union[int, float, complex]]]


def linear_call(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: bool,
                kernel: bool = False) -> torch.Tensor:
    """One matmul call: CoSine's kernel (`kernels`, on its packed weight), oneDNN's prepacked linear, or
    F.linear."""
    if kernel:
        return torch.ops.cosine.packed_linear(x, weight, bias, None)
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none",
                                                  torch.jit.annotate(_Scalars, []), "")
    return F.linear(x, weight, bias)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: bool,
                chunk: int, kernel: bool = False) -> torch.Tensor:
    """linear(x) in calls of at most `chunk` rows (0: all in one)."""
    if chunk > 0 and x.shape[0] > chunk:
        return torch.cat([linear_call(x[i:i + chunk], weight, bias, packed, kernel)
                          for i in range(0, x.shape[0], chunk)])
    return linear_call(x, weight, bias, packed, kernel)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plain: Optional[torch.Tensor],
           small_rows: int, packed: bool, chunk: int,
           calls: Optional[List[Tuple[int, int, bool]]] = None, kernel: bool = False) -> torch.Tensor:
    """linear(x); `plain`: the weight unpacked, used for a step of at most small_rows rows; `chunk`: at most
    this many rows per call (0: all in one); `calls`: row ranges (lo, hi, whole) in order, a whole one
    multiplied in one call, the others in chunks (a prefill's, see NativeLlama._prompt_calls); `kernel`:
    `weight` is packed for CoSine's kernel, which multiplies every call."""
    if calls is not None:
        return torch.cat([linear_rows(x[lo:hi], weight, bias, packed, 0 if whole else chunk, kernel)
                          for lo, hi, whole in calls])
    if plain is not None and x.shape[0] <= small_rows:
        return F.linear(x, plain, bias)
    return linear_rows(x, weight, bias, packed, chunk, kernel)


def linear_add_call(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                    packed: bool, kernel: bool = False) -> torch.Tensor:
    """residual + linear(x) in one matmul call: on the prepacked path the add is a oneDNN post-op inside the
    matmul (fp32: the same numbers, o and down ~10% faster at one row; bf16: one rounding instead of two), in
    CoSine's kernel its epilogue (bf16: one rounding)."""
    if kernel:
        return torch.ops.cosine.packed_linear(x, weight, bias, residual)
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), residual, weight, bias, "add")
    return residual + F.linear(x, weight, bias)


def linear_add_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                    packed: bool, chunk: int, kernel: bool = False) -> torch.Tensor:
    if chunk > 0 and x.shape[0] > chunk:
        return torch.cat([linear_add_call(x[i:i + chunk], weight, bias, residual[i:i + chunk], packed, kernel)
                          for i in range(0, x.shape[0], chunk)])
    return linear_add_call(x, weight, bias, residual, packed, kernel)


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
               plain: Optional[torch.Tensor], small_rows: int, packed: bool, chunk: int,
               calls: Optional[List[Tuple[int, int, bool]]] = None, kernel: bool = False) -> torch.Tensor:
    """residual + linear(x), with `plain`, `small_rows`, `chunk`, `calls` and `kernel` as in `linear`."""
    if calls is not None:
        return torch.cat([linear_add_rows(x[lo:hi], weight, bias, residual[lo:hi], packed, 0 if whole else chunk,
                                          kernel) for lo, hi, whole in calls])
    if plain is not None and x.shape[0] <= small_rows:
        return residual + F.linear(x, plain, bias)
    return linear_add_rows(x, weight, bias, residual, packed, chunk, kernel)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' arithmetic (in float32), in place where it is safe."""
    low = x.dtype != torch.float32
    xf = x.float() if low else x
    var = torch.mean(xf * xf, -1, keepdim=True)
    var.add_(eps).rsqrt_()
    out = xf * var
    if low:
        out = out.to(x.dtype)
    if out.dtype == weight.dtype:
        return out.mul_(weight)
    return weight * out


def attend(qh: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, bias: Optional[torch.Tensor], nh: int, nkv: int,
           hd: int, R: int, T: int, dense: bool, row_t: Optional[torch.Tensor], use_view: bool, lo: int, hi: int,
           L: int, slot_index: Optional[torch.Tensor], per_row: bool, scale: float) -> torch.Tensor:
    """Attention of every new row at once: [R, nkv, nrep * T, hd] queries over each request's keys; per_row:
    [R, nkv * T, nrep, hd], each row of each kv head a query head of its own (see NativeLlama.forward)."""
    nrep = nh // nkv
    qsz = nh * hd
    if dense or row_t is None:
        qp = qh.reshape(R, T, nh, hd)
    else:
        qp = qh.new_zeros(R * T, nh, hd)
        qp[row_t] = qh
        qp = qp.view(R, T, nh, hd)
    if use_view or slot_index is None:
        kk = kl[lo:hi + 1, :, :L]
        vv = vl[lo:hi + 1, :, :L]
    else:
        kk = kl[:, :, :L].index_select(0, slot_index)
        vv = vl[:, :, :L].index_select(0, slot_index)
    if per_row:
        qp = qp.view(R, T, nkv, nrep, hd).permute(0, 2, 1, 3, 4).reshape(R, nkv * T, nrep, hd)
        o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=bias, scale=scale, enable_gqa=True)
        o = o.view(R, nkv, T, nrep, hd).permute(0, 2, 1, 3, 4).reshape(R * T, qsz)
    else:
        qp = qp.view(R, T, nkv, nrep, hd).permute(0, 2, 3, 1, 4).reshape(R, nkv, nrep * T, hd)
        o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=bias, scale=scale)  # [R, nkv, nrep*T, hd]
        o = o.view(R, nkv, nrep, T, hd).permute(0, 3, 1, 2, 4).reshape(R * T, qsz)
    if not dense and row_t is not None:
        o = o[row_t]
    return o


def attend_each(qh: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, each: List[Tuple[int, int, int, int, torch.Tensor]],
                nh: int, nkv: int, hd: int, scale: float) -> torch.Tensor:
    """Attention of a prefill, one problem per request over its own keys only: [1, nkv, nrep * n, hd]."""
    nrep = nh // nkv
    qsz = nh * hd
    outs: List[torch.Tensor] = []
    for off, n, slot, Lq, bias in each:
        q = qh[off:off + n].view(n, nkv, nrep, hd).permute(1, 2, 0, 3).reshape(1, nkv, nrep * n, hd)
        o = F.scaled_dot_product_attention(q, kl[slot:slot + 1, :, :Lq], vl[slot:slot + 1, :, :Lq], attn_mask=bias,
                                           scale=scale)
        outs.append(o.view(nkv, nrep, n, hd).permute(2, 0, 1, 3).reshape(n, qsz))
    return torch.cat(outs)


def decoder_layers(
    x: torch.Tensor,
    ln1: List[torch.Tensor], ln2: List[torch.Tensor],
    qkv_w: List[torch.Tensor], qkv_b: List[Optional[torch.Tensor]], qkv_p: List[Optional[torch.Tensor]],
    o_w: List[torch.Tensor], o_b: List[Optional[torch.Tensor]], o_p: List[Optional[torch.Tensor]],
    gate_up_w: List[torch.Tensor], gate_up_b: List[Optional[torch.Tensor]], gate_up_p: List[Optional[torch.Tensor]],
    down_w: List[torch.Tensor], down_b: List[Optional[torch.Tensor]], down_p: List[Optional[torch.Tensor]],
    cache_k: torch.Tensor, cache_v: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_index: torch.Tensor, bias: Optional[torch.Tensor],
    nh: int, nkv: int, hd: int, intermediate: int, eps: float, scale: float,
    small_rows: int, packed: bool, chunk: int, kernel: bool,
    R: int, T: int, dense: bool, row_t: Optional[torch.Tensor], use_view: bool, lo: int, hi: int, L: int,
    slot_index: Optional[torch.Tensor], per_row: bool,
    each: Optional[List[Tuple[int, int, int, int, torch.Tensor]]],
    calls: Optional[List[Tuple[int, int, bool]]],
    row_keys: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Every decoder layer over the pass's N new rows x [N, H]; writes each row's K/V at kv_index of the
    cache [layers, slots, nkv, max_len, hd] viewed per layer as [slots * nkv * max_len, hd]."""
    N = x.shape[0]
    qsz = nh * hd
    kvsz = nkv * hd
    half = hd // 2
    for li in range(len(ln1)):
        h = rms(x, ln1[li], eps)
        # [N, (nh + 2 nkv) hd]
        qkv = linear(h, qkv_w[li], qkv_b[li], qkv_p[li], small_rows, packed, chunk, calls, kernel)
        qk = qkv[:, : qsz + kvsz].view(N, nh + nkv, hd)
        qk = torch.addcmul(qk * cos, torch.roll(qk, half, dims=[-1]), sin)
        k_new = qk[:, nh:]
        v_new = qkv[:, qsz + kvsz:].view(N, nkv, hd)
        kl, vl = cache_k[li], cache_v[li]  # [slots, nkv, max_len, hd], contiguous
        kl.view(-1, hd).index_copy_(0, kv_index, k_new.reshape(N * nkv, hd))
        vl.view(-1, hd).index_copy_(0, kv_index, v_new.reshape(N * nkv, hd))
        qh = qk[:, :nh]  # [N, nh, hd]
        if row_keys is not None:  # CoSine's kernel: each row over the keys it sees, in their logical order
            o = torch.ops.cosine.attention_rows(qh, kl, vl, row_keys[0], row_keys[1], row_keys[2], row_keys[3], scale)
        elif each is not None:
            o = attend_each(qh, kl, vl, each, nh, nkv, hd, scale)
        else:
            o = attend(qh, kl, vl, bias, nh, nkv, hd, R, T, dense, row_t, use_view, lo, hi, L, slot_index, per_row,
                       scale)
        x = linear_add(o, o_w[li], o_b[li], x, o_p[li], small_rows, packed, chunk, calls, kernel)
        h = rms(x, ln2[li], eps)
        gu = linear(h, gate_up_w[li], gate_up_b[li], gate_up_p[li], small_rows, packed, chunk, calls, kernel)
        g, u = gu.split(intermediate, dim=-1)
        a = F.silu(g) * u
        x = linear_add(a, down_w[li], down_b[li], x, down_p[li], small_rows, packed, chunk, calls, kernel)
    return x


def _script(fn):
    try:
        return torch.jit.script(fn)
    except Exception:  # noqa: BLE001 - TorchScript missing or refusing: the same function as Python
        log.warning("TorchScript could not compile %s: the decoder layers run as Python", fn.__name__, exc_info=True)
        return fn


kernels.load()  # the kernels' ops (or their schemas alone) exist before TorchScript compiles calls to them
scripted_decoder_layers = _script(decoder_layers)
