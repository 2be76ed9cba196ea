#!/usr/bin/env python3
"""A float64 oracle of DeepSeek-V4's official forward pass, for pdmoe's synthetic checkpoints.

Written for pdmoe from the semantics of DeepSeek's official inference code for V4-Flash,
`inference/model.py` and `inference/kernel.py` as released, read at commit
0825add42734731a285e30f657b0ccfc5bad74c9 of github.com/Mockingjay1316/deepseek-v4-flash-spark
(that commit holds DeepSeek's files unchanged; the fork's later commits replace the MoE and mHC
with fused GB10 kernels, and its HEAD 08045f89 keeps the same semantics for everything used here).
No code is copied: every equation below is restated from those files and named where it is used.

What it follows exactly (token by token, the official decode path, which equals its prefill):
  embedding -> hc_mult copies; per layer mHC pre (hc_split_sinkhorn: softmax + eps, column
  normalisation, then sinkhorn_iters - 1 row/column rounds, eps in every denominator), RMSNorm,
  attention (low-rank q with per-head RMS, shared K=V latent, interleaved-pair rope; YaRN on the
  compress layers only; sliding window; compressors with overlapping ratio-4 blocks and ape;
  the indexer with its Hadamard rotation, FP4 simulation and weight scale; sparse attention with
  the per-head sink in the denominator; inverse rope on the output; grouped wo_a, wo_b), mHC
  post; the same around the MoE (sqrt-softplus router, bias only for the choice, hash layers by
  tid2eid, normalised weights times route_scale, SwiGLU with swiglu_limit) and the mHC head.
  The KV cache's storage as the official code simulates it: FP8 e4m3 with a ue8m0 scale per 64
  non-rope values (act_quant, round_scale), rope values bf16 (kv_cache_dtype "fp8", the
  official); or every value bf16 (kv_cache_dtype "bf16": pdmoe's default pool, for comparing the
  rest of the forward with it exactly).
What it does differently, on purpose:
  arithmetic is float64 (the official code runs bf16 activations and fp32 accumulations): an
  oracle of the equations, not of one GPU's rounding; the only roundings kept are those the
  official code performs on purpose as a model of deployment (the KV cache's FP8/bf16 storage,
  the indexer's bf16 -> Hadamard -> bf16 -> FP4 path);
  weights are what the checkpoint holds (bf16/fp32 as they are, int8 times its per-row scale):
  pdmoe's synthetic checkpoints are not in the release's FP8/FP4 formats;
  top-k ties go to the lower index (torch.topk leaves the order of equal values unspecified);
  a block shorter than the official kernels' (FP4 blocks of 32, FP8 blocks of 64) is quantised
  as one block when a toy model's dimension is smaller (the official code asserts instead);
  the shared expert clamps with swiglu_limit as the later official revision does (the release
  at 0825add does not; option shared_clamp=False gives the release).
"""
import glob
import json
import math
import os
import struct
import sys

import numpy as np

OFFICIAL_REVISION = "0825add42734731a285e30f657b0ccfc5bad74c9"


# --- checkpoint ---------------------------------------------------------------------------

def read_safetensors(path):
    """name -> numpy array (a view of the mapped file where the dtype allows). Format: an
    8-byte little-endian header length, a JSON header, then the raw little-endian data."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", bytes(raw[:8]))
    header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        buf = raw[base + a:base + b]
        shape = tuple(t["shape"])
        dt = t["dtype"]
        if dt == "BF16":
            # bf16 is the top 16 bits of an fp32
            v = (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F32":
            v = buf.view("<f4")
        elif dt == "F16":
            v = buf.view("<f2")
        elif dt == "I8":
            v = buf.view(np.int8)
        elif dt == "I32":
            v = buf.view("<i4")
        elif dt == "I64":
            v = buf.view("<i8")
        else:
            raise ValueError(f"{path}: tensor {name}: dtype {dt} is not read by the oracle")
        out[name] = v.reshape(shape)
    return out


class Checkpoint:
    def __init__(self, d):
        files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
        if not files:
            raise ValueError(f"{d}: no *.safetensors file")
        self.t = {}
        for f in files:
            self.t.update(read_safetensors(f))
        self.dir = d
        self._cache = {}

    def has(self, name):
        return name in self.t

    def vec(self, name):
        if name not in self.t:
            raise KeyError(f"{self.dir}: tensor {name} is missing")
        return np.asarray(self.t[name], dtype=np.float64)

    def mat(self, name, cache=True):
        """A weight matrix [out, in] in float64: int8 times its `_scale` (one fp32 per row)."""
        if name in self._cache:
            return self._cache[name]
        if name not in self.t:
            raise KeyError(f"{self.dir}: tensor {name} is missing")
        w = self.t[name]
        if w.dtype == np.int8:
            s = self.t.get(name + "_scale")
            if s is None:
                raise KeyError(f"{self.dir}: int8 tensor {name} has no {name}_scale")
            m = w.astype(np.float64) * np.asarray(s, dtype=np.float64).reshape(-1, 1)
        else:
            m = np.asarray(w, dtype=np.float64)
        if cache:
            self._cache[name] = m
        return m


class Args:
    """The official ModelArgs, from a Hugging Face style config.json (pdmoe's presets)."""

    def __init__(self, cfg):
        g = cfg.get
        self.vocab_size = cfg["vocab_size"]
        self.dim = cfg["hidden_size"]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.head_dim = cfg["head_dim"]
        self.rope_head_dim = cfg["qk_rope_head_dim"]
        self.q_lora_rank = cfg["q_lora_rank"]
        self.o_lora_rank = cfg["o_lora_rank"]
        self.o_groups = cfg["o_groups"]
        self.window_size = cfg["sliding_window"]
        self.compress_ratios = list(cfg["compress_ratios"])[:self.n_layers]
        self.index_n_heads = g("index_n_heads", 0)
        self.index_head_dim = g("index_head_dim", 0)
        self.index_topk = g("index_topk", 0)
        self.compress_rope_theta = g("compress_rope_theta", 10000.0)
        self.rope_theta = g("rope_theta", 10000.0)
        rs = g("rope_scaling") or {}
        yarn = rs.get("type", rs.get("rope_type")) == "yarn"
        self.original_seq_len = rs.get("original_max_position_embeddings", 0) if yarn else 0
        self.rope_factor = rs.get("factor", 1.0) if yarn else 1.0
        self.beta_fast = rs.get("beta_fast", 32)
        self.beta_slow = rs.get("beta_slow", 1)
        self.n_routed_experts = cfg["n_routed_experts"]
        self.n_shared_experts = g("n_shared_experts", 0)
        self.n_activated_experts = cfg["num_experts_per_tok"]
        self.moe_inter_dim = cfg["moe_intermediate_size"]
        self.score_func = g("scoring_func", "sqrtsoftplus")
        if self.score_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {self.score_func}: the oracle implements V4's sqrtsoftplus only")
        self.route_scale = g("routed_scaling_factor", 1.0)
        self.n_hash_layers = g("num_hash_layers", 0)
        self.swiglu_limit = g("swiglu_limit", 0.0) or 0.0
        self.hc_mult = g("hc_mult", 4)
        self.hc_sinkhorn_iters = g("hc_sinkhorn_iters", 20)
        self.hc_eps = g("hc_eps", 1e-6)
        self.norm_eps = g("rms_norm_eps", 1e-6)


# --- the official code's deliberate roundings -----------------------------------------------

def bf16(x):
    """Round to bf16 (nearest, ties to even) through fp32, as a torch .to(bfloat16) does."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def _ceil_log2_f32(v):
    """ceil(log2 v) of positive fp32 values, as kernel.py's fast_log2_ceil (exponent + 1 unless
    the mantissa is zero)."""
    m, e = np.frexp(v.astype(np.float64))
    return np.where(m == 0.5, e - 1, e)


def _round_minifloat(x, mant_bits, min_exp, maxv):
    """Round to a minifloat with mant_bits mantissa bits, normals from 2^min_exp, subnormals below,
    saturating at maxv; nearest, ties to even (np.round)."""
    a = np.minimum(np.abs(x), maxv)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, min_exp)
    step = np.exp2(e - mant_bits)
    return np.sign(x) * np.minimum(np.round(a / step) * step, maxv)


def e4m3(x):
    return _round_minifloat(x, 3, -6, 448.0)


def e2m1(x):
    return _round_minifloat(x, 1, 0, 6.0)


def fp8_act_quant(x, block=64):
    """kernel.py act_quant(inplace=True, round_scale=True): per block amax = max(|x|, 1e-4),
    s = 2^ceil(log2(amax / 448)) (in fp32), x <- e4m3(clamp(x / s)) * s, back to bf16."""
    x = bf16(x)
    y = np.empty_like(x)
    n = x.shape[-1]
    for k in range(0, n, block):
        blk = x[..., k:k + block]
        amax = np.maximum(np.abs(blk).max(axis=-1, keepdims=True), 1e-4).astype(np.float32)
        s = np.exp2(_ceil_log2_f32(amax * np.float32(1 / 448.0)))
        y[..., k:k + block] = e4m3(np.clip(blk / s, -448, 448)) * s
    return bf16(y)


def fp4_act_quant(x, block=32):
    """kernel.py fp4_quant_kernel(inplace=True): per block amax = max(|x|, 6 * 2^-126),
    s = 2^ceil(log2(amax / 6)), x <- e2m1(clamp(x / s, -6, 6)) * s, back to bf16."""
    n = x.shape[-1]
    block = min(block, n)
    y = np.empty_like(x)
    for k in range(0, n, block):
        blk = x[..., k:k + block]
        amax = np.maximum(np.abs(blk).max(axis=-1, keepdims=True), 6 * 2.0 ** -126).astype(np.float32)
        s = np.exp2(_ceil_log2_f32(amax * np.float32(1 / 6.0)))
        y[..., k:k + block] = e2m1(np.clip(blk / s, -6, 6)) * s
    return bf16(y)


_hadamard = {}


def rotate_activation(x):
    """model.py rotate_activation: bf16 in, x H / sqrt(d) (Sylvester order, as
    fast_hadamard_transform), bf16 out."""
    d = x.shape[-1]
    if d not in _hadamard:
        h = np.array([[1.0]])
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        if h.shape[0] != d:
            raise ValueError(f"the Hadamard rotation needs a power of two, not {d}")
        _hadamard[d] = h / math.sqrt(d)
    return bf16(bf16(x) @ _hadamard[d].T)


def indexer_lowp(x):
    """The indexer's queries and keys: rotate_activation then the FP4 simulation."""
    return fp4_act_quant(rotate_activation(x))


# --- the forward's pieces --------------------------------------------------------------------

def rmsnorm(x, w, eps):
    """RMSNorm: x * rsqrt(mean(x^2) + eps) * w."""
    r = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return r * w if w is not None else r


def precompute_freqs(dim, original_seq_len, base, factor, beta_fast, beta_slow):
    """model.py precompute_freqs_cis: the rope frequencies with YaRN's ramp when
    original_seq_len > 0 (angles are freqs * position)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if original_seq_len > 0:
        def corr_dim(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope(x, freqs, pos, inverse=False):
    """apply_rotary_emb on the last len(freqs)*2 values: pairs (x[2i], x[2i+1]) as complex numbers
    times e^(i freqs_i pos) (the conjugate when inverse)."""
    rd = 2 * len(freqs)
    a = freqs * pos
    c, s = np.cos(a), np.sin(a)
    if inverse:
        s = -s
    y = x.copy()
    re, im = x[..., -rd::2], x[..., -rd + 1::2]
    y[..., -rd::2] = re * c - im * s
    y[..., -rd + 1::2] = re * s + im * c
    return y


def softplus(z):
    return np.logaddexp(0.0, z)


def topk_lower_first(score, k):
    """Indices of the k best (ties to the lower index), and the margin between the k-th and the
    (k+1)-th score (None when every one is taken)."""
    order = np.lexsort((np.arange(len(score)), -score))
    sel = order[:k]
    margin = float(score[order[k - 1]] - score[order[k]]) if k < len(score) else None
    return sel, margin


def hc_split_sinkhorn(mixes, scale, base, hc, iters, eps):
    """kernel.py hc_split_sinkhorn: pre = sigmoid(m0 s0 + b0) + eps, post = 2 sigmoid(m1 s1 + b1),
    comb = softmax_rows(m2 s2 + b2) + eps; comb /= colsum + eps; then iters - 1 times
    comb /= rowsum + eps, comb /= colsum + eps."""
    sig = lambda v: 1 / (1 + np.exp(-v))
    pre = sig(mixes[:hc] * scale[0] + base[:hc]) + eps
    post = 2 * sig(mixes[hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[2 * hc:] * scale[2] + base[2 * hc:]).reshape(hc, hc)
    comb = np.exp(comb - comb.max(axis=1, keepdims=True))
    comb = comb / comb.sum(axis=1, keepdims=True) + eps
    comb = comb / (comb.sum(axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=0, keepdims=True) + eps)
    return pre, post, comb


class Compressor:
    """model.py Compressor, one token at a time (its decode branch): kv and score rows of the
    current block (score = wgate x + ape[pos % ratio]); at a block's last token, per channel a
    softmax over the block's rows of score weighting kv, with ratio 4 also over the previous
    block's rows through the first half of the projections; then norm, rope at the block's first
    position, and the storage rounding."""

    def __init__(self, ck, prefix, ratio, d, norm_eps, freqs, store):
        self.ratio, self.d = ratio, d
        self.overlap = ratio == 4
        self.wkv = ck.mat(prefix + "compressor.wkv.weight")
        self.wgate = ck.mat(prefix + "compressor.wgate.weight")
        self.ape = ck.vec(prefix + "compressor.ape")
        self.norm = ck.vec(prefix + "compressor.norm.weight")
        self.eps, self.freqs, self.store = norm_eps, freqs, store
        coff = 2 if self.overlap else 1
        self.kv_state = np.zeros((coff * ratio, coff * d))
        self.score_state = np.full((coff * ratio, coff * d), -np.inf)

    def push(self, x, pos):
        r, d = self.ratio, self.d
        kv = self.wkv @ x
        score = self.wgate @ x + self.ape[pos % r]
        if self.overlap:
            self.kv_state[r + pos % r] = kv
            self.score_state[r + pos % r] = score
        else:
            self.kv_state[pos % r] = kv
            self.score_state[pos % r] = score
        if (pos + 1) % r:
            return None
        if self.overlap:
            kvs = np.concatenate([self.kv_state[:r, :d], self.kv_state[r:, d:]])
            scs = np.concatenate([self.score_state[:r, :d], self.score_state[r:, d:]])
            self.kv_state[:r] = self.kv_state[r:]
            self.score_state[:r] = self.score_state[r:]
        else:
            kvs, scs = self.kv_state, self.score_state
        w = np.exp(scs - scs.max(axis=0, keepdims=True))
        w /= w.sum(axis=0, keepdims=True)
        entry = (kvs * w).sum(axis=0)
        entry = rmsnorm(entry, self.norm, self.eps)
        entry = rope(entry, self.freqs, pos + 1 - r)
        return self.store(entry)


class Layer:
    def __init__(self, ck, a, l, kv_cache_dtype, shared_clamp):
        p = f"layers.{l}."
        self.a, self.l, self.ck, self.p = a, l, ck, p
        self.ratio = a.compress_ratios[l]
        self.shared_clamp = shared_clamp
        V = ck.vec
        self.attn_norm, self.ffn_norm = V(p + "attn_norm.weight"), V(p + "ffn_norm.weight")
        self.hc = {k: (V(p + f"hc_{k}_fn"), V(p + f"hc_{k}_scale"), V(p + f"hc_{k}_base")) for k in ("attn", "ffn")}
        M = ck.mat
        self.wq_a, self.q_norm, self.wq_b = M(p + "attn.wq_a.weight"), V(p + "attn.q_norm.weight"), M(p + "attn.wq_b.weight")
        self.wkv, self.kv_norm = M(p + "attn.wkv.weight"), V(p + "attn.kv_norm.weight")
        self.wo_a, self.wo_b = M(p + "attn.wo_a.weight"), M(p + "attn.wo_b.weight")
        self.sink = V(p + "attn.attn_sink")
        rd = a.rope_head_dim
        if self.ratio:
            self.freqs = precompute_freqs(rd, a.original_seq_len, a.compress_rope_theta, a.rope_factor,
                                          a.beta_fast, a.beta_slow)
        else:   # window-only layers: rope_theta without YaRN
            self.freqs = precompute_freqs(rd, 0, a.rope_theta, a.rope_factor, a.beta_fast, a.beta_slow)
        # the cache's storage: the official FP8 simulation of the non-rope values, rope values bf16
        if kv_cache_dtype == "fp8":
            self.store = lambda e: np.concatenate([fp8_act_quant(e[:-rd]), bf16(e[-rd:])])
        elif kv_cache_dtype == "bf16":
            self.store = bf16
        else:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: bf16 or fp8")
        self.window = []          # (position, entry)
        self.entries = []         # compressed entries, in block order
        if self.ratio:
            self.cmp = Compressor(ck, p + "attn.", self.ratio, a.head_dim, a.norm_eps, self.freqs, self.store)
        if self.ratio == 4:
            self.idx_wq_b = M(p + "attn.indexer.wq_b.weight")
            self.idx_w = M(p + "attn.indexer.weights_proj.weight")
            self.idx_cmp = Compressor(ck, p + "attn.indexer.", 4, a.index_head_dim, a.norm_eps, self.freqs,
                                      indexer_lowp)
            self.keys = []
        self.hash = l < a.n_hash_layers
        self.gate = M(p + "ffn.gate.weight")
        if self.hash:
            self.tid2eid = np.asarray(ck.t[p + "ffn.gate.tid2eid"]).astype(np.int64)
            self.bias = None
        else:
            self.bias = V(p + "ffn.gate.bias")

    def hc_pre(self, h, which):
        """Block.hc_pre: mixes = fn . flatten(h) * rsqrt(mean(h^2) + eps); x = sum_j pre_j h_j."""
        fn, scale, base = self.hc[which]
        a = self.a
        flat = h.reshape(-1)
        mixes = fn @ flat / math.sqrt(np.mean(flat * flat) + a.norm_eps)
        pre, post, comb = hc_split_sinkhorn(mixes, scale, base, a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps)
        return pre @ h, post, comb

    @staticmethod
    def hc_post(out, h, post, comb):
        """Block.hc_post: h'_k = post_k out + sum_j comb[j, k] h_j."""
        return post[:, None] * out[None, :] + comb.T @ h

    def attention(self, x, pos, trace):
        a = self.a
        nh, hd, rd = a.n_heads, a.head_dim, a.rope_head_dim
        qr = rmsnorm(self.wq_a @ x, self.q_norm, a.norm_eps)
        q = (self.wq_b @ qr).reshape(nh, hd)
        q = rmsnorm(q, None, a.norm_eps)
        q = rope(q, self.freqs, pos)
        kv = rmsnorm(self.wkv @ x, self.kv_norm, a.norm_eps)
        kv = self.store(rope(kv, self.freqs, pos))
        self.window.append((pos, kv))
        self.window = [(p, e) for p, e in self.window if p > pos - a.window_size]
        keys = [e for _, e in self.window]
        if self.ratio:
            e = self.cmp.push(x, pos)
            if e is not None:
                self.entries.append(e)
            n = (pos + 1) // self.ratio
            assert n == len(self.entries)
            sel = list(range(n))
            if self.ratio == 4:
                iq = (self.idx_wq_b @ qr).reshape(a.index_n_heads, a.index_head_dim)
                iq = indexer_lowp(rope(iq, self.freqs, pos))
                k = self.idx_cmp.push(x, pos)
                if k is not None:
                    self.keys.append(k)
                if n > 0:
                    # Indexer.forward: w = weights_proj(x) * index_head_dim^-1/2 * index_n_heads^-1/2;
                    # score_t = sum_h relu(q_h . k_t) w_h; the top min(index_topk, n)
                    w = (self.idx_w @ x) * (a.index_head_dim ** -0.5 * a.index_n_heads ** -0.5)
                    sc = (np.maximum(np.array(self.keys) @ iq.T, 0) * w).sum(axis=1)
                    sel, margin = topk_lower_first(sc, min(a.index_topk, n))
                    sel = sorted(sel)
                    if margin is not None:
                        trace.setdefault("indexer", []).append((self.l, margin))
            keys += [self.entries[i] for i in sel]
        K = np.array(keys)
        # sparse_attn: softmax over the keys of q.k * head_dim^-1/2 with exp(sink) in the
        # denominator; V = K
        s = q @ K.T * hd ** -0.5
        m = np.maximum(s.max(axis=1), self.sink)
        p = np.exp(s - m[:, None])
        o = (p @ K) / (p.sum(axis=1) + np.exp(self.sink - m))[:, None]
        o = rope(o, self.freqs, pos, inverse=True)
        g = a.o_groups
        o = o.reshape(g, -1)
        wo_a = self.wo_a.reshape(g, a.o_lora_rank, -1)
        oa = np.einsum("gd,grd->gr", o, wo_a).reshape(-1)
        return self.wo_b @ oa

    def expert(self, name, x, clamp):
        """Expert: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L)), no clamp when L = 0."""
        M = self.ck.mat
        cache = name.startswith("shared") or self.a.n_routed_experts <= 64
        w1 = M(self.p + f"ffn.{name}.w1.weight", cache)
        w3 = M(self.p + f"ffn.{name}.w3.weight", cache)
        w2 = M(self.p + f"ffn.{name}.w2.weight", cache)
        g, u = w1 @ x, w3 @ x
        L = self.a.swiglu_limit
        if clamp and L > 0:
            u = np.clip(u, -L, L)
            g = np.minimum(g, L)
        return w2 @ (g / (1 + np.exp(-g)) * u)

    def moe(self, x, token, trace):
        a = self.a
        k = a.n_activated_experts
        # Gate: s = sqrt(softplus(x Wg^T)); the bias only chooses; hash layers take tid2eid
        s = np.sqrt(softplus(self.gate @ x))
        if self.hash:
            ids = self.tid2eid[token]
        else:
            ids, margin = topk_lower_first(s + self.bias, k)
            if margin is not None:
                trace.setdefault("router", []).append((self.l, margin))
        w = s[ids] / s[ids].sum() * a.route_scale
        y = np.zeros_like(x)
        for e, we in sorted(zip(ids.tolist(), w.tolist())):
            y += we * self.expert(f"experts.{e}", x, True)
        if a.n_shared_experts:
            y += self.expert("shared_experts", x, self.shared_clamp)
        return y

    def forward(self, h, pos, token, trace):
        x, post, comb = self.hc_pre(h, "attn")
        x = rmsnorm(x, self.attn_norm, self.a.norm_eps)
        h = self.hc_post(self.attention(x, pos, trace), h, post, comb)
        x, post, comb = self.hc_pre(h, "ffn")
        x = rmsnorm(x, self.ffn_norm, self.a.norm_eps)
        return self.hc_post(self.moe(x, token, trace), h, post, comb)


class Oracle:
    """One sequence through the official forward, token by token."""

    def __init__(self, model_dir, kv_cache_dtype="bf16", shared_clamp=True):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.a = Args(json.load(f))
        self.ck = Checkpoint(model_dir)
        a = self.a
        self.layers = [Layer(self.ck, a, l, kv_cache_dtype, shared_clamp) for l in range(a.n_layers)]
        self.embed = self.ck.t["embed.weight"]
        self.norm = self.ck.vec("norm.weight")
        self.head = self.ck.mat("head.weight")
        self.hc_head = (self.ck.vec("hc_head_fn"), self.ck.vec("hc_head_scale"), self.ck.vec("hc_head_base"))
        self.pos = 0

    def step(self, token):
        """The logits after `token` (float64 [vocab]) and a trace of the near-choices made:
        {"router": [(layer, margin)], "indexer": [(layer, margin)]}."""
        a = self.a
        if not 0 <= token < a.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary [0, {a.vocab_size})")
        trace = {}
        e = np.asarray(self.embed[token], dtype=np.float64)
        h = np.tile(e, (a.hc_mult, 1))
        for L in self.layers:
            h = L.forward(h, self.pos, token, trace)
        # ParallelHead.hc_head: pre = sigmoid(mixes * scale + base) + eps (no Sinkhorn)
        fn, scale, base = self.hc_head
        flat = h.reshape(-1)
        mixes = fn @ flat / math.sqrt(np.mean(flat * flat) + a.norm_eps)
        pre = 1 / (1 + np.exp(-(mixes * scale[0] + base))) + a.hc_eps
        x = rmsnorm(pre @ h, self.norm, a.norm_eps)
        self.pos += 1
        return self.head @ x, trace

    def run(self, ids):
        out, traces = [], []
        for t in ids:
            l, tr = self.step(int(t))
            out.append(l)
            traces.append(tr)
        return np.array(out), traces


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description="float64 oracle of DeepSeek-V4's official forward "
                                             f"(official code at {OFFICIAL_REVISION[:8]})")
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors)")
    ap.add_argument("--ids", required=True, help="comma-separated token ids")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--out", help="write the logits [n, vocab] as float64 .npy")
    o = ap.parse_args(argv)
    ids = [int(v) for v in o.ids.split(",")]
    logits, traces = Oracle(o.model, o.kv_cache_dtype).run(ids)
    for i, l in enumerate(logits):
        print(f"pos {i}: token {ids[i]} -> argmax {int(np.argmax(l))} (logit {l.max():.6f})")
    if o.out:
        np.save(o.out, logits)


if __name__ == "__main__":
    main(sys.argv[1:])
