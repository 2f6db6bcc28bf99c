# Teacher-forced target forward over prompt+continuation; save post-norm and pre-norm last hidden states.
import time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from cosine.zoo.build import _load_samples
torch.set_num_threads(2); torch.manual_seed(0)
T = Path.home() / '.cache/cosine/models/smollm2-135m-instruct'
m = AutoModelForCausalLM.from_pretrained(str(T), dtype=torch.float32).eval()
pre = {}
m.model.norm.register_forward_hook(lambda mod, inp, out: pre.__setitem__('x', inp[0]))
t0 = time.time(); ntok = 0; out = {}
for dom in ['code', 'docs', 'literary', 'chat']:
    for split in ['train', 'heldout']:
        S = _load_samples(Path.home() / f'.cache/cosine/zoo-build/{dom}-{split}-s0.pt')
        recs = []; agree = tot = 0
        for s in S:
            ids = torch.tensor([s.tokens])
            with torch.no_grad():
                h = m.model(input_ids=ids).last_hidden_state[0]
                lg = m.lm_head(h)
            pred = lg.argmax(-1)
            c = torch.tensor(s.tokens[s.prompt_len:])
            agree += (pred[s.prompt_len - 1:-1] == c).sum().item(); tot += len(c)
            recs.append(dict(tokens=s.tokens, prompt_len=s.prompt_len, f=h.half(), pre=pre['x'][0].half()))
            ntok += len(s.tokens)
        out[f'{dom}-{split}'] = recs
        print(dom, split, 'target self-consistency', agree / tot, 'tokens so far', ntok, 'sec', round(time.time() - t0, 1), flush=True)
torch.save(out, str(Path(__import__('os').environ.get('EAGLE_OUT', '/tmp/eagle')) / 'feats.pt'))
print('total extraction seconds', time.time() - t0, 'tok/s', ntok / (time.time() - t0))
