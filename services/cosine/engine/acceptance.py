"""Lossless acceptance of drafted chains, batched, as pure functions over tensors (DESIGN §3).

Two rules:
- point-mass proposals (fused drafts, trees): `cosine.engine.tree.walk` with the
  target's own choice at each node — exact whatever the proposals are;
- a chain sampled from a drafter whose distribution q is known: standard
  speculative rejection sampling — accept x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of
  norm(max(0, p_i - q_i)) and stop; if all are accepted emit a sample of p_k
  (the bonus token). The emitted tokens are distributed exactly as the target's.

Randomness comes in as explicit uniforms, so a caller can make them
reproducible (e.g. `sampling.uniform_at(seed, position)`), or from a generator.
"""

from __future__ import annotations

import torch


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows of [..., V] (unnormalised, non-negative) probabilities, uniforms [...] in [0, 1) → indices [...]."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[..., -1:]
    v = u.double().unsqueeze(-1) * total
    idx = torch.searchsorted(cdf, v, right=True).squeeze(-1)  # first index with cdf > v: never a zero-mass token
    V = probs.shape[-1]
    last_nz = V - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(idx, last_nz)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor | None = None,
    u_sample: torch.Tensor | None = None,
    draft_lens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched speculative rejection sampling.

    draft_tokens [B, k] (long), draft_probs q [B, k, V] (the drafter's distribution
    each token was sampled from), target_probs p [B, k + 1, V] (the target's
    processed distribution after the prefix and after each draft token),
    u_accept [B, k] and u_sample [B, k + 1] uniforms in [0, 1) (drawn from
    `generator` when omitted), draft_lens [B] for ragged chains (positions past
    a row's length are ignored; default k).

    Returns (tokens [B, k + 1] long: the accepted draft tokens then one token
    from the target, padded with -1; n_accepted [B] long). Row b emits
    n_accepted[b] + 1 tokens.
    """
    B, k = draft_tokens.shape
    dev = target_probs.device
    if target_probs.shape[:2] != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V]; got {tuple(target_probs.shape)} for k={k}")
    if u_accept is None:
        u_accept = torch.rand((B, k), generator=generator, dtype=torch.float64).to(dev)
    if u_sample is None:
        u_sample = torch.rand((B, k + 1), generator=generator, dtype=torch.float64).to(dev)
    lens = torch.full((B,), k, dtype=torch.long, device=dev) if draft_lens is None else draft_lens.to(dev).long()
    p = target_probs.double()
    q = draft_probs.double()
    if k:
        tok = draft_tokens.long().unsqueeze(-1)
        p_x = p[:, :k].gather(-1, tok).squeeze(-1)
        q_x = q.gather(-1, tok).squeeze(-1)
        accept = u_accept.double() * q_x < p_x  # u < p/q, i.e. with probability min(1, p/q)
        accept &= torch.arange(k, device=dev)[None, :] < lens[:, None]
        n_acc = torch.cumprod(accept.long(), dim=-1).sum(-1)
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    p_r = p[rows, n_acc]  # [B, V]
    rejected = n_acc < lens
    if k:
        q_r = q[rows, n_acc.clamp(max=k - 1)]
        residual = torch.clamp(p_r - q_r, min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection has probability 0 where p == q; guard the empty residual anyway.
        residual = torch.where(mass > 0, residual, p_r)
        final = torch.where(rejected[:, None], residual, p_r)
    else:
        final = p_r
    last = sample_inverse_cdf(final, u_sample.double()[rows, n_acc])
    out = torch.full((B, k + 1), -1, dtype=torch.long, device=dev)
    if k:
        keep = torch.arange(k, device=dev)[None, :] < n_acc[:, None]
        out[:, :k] = torch.where(keep, draft_tokens.long(), out[:, :k])
    out[rows, n_acc] = last
    return out, n_acc
