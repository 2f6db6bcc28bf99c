"""A drafter conditioned on the target's own features (EAGLE-style, without attention).

The target's final hidden state at a position (normed, as its head reads it) says most of what the target
will write next. The head takes that feature ``f[t]`` and the token ``x[t+1]`` the target chose from it, and
predicts the next feature ``f[t+1]``, and from it the token after: ``x[t+2]``. Fed its own predicted feature
and the token it chose, it goes on, so it drafts a chain; fed each of its likeliest tokens, a tree (`trees`:
every continuation whose path probability passes the verifier's cost floor, which at one or two requests a
step lets a second candidate in where the head is torn between two).

    x = fc(cat(embed[x[t+1]], f[t]))          one linear layer over the pair
    y = x + down(silu(gate(n)) * up(n))        n = rms(x): a SwiGLU block started from the target's last layer
    logits = rms(y) · embed[vocab]ᵀ            the target's own (frozen) embedding rows, over a reduced vocabulary

No attention, so no KV cache of its own: a draft needs only the last feature and token of each request, which
the verifier has after every step (`TargetEngine.hidden`). A draft step reads ~6 M weights (the reduced head
over 4096 tokens is most of it) against the target's 135 M: it runs on the verifier's model thread between
steps, with no round trip, like the lookup (`cosine.verifier.lookup`). The target verifies every drafted
token, so what the head proposes changes how many tokens a step commits, never which.

Trained by `cosine zoo head` (`cosine.zoo.head`) on the target's own greedy continuations, whose features
are the target's teacher-forced hidden states; three steps unrolled, so the deeper steps learn from the step
before's predicted feature as they will get it in serving. Its probabilities are then calibrated (one temperature
per draft step, fitted on held-out samples) so that the cost rule reads them as chances of acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cosine.engine.tree import DraftTree

CONFIG = "head.json"
WEIGHTS = "head.safetensors"


class FeatureHead(nn.Module):
    def __init__(self, embed: torch.Tensor, vocab_ids: torch.Tensor, intermediate_size: int, eps: float,
                 lm_head: torch.Tensor | None = None):
        """``embed``: the target's input embedding [vocab, hidden], ``lm_head`` its output head (default: tied to
        the embedding), both frozen. ``vocab_ids``: the tokens the head may propose (sorted, unique)."""
        super().__init__()
        hidden = embed.shape[1]
        self.eps = float(eps)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.ln = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, intermediate_size, bias=False)
        self.up = nn.Linear(hidden, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden, bias=False)
        self.lnf = nn.Parameter(torch.ones(hidden))
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=True)
        self.register_buffer("embed", embed.detach(), persistent=False)
        head = embed if lm_head is None else lm_head
        self.register_buffer("out", head.detach()[self.vocab_ids].clone(), persistent=False)
        self._ready: dict[str, torch.Tensor] | None = None  # `prepare`'s inference weights
        self._kernel = False
        # Per draft step, the temperature its logits are divided by before the softmax, so that the probability
        # of its best token is the chance the target accepts it (fitted on held-out positions by `cosine zoo
        # head`; the last one holds for deeper steps; empty: 1). Greedy choices are the same at any temperature.
        self.temperatures: list[float] = []

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    def init_from_target(self, layer: dict[str, torch.Tensor], final_norm: torch.Tensor) -> None:
        """Start as "feature + token embedding", with the target's last layer's SwiGLU and final norm."""
        h = self.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()
            self.fc.weight[:, :h] += torch.eye(h)
            self.fc.weight[:, h:] += torch.eye(h)
            self.fc.weight.add_(torch.randn_like(self.fc.weight) * 0.01)
            self.ln.copy_(layer["post_attention_layernorm"])
            self.gate.weight.copy_(layer["gate_proj"])
            self.up.weight.copy_(layer["up_proj"])
            self.down.weight.copy_(layer["down_proj"])
            self.lnf.copy_(final_norm)

    def step(self, feature: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The predicted next feature for each (feature [..., hidden], token [...])."""
        x = self.fc(torch.cat([self.embed[token].to(feature.dtype), feature], -1))
        n = F.rms_norm(x, (self.hidden_size,), self.ln, self.eps)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits over ``vocab_ids`` (not the whole vocabulary)."""
        return F.linear(F.rms_norm(feature, (self.hidden_size,), self.lnf, self.eps), self.out.to(feature.dtype))

    def prepare(self) -> None:
        """Inference weights for `draft`: gate and up as one matrix, and all packed for CoSine's matmul kernel
        where it runs for this dtype (`cosine.engine.kernels`: 3–4× F.linear at one row, bf16). Call again after
        changing the weights."""
        from cosine.engine import kernels

        mats = {"fc": self.fc.weight, "gate_up": torch.cat([self.gate.weight, self.up.weight]),
                "down": self.down.weight, "out": self.out}
        mats = {k: v.detach().contiguous() for k, v in mats.items()}
        self._kernel = (kernels.available(self.fc.weight.device, self.fc.weight.dtype)
                        and all(v.shape[0] % 16 == 0 and v.shape[1] % 16 == 0 for v in mats.values()))  # its blocking
        self._ready = {k: torch.ops.cosine.pack_weight(v) for k, v in mats.items()} if self._kernel else mats

    def _lin(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        w = self._ready[name]
        if self._kernel:
            return torch.ops.cosine.packed_linear(x, w, bias, residual)
        y = F.linear(x, w, bias)
        return y if residual is None else y + residual

    def _fast_step(self, feature: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` and `logits` for inference, on the prepared weights: (next feature, logits)."""
        h = self.hidden_size
        x = self._lin(torch.cat([self.embed[token], feature], -1), "fc", self.fc.bias.detach())
        gate, up = self._lin(F.rms_norm(x, (h,), self.ln.detach(), self.eps), "gate_up").split(self.gate.weight.shape[0], -1)
        y = self._lin(F.silu(gate) * up, "down", residual=x)
        return y, self._lin(F.rms_norm(y, (h,), self.lnf.detach(), self.eps), "out")

    def temperature(self, step: int) -> float:
        """The calibrated temperature of draft step ``step`` (0-based)."""
        if not self.temperatures:
            return 1.0
        return self.temperatures[min(step, len(self.temperatures) - 1)]

    def probs(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Step ``step``'s probabilities over the head's vocabulary, calibrated."""
        return torch.softmax(logits.float() / self.temperature(step), -1)

    @torch.inference_mode()
    def trees(self, features: torch.Tensor, tokens: list[int], nodes: int, floor: float,
              chains: bool = False) -> list[DraftTree]:
        """One draft tree per (feature [hidden], last token): every continuation whose path probability (the
        product of the head's calibrated probabilities from the root) is at least ``floor``, the likeliest
        ``nodes`` of them. Each node's children are its most probable tokens, the likeliest first (so a tree's
        main chain is the greedy chain). Nodes are ordered by path probability, so any prefix of a tree is a tree,
        and the expected number of accepted tokens is the sum of the nodes' path probabilities where those are
        calibrated. Where ``floor`` is 0.5 or more no node has two children that pass it: the trees are chains,
        drafted by `draft` (as they are with ``chains``: the greedy chain, cut where its path passes below the floor)."""
        if chains or floor >= 0.5 or floor <= 0:
            ids, probs = self.draft(features, tokens, nodes, floor)
            return [DraftTree.chain_above(toks, ps, floor) for toks, ps in zip(ids, probs)]
        if self._ready is None:
            self.prepare()
        k = min(self.vocab_ids.numel(), int(1 / floor) + 1)  # no more siblings than that can pass the floor
        found: list[list[tuple[float, int, int, float, int]]] = [[] for _ in tokens]  # (path, depth, token, p, parent)
        f = features.to(self.fc.weight.dtype).reshape(len(tokens), -1)
        tok = torch.tensor(tokens, dtype=torch.long)
        rows = [(i, -1, 1.0) for i in range(len(tokens))]  # (request, node, path) of each row of f
        for step in range(nodes):
            y, logits = self._fast_step(f, tok)
            top_p, top_i = self.probs(logits, step).topk(k, -1)
            paths = torch.tensor([path for _, _, path in rows])[:, None] * top_p
            keep = (paths >= floor).nonzero().tolist()
            if not keep:
                break
            paths_l, probs_l, toks_l = paths.tolist(), top_p.tolist(), self.vocab_ids[top_i].tolist()  # read once
            at, nxt, new = [], [], []
            for r, j in keep:
                request, parent, _ = rows[r]
                new.append((request, len(found[request]), paths_l[r][j]))
                found[request].append((paths_l[r][j], step + 1, toks_l[r][j], probs_l[r][j], parent))
                at.append(r)
                nxt.append(toks_l[r][j])
            f, tok, rows = y[torch.tensor(at)], torch.tensor(nxt, dtype=torch.long), new
        return [_ordered(nodes_of, nodes) for nodes_of in found]

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: list[int], depth: int,
              floor: float = 0.0) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy chains of up to ``depth`` tokens, one per (feature [hidden], last token): the tokens and, for
        each, the head's probability of it (softmax over its vocabulary). Drafting stops once every chain's path
        probability (the product of its probabilities) is below ``floor``: all chains are then that long."""
        if self._ready is None:
            self.prepare()
        dtype = self.fc.weight.dtype
        f = features.to(dtype).reshape(len(tokens), -1)
        tok = torch.tensor(tokens, dtype=torch.long)
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        path = torch.ones(len(tokens))
        for step in range(depth):
            f, logits = self._fast_step(f, tok)
            p = self.probs(logits, step)
            best, index = p.max(-1)
            tok = self.vocab_ids[index]
            ids.append(tok)
            probs.append(best)
            path = path * best
            if bool((path < floor).all()):
                break
        if not ids:
            return [[] for _ in tokens], [[] for _ in tokens]
        return torch.stack(ids, 1).tolist(), torch.stack(probs, 1).tolist()

    # -- files ------------------------------------------------------------------------------

    def save(self, directory: Path, **card) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS))
        config = {"hidden_size": self.hidden_size, "intermediate_size": self.gate.weight.shape[0],
                  "vocab": int(self.vocab_ids.numel()), "eps": self.eps, "temperatures": self.temperatures} | card
        (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path, target: "TargetWeights", dtype: torch.dtype | None = None) -> "FeatureHead":
        """A saved head over the target's frozen weights; ValueError when it was trained for another target shape."""
        from safetensors.torch import load_file

        config = json.loads((Path(directory) / CONFIG).read_text())
        if config["hidden_size"] != target.embed.shape[1]:
            raise ValueError(f"the feature head in {directory} has hidden size {config['hidden_size']}, "
                             f"the target {target.embed.shape[1]}")
        state = load_file(str(Path(directory) / WEIGHTS))
        if int(state["vocab_ids"].max()) >= target.embed.shape[0]:
            raise ValueError(f"the feature head in {directory} proposes tokens beyond the target's vocabulary")
        head = cls(target.embed, state["vocab_ids"], config["intermediate_size"], config["eps"], target.lm_head)
        head.load_state_dict(state)
        head.temperatures = [float(t) for t in config.get("temperatures", [])]
        head.eval()
        if dtype is not None:
            head.to(dtype)
        head.prepare()
        return head


def _ordered(found: list[tuple[float, int, int, float, int]], nodes: int) -> DraftTree:
    """A tree of the ``nodes`` likeliest of the found (path, depth, token, probability, parent) nodes, ordered by
    path probability (ties: the shallower first, so parents come before their children)."""
    order = sorted(range(len(found)), key=lambda i: (-found[i][0], found[i][1], i))[:nodes]
    where = {old: new for new, old in enumerate(order)}
    return DraftTree([found[i][2] for i in order], [where[found[i][4]] if found[i][4] >= 0 else -1 for i in order],
                     [found[i][3] for i in order])


class TargetWeights:
    """What a feature head takes from the target's checkpoint: its embedding, head, final norm and last layer."""

    def __init__(self, path: Path):
        from transformers import AutoConfig

        from cosine.engine.llama import _load_state_dict, spec_from_config

        spec = spec_from_config(AutoConfig.from_pretrained(str(path)))
        state = _load_state_dict(Path(path))
        prefix = "model." if "model.embed_tokens.weight" in state else ""
        self.embed = state[f"{prefix}embed_tokens.weight"].float()
        tied = spec.tie_word_embeddings or "lm_head.weight" not in state
        self.lm_head = None if tied else state["lm_head.weight"].float()
        self.final_norm = state[f"{prefix}norm.weight"].float()
        last = f"{prefix}layers.{spec.n_layers - 1}."
        self.last_layer = {"post_attention_layernorm": state[last + "post_attention_layernorm.weight"].float(),
                           **{n: state[f"{last}mlp.{n}.weight"].float() for n in ("gate_proj", "up_proj", "down_proj")}}
        self.intermediate_size = spec.intermediate_size
        self.eps = spec.rms_norm_eps


def load_for_target(setting: str, target_path: Path, dtype: str = "auto", device: str = "cpu") -> FeatureHead | None:
    """The verifier's feature head: ``setting`` "off" (none), "auto" (the zoo's ``feature-head`` where it was
    trained for this target, else none) or a directory (an error if it does not load)."""
    import logging

    from cosine.engine.models import resolve_dtype

    log = logging.getLogger(__name__)
    if setting in ("off", ""):
        return None
    if setting == "auto":
        from cosine.zoo.registry import find

        entry = find("feature-head")
        if entry is None or not entry.path:
            return None
        trained_for = json.loads((Path(entry.path) / CONFIG).read_text()).get("target")
        if trained_for != Path(target_path).name:
            log.warning("the zoo's feature head was trained for %r, not this target (%r): not used", trained_for,
                        Path(target_path).name)
            return None
        directory = Path(entry.path)
    else:
        directory = Path(setting)
    head = FeatureHead.load(directory, TargetWeights(Path(target_path)), resolve_dtype(dtype, device))
    head.to(device)
    head.prepare()
    log.info("feature head from %s: %d tokens", directory, head.vocab_ids.numel())
    return head
