# c = one EAGLE drafter decode step (1 token, KV cache of 128 positions, batch 1) / one target decode step, measured alternately.
import statistics, time, sys, torch, torch.nn.functional as F
from pathlib import Path
from safetensors.torch import load_file
from cosine.engine.llama import NativeLlama
from cosine.zoo.build import forward_ms
torch.set_num_threads(2)
T = Path.home() / '.cache/cosine/models/smollm2-135m-instruct'
W = load_file(str(T / 'model.safetensors')); E = W['model.embed_tokens.weight']
target = NativeLlama.from_pretrained(T, dtype='float32', max_positions=1024)
lmcode = NativeLlama.from_pretrained(Path.home() / '.cache/cosine/models/lm-code', dtype='float32', max_positions=1024)
H, HD = 576, 64
g = lambda n: W[f'model.layers.29.{n}.weight']
class Step:
    def __init__(self, V):
        self.fc = torch.randn(H, 2 * H) * 0.02; self.fcb = torch.zeros(H)
        self.wqkv = torch.cat([g('self_attn.q_proj'), g('self_attn.k_proj'), g('self_attn.v_proj')]).contiguous()
        self.o = g('self_attn.o_proj').contiguous(); self.gu = torch.cat([g('mlp.gate_proj'), g('mlp.up_proj')]).contiguous()
        self.down = g('mlp.down_proj').contiguous(); self.ln1 = g('input_layernorm'); self.ln2 = g('post_attention_layernorm')
        self.head = E[:V].clone().contiguous()
        self.K = torch.randn(1, 3, 1024, HD); self.V = torch.randn(1, 3, 1024, HD); self.n = 128
        inv = 1.0 / (100000.0 ** (torch.arange(0, HD, 2).float() / HD)); f = torch.arange(1024).float()[:, None] * inv
        e = torch.cat([f, f], -1); self.cos, self.sin = e.cos(), e.sin()
    def rms(self, x, w): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    def rope(self, x, p):
        c, s = self.cos[p], self.sin[p]; x1, x2 = x[..., :32], x[..., 32:]
        return x * c + torch.cat([-x2, x1], -1) * s
    @torch.inference_mode()
    def __call__(self, tok, feat):
        x = F.linear(torch.cat([E[tok], feat], -1), self.fc, self.fcb)  # [1,H]
        h = self.rms(x, self.ln1); qkv = F.linear(h, self.wqkv)
        q = qkv[:, :576].view(1, 9, 1, HD); k = qkv[:, 576:768].view(1, 3, 1, HD); v = qkv[:, 768:].view(1, 3, 1, HD)
        p = self.n; q = self.rope(q, p); k = self.rope(k, p)
        self.K[:, :, p:p + 1] = k; self.V[:, :, p:p + 1] = v
        att = F.scaled_dot_product_attention(q.view(1, 3, 3, HD), self.K[:, :, :p + 1], self.V[:, :, :p + 1])  # GQA folded
        x = x + F.linear(att.reshape(1, H), self.o)
        h = self.rms(x, self.ln2); gu = F.linear(h, self.gu)
        x = x + F.linear(F.silu(gu[:, :1536]) * gu[:, 1536:], self.down)
        return F.linear(x, self.head).argmax(-1), x
def ms(fn, reps=1):
    t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1000
for V in [int(v) for v in sys.argv[1:]] or [2048, 4096, 8192, 49152]:
    st = Step(V); feat = torch.randn(1, H); tok = torch.tensor([5])
    for _ in range(5): st(tok, feat)
    d, t, l = [], [], []
    for _ in range(31):
        d.append(ms(lambda: st(tok, feat))); t.append(forward_ms(target, reps=1)[1]); l.append(forward_ms(lmcode, reps=1)[1])
    print(f'V={V}: drafter {statistics.median(d):.2f} ms, target {statistics.median(t):.2f} ms, c={statistics.median(d)/statistics.median(t):.4f};'
          f' lm-code (2 layers, NativeLlama) {statistics.median(l):.2f} ms c={statistics.median(l)/statistics.median(t):.4f}', flush=True)
