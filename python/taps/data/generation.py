"""Batched generation with a Llama-family target for training data.

A plain re-implementation of the Llama decoder forward (RMSNorm, GQA attention
with RoPE, SwiGLU MLP, tied or untied LM head) over the weights of an HF
``LlamaForCausalLM``, with what data generation needs and ``generate`` does
not give cheaply:

* one preallocated KV cache ``[B, n_kv, T_max, head_dim]`` per layer, left
  padding (row ``b``'s prompt occupies slots ``start_b .. P-1``);
* finished rows leave the batch: once a quarter of the rows are done the
  cache is compacted to the live rows, so short answers stop costing compute;
* the hidden states of the drafter's target layers (output of decoder layer
  ``id`` = ``hidden_states[id+1]``) of every fed token, captured in place;
* the target's top-k log-probabilities at every generated position
  (distillation targets);
* greedy decoding or sampling at a temperature (``generator`` seeds it).

The reference for this code is the HF model itself:
``tests/test_data_generation.py`` checks that greedy tokens equal
``model.generate`` and that captured features equal ``output_hidden_states``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass
class GenResult:
    """One generated sequence.

    tokens: prompt + response ids (the response ends with ``eos`` unless cut by ``max_new_tokens``).
    prompt_len: number of prompt tokens.
    feats: ``[len(tokens), n_layers*H]`` float16 features of each token (the last token is never fed: zeros),
        or None when no layers were asked.
    topk_ids / topk_logp: ``[len(tokens) - prompt_len, k]`` int64 / float32: the target's top-k next-token
        log-probabilities for each response token (row ``j`` is the distribution response token ``j`` was
        chosen from), or None when ``topk == 0``.
    """

    tokens: List[int]
    prompt_len: int
    feats: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_logp: Optional[torch.Tensor] = None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def generator_for(model, layer_ids: Sequence[int] = (), batch_size: int = 64):
    """The batched generator of ``model``: :class:`taps.data.gguf_generation.GGUFGenerator` for a GGUF-format
    target (``batch_size`` rows in one preallocated cache), else :class:`LlamaGenerator` (HF weights, its own
    batching). ``layer_ids``: decoder layers whose outputs are captured."""
    if getattr(model, "format", None) == "gguf":
        from .gguf_generation import GGUFGenerator

        return GGUFGenerator(model, layer_ids, batch_size=batch_size)
    return LlamaGenerator(model, layer_ids)


class LlamaGenerator:
    """Batched generation over the weights of an HF Llama causal LM (fp32, CPU or CUDA).

    ``model``: ``LlamaForCausalLM`` (or any model with ``model.layers[i].self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, ``input_layernorm``/``post_attention_layernorm``, ``model.norm`` and
    an output embedding). ``layer_ids``: decoder layers whose outputs are captured.
    """

    def __init__(self, model, layer_ids: Sequence[int] = (), dtype: torch.dtype = torch.float32):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in ("llama", "mistral"):
            raise ValueError(f"model: expected a Llama-family causal LM, received model_type "
                             f"{getattr(cfg, 'model_type', None)!r}")
        self.cfg = cfg
        self.nh = cfg.num_attention_heads
        self.nkv = cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps = float(cfg.rms_norm_eps)
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"model: only default RoPE is supported, received {rp.get('rope_type')!r}")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        dev = model.get_input_embeddings().weight.device
        self.device = dev
        self.inv_freq = self.inv_freq.to(dev)

        def w(t):
            return t.detach().to(dtype)

        self.embed = model.get_input_embeddings().weight.detach()
        self.head = w(model.get_output_embeddings().weight)
        self.final_norm = model.model.norm.weight.detach().float()
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            # q, k, v fused in one matrix: one GEMM per layer instead of three
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
            gu = torch.cat([m.gate_proj.weight, m.up_proj.weight], 0)
            self.layers.append((layer.input_layernorm.weight.detach().float(), w(qkv), w(a.o_proj.weight),
                                layer.post_attention_layernorm.weight.detach().float(), w(gu), w(m.down_proj.weight)))
        n = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"layer_ids: {bad} outside [0, {n})")
        self.layer_ids = list(layer_ids)
        self.dtype = dtype

    # ------------------------------------------------------------------ forward
    def _rope(self, pos: torch.Tensor):
        ang = pos.float()[..., None] * self.inv_freq  # [B,L,hd/2]
        emb = torch.cat((ang, ang), -1)[:, None]  # [B,1,L,hd]
        return emb.cos(), emb.sin()

    def _forward(self, x, pos, slot0, kc, vc, key_ok, feats_out):
        """x ``[B,L,H]`` rows at cache slots ``slot0 .. slot0+L-1`` (positions ``pos [B,L]``); key_ok bool
        ``[B,1,L,slot0+L]`` (True = attend). Writes K/V into the caches; returns final hidden ``[B,L,H]``."""
        B, L, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        rep = nh // nkv
        cos, sin = self._rope(pos)
        T = slot0 + L
        bias = torch.zeros(key_ok.shape, dtype=torch.float32, device=x.device).masked_fill_(~key_ok, float("-inf"))
        bias = bias[:, :, None]  # [B,1,1,L,T] -> broadcast over (n_kv, rep)
        scale = 1.0 / (hd ** 0.5)
        cap = 0
        for li, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            h = _rms(x, ln1, self.eps)
            qkv = F.linear(h.to(wqkv.dtype), wqkv).float()
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
            q = q.view(B, L, nh, hd).transpose(1, 2)
            k = k.view(B, L, nkv, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc[li][:, :, slot0:T] = k
            vc[li][:, :, slot0:T] = v.view(B, L, nkv, hd).transpose(1, 2)
            K, V = kc[li][:, :, :T], vc[li][:, :, :T]
            # GQA without repeating K/V: query head g*rep+r uses kv head g; the rep query heads of a kv
            # head are stacked as rows of one matmul (a broadcast K would be copied rep times per layer)
            qg = q.reshape(B, nkv, rep * L, hd)
            s = torch.matmul(qg, K.transpose(-1, -2)).view(B, nkv, rep, L, T) * scale + bias
            p = torch.softmax(s, -1).view(B, nkv, rep * L, T)
            o = torch.matmul(p, V).view(B, nh, L, hd).transpose(1, 2).reshape(B, L, nh * hd)
            x = x + F.linear(o.to(wo.dtype), wo).float()
            h = _rms(x, ln2, self.eps)
            g, u = F.linear(h.to(wgu.dtype), wgu).float().chunk(2, -1)
            x = x + F.linear((F.silu(g) * u).to(wd.dtype), wd).float()
            if feats_out is not None and li in self.layer_ids:
                j = self.layer_ids.index(li)
                H = x.shape[-1]
                feats_out[:, slot0:T, j * H:(j + 1) * H] = x.to(feats_out.dtype)
                cap += 1
        return _rms(x, self.final_norm, self.eps)

    # ---------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int, topk: int = 0,
                 temperature: float = 0.0, generator: Optional[torch.Generator] = None,
                 capture: bool = True, compact_frac: float = 0.25,
                 stop_ids: Sequence[int] = ()) -> List[GenResult]:
        """Generate a continuation of every prompt (one batch, left padded); results in prompt order.

        ``temperature == 0``: greedy; else softmax sampling at that temperature with ``generator``.
        ``topk > 0`` keeps the top-k log-probabilities (temperature 1) of every generated position.
        ``capture``: keep the features of ``layer_ids``. ``stop_ids``: extra ids that end a row.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty token id lists")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, received {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0, received {temperature}")
        st = self._prefill(prompts, max_new_tokens, eos_id, capture, topk)
        stops = torch.tensor([int(eos_id)] + [int(s) for s in stop_ids], device=self.device)
        for step in range(max_new_tokens):
            nxt = self._next_tokens(st, topk, temperature, generator)
            st.done = st.done | torch.isin(nxt, stops)
            last = step == max_new_tokens - 1
            if last or bool(st.done.all()):
                self._finish(st, ~torch.zeros_like(st.done) if last else st.done)
                break
            if int(st.done.sum()) >= max(1, int(compact_frac * len(st.rows))):
                nxt = self._compact(st, nxt)
            self._decode_step(st, nxt)
        return st.results  # type: ignore[return-value]

    def _prefill(self, prompts, max_new_tokens: int, eos_id: int, capture: bool, topk: int) -> "_Batch":
        """The batch's caches, left padded, after the prompts' forward (causal over valid slots; a padding
        query sees itself, so no row is all -inf)."""
        dev = self.device
        B = len(prompts)
        P = max(len(p) for p in prompts)
        Tm = P + max_new_tokens
        nf = len(self.layer_ids) * self.cfg.hidden_size if capture else 0
        ids = torch.full((B, P), int(eos_id), dtype=torch.long)
        start = torch.empty(B, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            start[b] = P - len(p)
        ids, start = ids.to(dev), start.to(dev)
        st = _Batch(prompts=prompts, nf=nf, slots=torch.arange(Tm, device=dev), t=P, start=start,
                    kc=[torch.zeros(B, self.nkv, Tm, self.hd, device=dev) for _ in self.layers],
                    vc=[torch.zeros(B, self.nkv, Tm, self.hd, device=dev) for _ in self.layers],
                    feats=torch.zeros(B, Tm, nf, dtype=torch.float16, device=dev) if nf else None,
                    rows=torch.arange(B, device=dev), done=torch.zeros(B, dtype=torch.bool, device=dev),
                    out_tok=[[] for _ in range(B)], out_ids=[[] for _ in range(B)] if topk else None,
                    out_lp=[[] for _ in range(B)] if topk else None, results=[None] * B)
        slots = st.slots
        pos = (slots[None, :P] - start[:, None]).clamp(min=0)
        valid = slots[None, :P] >= start[:, None]  # [B,P]
        causal = slots[:P, None] >= slots[None, :P]
        ok = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)[None]
        st.hid = self._forward(self.embed[ids].float(), pos, 0, st.kc, st.vc, ok[:, None], st.feats)[:, -1]
        return st

    def _next_tokens(self, st: "_Batch", topk: int, temperature: float, generator) -> torch.Tensor:
        """Each live row's next token ``[b]``, appended (with its top-k) to the rows not yet done."""
        logits = F.linear(st.hid.to(self.head.dtype), self.head).float()  # [b,V]
        if topk:
            lp = torch.log_softmax(logits, -1)
            tv, ti = lp.topk(topk, -1)
            tv, ti = tv.cpu(), ti.cpu()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        nl = nxt.tolist()
        for i, b in enumerate(st.rows.tolist()):
            if not bool(st.done[i]):
                st.out_tok[b].append(nl[i])
                if topk:
                    st.out_ids[b].append(ti[i].to(torch.int32))
                    st.out_lp[b].append(tv[i])
        return nxt

    def _finish(self, st: "_Batch", mask: torch.Tensor) -> None:
        """The :class:`GenResult` of every live row where ``mask`` is set."""
        prompts, nf = st.prompts, st.nf
        for i in mask.nonzero().flatten().tolist():
            b = int(st.rows[i])
            toks = list(prompts[b]) + st.out_tok[b]
            f = None
            if st.feats is not None:
                f = torch.zeros(len(toks), nf, dtype=torch.float16)
                n = len(toks) - 1  # the last token is never fed
                s0 = int(st.start[i])
                f[:n] = st.feats[i, s0:s0 + n].cpu()
            r = GenResult(toks, len(prompts[b]), f)
            if st.out_ids is not None:
                r.topk_ids = torch.stack(st.out_ids[b]).long()
                r.topk_logp = torch.stack(st.out_lp[b]).float()
            st.results[b] = r

    def _compact(self, st: "_Batch", nxt: torch.Tensor) -> torch.Tensor:
        """Finishes the done rows and keeps only the live ones in the caches; returns their next tokens."""
        self._finish(st, st.done)
        keep = (~st.done).nonzero().flatten()
        st.kc = [k.index_select(0, keep) for k in st.kc]
        st.vc = [v.index_select(0, keep) for v in st.vc]
        if st.feats is not None:
            st.feats = st.feats.index_select(0, keep)
        st.rows, st.start = st.rows[keep], st.start[keep]
        st.done = st.done[keep]
        return nxt[keep]

    def _decode_step(self, st: "_Batch", nxt: torch.Tensor) -> None:
        """Feeds one token per live row at slot ``st.t``."""
        t = st.t
        x = self.embed[nxt][:, None].float()
        pos = (t - st.start)[:, None]
        ok = (st.slots[None, :t + 1] >= st.start[:, None])[:, None, None]  # [b,1,1,t+1]
        st.hid = self._forward(x, pos, t, st.kc, st.vc, ok, st.feats)[:, -1]
        st.t += 1


@dataclass
class _Batch:
    """The state of one :meth:`LlamaGenerator.generate` call. ``rows``: original index of each live row;
    ``start``: its first slot; ``t``: the next slot; ``hid``: the last fed token's final hidden ``[b,H]``."""

    prompts: Sequence[Sequence[int]]
    nf: int  # feature width (0: no capture)
    slots: torch.Tensor
    t: int
    start: torch.Tensor
    kc: List[torch.Tensor]
    vc: List[torch.Tensor]
    feats: Optional[torch.Tensor]
    rows: torch.Tensor
    done: torch.Tensor
    out_tok: List[List[int]]
    out_ids: Optional[List[list]]
    out_lp: Optional[List[list]]
    results: List[Optional[GenResult]]
    hid: Optional[torch.Tensor] = None
