"""EAGLE-style feature-conditioned drafter: offline feasibility experiment.
Pair t: input (f_t, x_{t+1}) -> predicted f_{t+1} -> lm_head -> x_{t+2}.
Multi-step ('training-time test') training and exact parallel multi-step evaluation with a diagonal mask."""
import argparse, json, math, statistics, time
from collections import Counter
import torch, torch.nn as nn, torch.nn.functional as F
from safetensors.torch import load_file
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument('--domains', default='code,docs,literary,chat')
p.add_argument('--shared', action='store_true', help='one head for all domains')
p.add_argument('--seconds', type=float, default=120)
p.add_argument('--vocab', type=int, default=4096)
p.add_argument('--init', default='last', choices=['last', 'l0', 'rand'])
p.add_argument('--feat', default='post', choices=['post', 'pre'])
p.add_argument('--steps', type=int, default=3, help='training-time-test unroll depth')
p.add_argument('--lr', type=float, default=1e-3)
p.add_argument('--bs', type=int, default=8)
p.add_argument('--wf', type=float, default=1.0); p.add_argument('--wp', type=float, default=0.1)
p.add_argument('--bf16', action='store_true')
p.add_argument('--noise', type=float, default=0.0)
p.add_argument('--outnorm', action='store_true', help='apply a (trainable, target-initialised) final norm before lm_head')
p.add_argument('--tag', default='run')
p.add_argument('--save', action='store_true')
a = p.parse_args()
torch.set_num_threads(2); torch.manual_seed(0)

T = Path.home() / '.cache/cosine/models/smollm2-135m-instruct'
W = load_file(str(T / 'model.safetensors'))
E = W['model.embed_tokens.weight']  # [49152, 576], tied lm_head, frozen
H, NH, NKV, HD, EPS = 576, 9, 3, 64, 1e-5
FEATS = torch.load(str(Path(__import__('os').environ.get('EAGLE_OUT', '/tmp/eagle')) / 'feats.pt'))

def rms(x, w): return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w
inv = 1.0 / (100000.0 ** (torch.arange(0, HD, 2).float() / HD))
def rope(x, pos):  # x [B,h,m,HD], pos [B?,m] or [m]
    f = pos.float()[..., None] * inv; emb = torch.cat([f, f], -1)
    cos, sin = emb.cos(), emb.sin()
    if cos.dim() == 2: cos, sin = cos[None, None], sin[None, None]
    else: cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin

class Drafter(nn.Module):
    def __init__(self, vocab_ids, init):
        super().__init__()
        L = {'last': 29, 'l0': 0}.get(init)
        g = lambda n: W[f'model.layers.{L}.{n}.weight'].clone()
        self.fc = nn.Linear(2 * H, H)
        with torch.no_grad():  # start as "feature + embedding" (a residual-like sum)
            self.fc.weight.zero_(); self.fc.bias.zero_()
            self.fc.weight[:, :H] += torch.eye(H); self.fc.weight[:, H:] += torch.eye(H)
            self.fc.weight.add_(torch.randn_like(self.fc.weight) * 0.01)
        mk = lambda o, i, n: nn.Parameter(g(n) if L is not None else torch.randn(o, i) * 0.02)
        self.q = mk(H, H, 'self_attn.q_proj'); self.k = mk(192, H, 'self_attn.k_proj'); self.v = mk(192, H, 'self_attn.v_proj')
        self.o = mk(H, H, 'self_attn.o_proj')
        self.gate = mk(1536, H, 'mlp.gate_proj'); self.up = mk(1536, H, 'mlp.up_proj'); self.down = mk(H, 1536, 'mlp.down_proj')
        self.ln1 = nn.Parameter(g('input_layernorm') if L is not None else torch.ones(H))
        self.ln2 = nn.Parameter(g('post_attention_layernorm') if L is not None else torch.ones(H))
        self.lnf = nn.Parameter(W['model.norm.weight'].clone())
        self.register_buffer('vids', vocab_ids)
        self.register_buffer('head', E[vocab_ids].clone())  # frozen restricted lm_head
        self.register_buffer('innorm', W['model.norm.weight'].clone())

    def inp(self, f, tok):
        if a.feat == 'pre': f = rms(f, self.innorm)
        return self.fc(torch.cat([E[tok], f], -1))

    def qkv(self, x, pos):
        B, m, _ = x.shape
        h = rms(x, self.ln1)
        q = (h @ self.q.T).view(B, m, NH, HD).transpose(1, 2)
        k = (h @ self.k.T).view(B, m, NKV, HD).transpose(1, 2)
        v = (h @ self.v.T).view(B, m, NKV, HD).transpose(1, 2)
        q, k = rope(q, pos), rope(k, pos)
        return q, k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)

    def post(self, x, att):
        B, m, _ = x.shape
        x = x + att.transpose(1, 2).reshape(B, m, H) @ self.o.T
        h = rms(x, self.ln2)
        x = x + (F.silu(h @ self.gate.T) * (h @ self.up.T)) @ self.down.T
        return x

    def logits(self, y):
        if a.outnorm or a.feat == 'pre': y = rms(y, self.lnf)
        return y @ self.head.T

    def unroll(self, f, tok, K):
        """f [B,m,H] true input features of pairs, tok [B,m] the pair tokens (x_{t+1}). Returns list over steps k=1..K
        of predicted features [B,m,H] where row s of step k predicts f_{s+k} (feature of pair s+k-1's output)."""
        B, m, _ = f.shape
        pos = torch.arange(m)
        x = self.inp(f, tok)
        q, k1, v1 = self.qkv(x, pos)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        att = F.scaled_dot_product_attention(q, k1, v1, attn_mask=causal)
        y = self.post(x, att); outs = [y]
        ks, vs = [], []
        for step in range(2, K + 1):
            # chain s, step `step`: pair at position s+step-1 with the predicted feature and the true token x_{s+step}
            tk = torch.cat([tok[:, step - 1:], tok[:, -1:].expand(B, step - 1)], 1)  # pad tail (invalid rows)
            fin = y if a.feat == 'post' else y  # predicted features feed the next step
            xk = self.inp_pred(fin, tk)
            qk, kk, vk = self.qkv(xk, pos + step - 1)
            ks.append(kk); vs.append(vk)
            s_true = (qk @ k1.transpose(-1, -2)) / 8.0
            s_true = s_true.masked_fill(~causal, float('-inf'))
            s_diag = torch.stack([(qk * kk_).sum(-1) / 8.0 for kk_ in ks], -1)  # [B,h,m,step-1]
            P = torch.softmax(torch.cat([s_true, s_diag], -1), -1)
            att = P[..., :m] @ v1 + sum(P[..., m + i, None] * vs[i] for i in range(len(vs)))
            y = self.post(xk, att); outs.append(y)
        return outs

    def inp_pred(self, y, tok):  # predicted features are in the drafter's output space: post-norm-like, or pre-norm
        return self.fc(torch.cat([E[tok], rms(y, self.innorm) if a.feat == 'pre' else y], -1))

def batches(recs, bs, shuffle):
    idx = torch.randperm(len(recs)).tolist() if shuffle else list(range(len(recs)))
    for i in range(0, len(idx), bs):
        rs = [recs[j] for j in idx[i:i + bs]]
        n = max(len(r['tokens']) for r in rs)
        B = len(rs)
        toks = torch.zeros(B, n, dtype=torch.long); f = torch.zeros(B, n, H); fpost = torch.zeros(B, n, H)
        mask = torch.zeros(B, n, dtype=torch.bool); cont = torch.zeros(B, n, dtype=torch.bool)
        for b, r in enumerate(rs):
            L = len(r['tokens']); toks[b, :L] = torch.tensor(r['tokens'])
            f[b, :L] = (r['f'] if a.feat == 'post' else r['pre']).float(); fpost[b, :L] = r['f'].float()
            mask[b, :L] = True; cont[b, r['prompt_len']:L] = True
        yield toks, f, fpost, mask, cont

def step_targets(toks, f, fpost, mask, cont, k):
    """for chain s (pair s), step k: target feature f[s+k], token x[s+k+1]; validity masks."""
    B, n = toks.shape; m = n - 1
    def sh(t, d, fill=0):
        out = torch.full_like(t[:, :m], fill) if t.dim() == 2 else torch.zeros_like(t[:, :m])
        L = max(0, min(m, n - d)); out[:, :L] = t[:, d:d + L]; return out
    ft = sh(f, k); fp = sh(fpost, k); okf = sh(mask, k, False)
    tt = sh(toks, k + 1); okt = sh(mask, k + 1, False); ct = sh(cont, k + 1, False)
    return ft, fp, okf, tt, okt & ct

def run_losses(model, recs, K, train=True):
    pass

def evaluate(model, recs, D=8):
    model.eval(); tau_all = {d: [] for d in range(1, D + 1)}; agree = tot = 0; accept_k = [0] * D; cnt_k = [0] * D
    with torch.no_grad():
        for toks, f, fpost, mask, cont in batches(recs, 4, False):
            m = toks.shape[1] - 1
            outs = model.unroll(f[:, :m], toks[:, 1:], D)
            preds = [model.vids[model.logits(y).argmax(-1)] for y in outs]
            for b in range(toks.shape[0]):
                n = int(mask[b].sum()); pl = int(cont[b].nonzero()[0]) if cont[b].any() else n
                # continuation position P (absolute) drafted by chain s = P-2 at step 1; acc[P] = matching prefix length
                acc = []
                for P in range(pl, n):
                    s = P - 2; c = 0
                    for k in range(1, D + 1):
                        if P + k - 1 >= n: break
                        if preds[k - 1][b, s].item() == toks[b, P + k - 1].item(): c += 1
                        else: break
                    acc.append(c)
                ncont = n - pl
                agree += sum(1 for c in acc if c >= 1); tot += ncont
                for k in range(D):
                    accept_k[k] += sum(1 for c in acc if c >= k + 1); cnt_k[k] += sum(1 for c in acc if c >= k)
                for d in range(1, D + 1):
                    p_ = rounds = 0
                    while p_ < ncont:
                        p_ += min(d, acc[p_], ncont - p_ - 1) + 1; rounds += 1
                    tau_all[d].append(ncont / rounds)
    model.train()
    return agree / tot, {d: round(statistics.mean(v), 3) for d, v in tau_all.items()}, [round(x / max(y, 1), 3) for x, y in zip(accept_k, cnt_k)]

def train(domains):
    tr = [r for d in domains for r in FEATS[f'{d}-train']]
    cnt = Counter(t for r in tr for t in r['tokens'])
    vids = torch.tensor(sorted(t for t, _ in cnt.most_common(a.vocab)))
    model = Drafter(vids, a.init)
    vmap = torch.full((E.shape[0],), -1, dtype=torch.long); vmap[vids] = torch.arange(len(vids))
    for d in domains:
        ho = FEATS[f'{d}-heldout']
        cov = [vmap[t].item() >= 0 for r in ho for t in r['tokens'][r['prompt_len']:]]
        print(f'  vocab {len(vids)} held-out continuation coverage {d}: {sum(cov)/len(cov):.3f}', flush=True)
    params = [p_ for p_ in model.parameters() if p_.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    t0 = time.time(); it = 0; curve = []; next_eval = 30
    while True:
        for toks, f, fpost, mask, cont in batches(tr, a.bs, True):
            el = time.time() - t0
            if el >= next_eval or el >= a.seconds:
                tt = time.time()
                ags = {d: evaluate(model, FEATS[f'{d}-heldout'], 4)[0] for d in domains}
                t0 += time.time() - tt  # eval time excluded from training seconds
                curve.append((round(el), {d: round(v, 3) for d, v in ags.items()}))
                print(f'  [{el:6.1f}s it {it}] held-out top-1 {curve[-1][1]}', flush=True)
                next_eval += 30
                if el >= a.seconds: return model, curve, time.time() - t0
            frac = min(1.0, (time.time() - t0) / a.seconds)
            for g_ in opt.param_groups: g_['lr'] = a.lr * min(1.0, (it + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            m = toks.shape[1] - 1
            fin = f[:, :m]
            if a.noise: fin = fin + (torch.rand_like(fin) - 0.5) * a.noise
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=a.bf16):
                outs = model.unroll(fin, toks[:, 1:], a.steps)
                loss = 0
                for k, y in enumerate(outs, 1):
                    ft, fp, okf, tt_, okt = step_targets(toks, f, fpost, mask, cont, k)
                    y = y.float()
                    lf = (F.smooth_l1_loss(y, ft, reduction='none').mean(-1) * okf).sum() / okf.sum().clamp(min=1)
                    with torch.no_grad():
                        tp = torch.softmax(fp @ model.head.T, -1)  # target distribution restricted to V'
                    lp = -(tp * torch.log_softmax(model.logits(y).float(), -1)).sum(-1)
                    lp = (lp * okf).sum() / okf.sum().clamp(min=1)
                    loss = loss + (a.wf * lf + a.wp * lp) * (0.8 ** (k - 1))
            opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); it += 1

groups = [a.domains.split(',')] if a.shared else [[d] for d in a.domains.split(',')]
results = {}
for doms in groups:
    print(f'== {a.tag} train on {doms}', flush=True)
    model, curve, secs = train(doms)
    for d in doms:
        ag, taus, cond = evaluate(model, FEATS[f'{d}-heldout'], 8)
        results[d] = dict(agreement=round(ag, 4), tau=taus, cond_accept=cond, train_s=round(secs, 1), curve=curve)
        print(f'  {d}: top-1 {ag:.3f} tau {taus} per-step conditional acceptance {cond}', flush=True)
    if a.save: torch.save(model.state_dict(), f'{__import__("os").environ.get("EAGLE_OUT", "/tmp/eagle")}/{a.tag}-{"+".join(doms)}.pt')
json.dump(dict(args=vars(a), results=results), open(f'{__import__("os").environ.get("EAGLE_OUT", "/tmp/eagle")}/{a.tag}.json', 'w'), indent=1)
