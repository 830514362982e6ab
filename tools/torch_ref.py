#!/usr/bin/python3
"""Reference forward (PyTorch fp32, Hugging Face Llama/Qwen2/Qwen3 semantics) for kvserve tests.

Loads a GGUF file (F32/F16 tensors; tiny numpy reader below) or a Hugging Face directory
(config.json + *.safetensors via numpy), runs the token ids in one causal pass and writes the
logits of every position as raw little-endian f32, shape [n_tokens, n_vocab].

  /usr/bin/python3 tools/torch_ref.py --model M.gguf --tokens 1,2,3 --out logits.f32
      [--rope-scaling llama3,FACTOR,LOW,HIGH,ORIG_MAX_POS | linear,FACTOR]

RoPE: GGUF `llama` files have q/k rows permuted by the HF->GGUF converter, so for them this
script rotates adjacent pairs (x[2i], x[2i+1]); HF checkpoints and GGUF qwen2/qwen3 rotate
halves (HF rotate_half). Prints "n_tokens n_vocab" on stdout.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch

# ---------------------------------------------------------------- GGUF reader
_SCALAR = {0: '<B', 1: '<b', 2: '<H', 3: '<h', 4: '<I', 5: '<i', 6: '<f', 7: '<?', 10: '<Q', 11: '<q', 12: '<d'}


class _Reader:
    def __init__(self, buf):
        self.buf, self.off = buf, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take('<Q')
        s = bytes(self.buf[self.off:self.off + n]).decode('utf-8', 'replace')
        self.off += n
        return s

    def value(self, t):
        if t in _SCALAR:
            return self.take(_SCALAR[t])
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take('<I'), self.take('<Q')
            return [self.value(et) for _ in range(n)]
        raise ValueError('bad gguf value type %d' % t)


def read_gguf(path):
    buf = np.memmap(path, dtype=np.uint8, mode='r')
    r = _Reader(buf)
    if bytes(buf[:4]) != b'GGUF':
        raise ValueError('not a GGUF file')
    r.off = 4
    r.take('<I')  # version
    n_tensors, n_kv = r.take('<Q'), r.take('<Q')
    meta = {}
    for _ in range(n_kv):
        k = r.string()
        meta[k] = r.value(r.take('<I'))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take('<I')
        ne = [r.take('<Q') for _ in range(nd)]
        infos.append((name, ne, r.take('<I'), r.take('<Q')))
    align = meta.get('general.alignment', 32)
    base = (r.off + align - 1) // align * align
    tensors = {}
    for name, ne, typ, off in infos:
        n = int(np.prod(ne))
        if typ == 0:
            a = np.frombuffer(buf, dtype='<f4', count=n, offset=base + off)
        elif typ == 1:
            a = np.frombuffer(buf, dtype='<f2', count=n, offset=base + off).astype(np.float32)
        else:
            raise ValueError('tensor %s: unsupported ggml type %d' % (name, typ))
        tensors[name] = torch.from_numpy(np.array(a, dtype=np.float32).reshape(list(reversed(ne))))
    return meta, tensors


def load_gguf(path):
    meta, t = read_gguf(path)
    arch = meta['general.architecture']
    g = lambda k, d=None: meta.get('%s.%s' % (arch, k), d)
    n_heads = g('attention.head_count')
    dim = g('embedding_length')
    cfg = dict(arch=arch, dim=dim, n_layers=g('block_count'), n_heads=n_heads,
               n_kv_heads=g('attention.head_count_kv', n_heads),
               head_dim=g('attention.key_length', dim // n_heads),
               eps=g('attention.layer_norm_rms_epsilon', 1e-5), theta=g('rope.freq_base', 10000.0),
               neox=arch != 'llama', scaling=None)
    st = g('rope.scaling.type')
    if st == 'linear':
        cfg['scaling'] = ('linear', g('rope.scaling.factor'))
    W = dict(embd=t['token_embd.weight'], norm=t['output_norm.weight'],
             out=t.get('output.weight', t['token_embd.weight']), freqs=t.get('rope_freqs.weight'), layers=[])
    for i in range(cfg['n_layers']):
        p = 'blk.%d.' % i
        W['layers'].append({k: t.get(p + n) for k, n in [
            ('attn_norm', 'attn_norm.weight'), ('wq', 'attn_q.weight'), ('wk', 'attn_k.weight'),
            ('wv', 'attn_v.weight'), ('bq', 'attn_q.bias'), ('bk', 'attn_k.bias'), ('bv', 'attn_v.bias'),
            ('q_norm', 'attn_q_norm.weight'), ('k_norm', 'attn_k_norm.weight'), ('wo', 'attn_output.weight'),
            ('ffn_norm', 'ffn_norm.weight'), ('wg', 'ffn_gate.weight'), ('wu', 'ffn_up.weight'),
            ('wd', 'ffn_down.weight')]})
    return cfg, W


# ---------------------------------------------------------------- HF directory
def read_safetensors(path):
    with open(path, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in hdr.items():
        if name == '__metadata__':
            continue
        a, b = info['data_offsets']
        raw = np.frombuffer(data[a:b], dtype=np.uint8)
        dt = info['dtype']
        if dt == 'F32':
            arr = raw.view('<f4')
        elif dt == 'F16':
            arr = raw.view('<f2').astype(np.float32)
        elif dt == 'BF16':
            arr = (raw.view('<u2').astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError('%s: unsupported dtype %s' % (name, dt))
        out[name] = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(info['shape']))
    return out


def load_hf(d):
    c = json.load(open(os.path.join(d, 'config.json')))
    t = {}
    for f in sorted(os.listdir(d)):
        if f.endswith('.safetensors'):
            t.update(read_safetensors(os.path.join(d, f)))
    nh = c['num_attention_heads']
    cfg = dict(arch=c.get('model_type', 'llama'), dim=c['hidden_size'], n_layers=c['num_hidden_layers'],
               n_heads=nh, n_kv_heads=c.get('num_key_value_heads', nh),
               head_dim=c.get('head_dim') or c['hidden_size'] // nh, eps=c.get('rms_norm_eps', 1e-6),
               theta=c.get('rope_theta', 10000.0), neox=True, scaling=None)
    rs = c.get('rope_scaling')
    if rs:
        typ = rs.get('rope_type', rs.get('type'))
        if typ == 'llama3':
            cfg['scaling'] = ('llama3', rs['factor'], rs['low_freq_factor'], rs['high_freq_factor'],
                              rs['original_max_position_embeddings'])
        elif typ == 'linear':
            cfg['scaling'] = ('linear', rs['factor'])
    embd = t['model.embed_tokens.weight']
    W = dict(embd=embd, norm=t['model.norm.weight'], out=t.get('lm_head.weight', embd), freqs=None, layers=[])
    for i in range(cfg['n_layers']):
        p = 'model.layers.%d.' % i
        W['layers'].append({k: t.get(p + n) for k, n in [
            ('attn_norm', 'input_layernorm.weight'), ('wq', 'self_attn.q_proj.weight'),
            ('wk', 'self_attn.k_proj.weight'), ('wv', 'self_attn.v_proj.weight'), ('bq', 'self_attn.q_proj.bias'),
            ('bk', 'self_attn.k_proj.bias'), ('bv', 'self_attn.v_proj.bias'), ('q_norm', 'self_attn.q_norm.weight'),
            ('k_norm', 'self_attn.k_norm.weight'), ('wo', 'self_attn.o_proj.weight'),
            ('ffn_norm', 'post_attention_layernorm.weight'), ('wg', 'mlp.gate_proj.weight'),
            ('wu', 'mlp.up_proj.weight'), ('wd', 'mlp.down_proj.weight')]})
    return cfg, W


# ---------------------------------------------------------------- forward
def rmsnorm(x, w, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def inv_freqs(cfg, W):
    hd = cfg['head_dim']
    inv = 1.0 / (cfg['theta'] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg['scaling']
    if s and s[0] == 'linear':
        inv = inv / s[1]
    elif s and s[0] == 'llama3':  # transformers _compute_llama3_parameters
        factor, lo, hi, orig = s[1:]
        lo_wl, hi_wl = orig / lo, orig / hi
        wl = 2 * math.pi / inv
        inv_l = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (orig / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wl < hi_wl) * ~(wl > lo_wl)
        inv = torch.where(medium, smoothed, inv_l)
    if W.get('freqs') is not None:  # GGUF rope_freqs: llama.cpp divides theta by the factor
        inv = inv / W['freqs']
    return inv


def rope(x, cos, sin, neox):
    # x: (T, H, hd); cos/sin: (T, hd/2)
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        h = x.shape[-1] // 2
        x0, x1 = x[..., :h], x[..., h:]
        return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


@torch.no_grad()
def forward(cfg, W, tokens):
    T, hd, nh, nkv = len(tokens), cfg['head_dim'], cfg['n_heads'], cfg['n_kv_heads']
    x = W['embd'][torch.tensor(tokens, dtype=torch.long)]
    freqs = torch.arange(T, dtype=torch.int64).float()[:, None] * inv_freqs(cfg, W)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    mask = torch.full((T, T), float('-inf')).triu(1)
    for L in W['layers']:
        h = rmsnorm(x, L['attn_norm'], cfg['eps'])
        q, k, v = h @ L['wq'].T, h @ L['wk'].T, h @ L['wv'].T
        if L['bq'] is not None:
            q, k, v = q + L['bq'], k + L['bk'], v + L['bv']
        q, k, v = q.view(T, nh, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
        if L['q_norm'] is not None:
            q, k = rmsnorm(q, L['q_norm'], cfg['eps']), rmsnorm(k, L['k_norm'], cfg['eps'])
        q, k = rope(q, cos, sin, cfg['neox']), rope(k, cos, sin, cfg['neox'])
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = torch.einsum('thd,shd->hts', q, k) / math.sqrt(hd) + mask
        att = torch.softmax(att.float(), dim=-1)
        o = torch.einsum('hts,shd->thd', att, v).reshape(T, nh * hd)
        x = x + o @ L['wo'].T
        h = rmsnorm(x, L['ffn_norm'], cfg['eps'])
        x = x + (torch.nn.functional.silu(h @ L['wg'].T) * (h @ L['wu'].T)) @ L['wd'].T
    return rmsnorm(x, W['norm'], cfg['eps']) @ W['out'].T


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--model', required=True)
    ap.add_argument('--tokens', required=True, help='comma-separated token ids')
    ap.add_argument('--out', required=True, help='raw f32 output [n_tokens, n_vocab]')
    ap.add_argument('--rope-scaling', help='llama3,FACTOR,LOW,HIGH,ORIG or linear,FACTOR (overrides the file)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg, W = load_hf(a.model) if os.path.isdir(a.model) else load_gguf(a.model)
    if a.rope_scaling:
        p = a.rope_scaling.split(',')
        cfg['scaling'] = ('llama3', float(p[1]), float(p[2]), float(p[3]), int(p[4])) if p[0] == 'llama3' \
            else ('linear', float(p[1]))
    toks = [int(t) for t in a.tokens.split(',') if t.strip()]
    logits = forward(cfg, W, toks).float().contiguous().numpy().astype('<f4')
    logits.tofile(a.out)
    print(logits.shape[0], logits.shape[1])
    return 0


if __name__ == '__main__':
    sys.exit(main())
