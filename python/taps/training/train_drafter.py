"""``train-drafter``: DFlash drafter training on ``build-data`` shards.

Recipe (METHOD.md section 2): random anchors in the response part of each
target-regenerated sequence; the block ``[x[a], MASK x (S-1)]`` predicts
``x[a+1..a+S-1]`` in one pass; blocks are isolated from one another and see
the clean target features of positions ``< a``; the target's embeddings and
LM head are frozen (borrowed, never trained); position-decayed cross-entropy
``w_k = exp(-(k-1)/gamma)``; AdamW with linear warmup and cosine decay.

Target features come from the shards (captured during generation), so no
target forward runs during training. Training is resumable: ``<out>/ckpt.pt``
is written every ``save_every`` steps (model, optimiser, step, RNG states),
and ``<out>/drafter`` (config.json + bf16 model.safetensors) alongside.
New shards written by a still-running ``build-data`` are picked up every
``rescan_every`` steps.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, List, Optional

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from taps.models.drafter import DFlashConfig, DFlashDrafter
from taps.paths import portable_record

DEFAULT_MASK_TOKEN_ID = 16  # SmolLM2 '<empty_output>': a special token never produced in chat


class ShardData:
    """Memory-mapped view of the shards (holding out ``holdout`` shard indices)."""

    def __init__(self, data_dir: str, holdout: Optional[List[int]] = None, only: Optional[List[int]] = None):
        self.dir = Path(data_dir)
        self.holdout = set(holdout or [])
        self.only = set(only) if only is not None else None
        self.shards = {}
        self.index = []  # (shard_idx, seq_idx)
        self.lengths = []  # tokens (prompt + response) of each index entry
        self._by_length: List[int] = []
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.rescan()

    def rescan(self) -> int:
        added = 0
        for p in sorted(self.dir.glob("shard_*.pt")):
            s = int(p.stem.split("_")[1])
            if s in self.shards or s in self.holdout or (self.only is not None and s not in self.only):
                continue
            try:
                blob = torch.load(str(p), mmap=True, weights_only=True)
            except Exception:
                continue
            self.shards[s] = blob
            n = len(blob["prompt_lens"])
            for i in range(n):
                off = blob["offsets"]
                L = int(off[i + 1] - off[i])
                if L - int(blob["prompt_lens"][i]) >= 2:
                    self.index.append((s, i))
                    self.lengths.append(L)
            added += 1
        return added

    def by_length(self) -> List[int]:
        """Index entries in order of length (recomputed after a rescan added some)."""
        if len(self._by_length) != len(self.index):
            self._by_length = sorted(range(len(self.index)), key=self.lengths.__getitem__)
        return self._by_length

    def __len__(self):
        return len(self.index)

    def get(self, k: int, max_len: Optional[int] = None):
        """(tokens int64 [L], feats [L,F], prompt_len) of sequence ``k`` (cut to ``max_len`` tokens)."""
        s, i = self.index[k]
        b = self.shards[s]
        o0, o1 = int(b["offsets"][i]), int(b["offsets"][i + 1])
        if max_len is not None:
            o1 = min(o1, o0 + max_len)
        toks = b["tokens"][o0:o1].long()
        feats = b["feats"][o0:o1]
        return toks, feats, int(b["prompt_lens"][i])

    def get_topk(self, k: int, length: int):
        """(ids int64 [R,k], logp float32 [R,k]) for the response tokens of sequence ``k`` among its first
        ``length`` tokens (row j = response token j), or None when the shard has no top-k."""
        s, i = self.index[k]
        b = self.shards[s]
        if "topk_ids" not in b:
            return None
        r0, r1 = int(b["topk_offsets"][i]), int(b["topk_offsets"][i + 1])
        r1 = min(r1, r0 + max(0, length - int(b["prompt_lens"][i])))
        return b["topk_ids"][r0:r1].long(), b["topk_logp"][r0:r1].float()

    def kind(self, k: int) -> Optional[str]:
        """Prompt kind of sequence ``k`` when the shard records it (format 2)."""
        s, i = self.index[k]
        kinds = self.shards[s].get("kinds")
        return kinds[i] if kinds is not None else None

    @property
    def has_topk(self) -> bool:
        return bool(self.shards) and all("topk_ids" in b for b in self.shards.values())

    def response_vocab(self, vocab_size: int) -> torch.Tensor:
        """Bool [V]: tokens that occur in any response (or prompt) of the loaded shards."""
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        for b in self.shards.values():
            seen[b["tokens"].long().clamp(0, vocab_size - 1)] = True
        return seen

    def token_counts(self):
        tot = resp = 0
        for s, b in self.shards.items():
            tot += int(b["tokens"].numel())
            resp += int(b["tokens"].numel() - b["prompt_lens"].sum())
        return tot, resp


def make_batch(samples, block_size: int, anchors_per_seq: int, mask_token_id: int, rng: random.Random,
               full_blocks_only: bool = False, topk=None):
    """samples: list of (tokens [L], feats [L,F], prompt_len).
    Returns feats [B,T,F] float32, block_ids [B,M,S], anchors [B,M] (-1 pad),
    labels [B,M,S-1] (-100 where beyond the sequence).

    ``topk``: per sample (ids [R,k], logp [R,k]) of its response tokens (row j = token prompt_len + j), or
    None; then two more tensors are returned: soft_ids [B,M,S-1,k] int64 (-1 where no label) and
    soft_logp [B,M,S-1,k] float32, the target's top-k at each label position."""
    S = block_size
    B = len(samples)
    T = max(len(t) for t, _, _ in samples)
    Fdim = samples[0][1].shape[-1]
    M = anchors_per_seq
    feats = torch.zeros(B, T, Fdim, dtype=torch.float32)
    block_ids = torch.full((B, M, S), mask_token_id, dtype=torch.long)
    anchors = torch.full((B, M), -1, dtype=torch.long)
    labels = torch.full((B, M, S - 1), -100, dtype=torch.long)
    if topk is not None:
        kk = topk[0][0].shape[1]
        soft_ids = torch.full((B, M, S - 1, kk), -1, dtype=torch.long)
        soft_lp = torch.zeros((B, M, S - 1, kk), dtype=torch.float32)
    for b, (toks, f, pl) in enumerate(samples):
        L = len(toks)
        feats[b, :L] = f.float()
        hi = L - S if full_blocks_only else L - 2  # anchor a needs a label at a+1
        lo = max(pl, 1)
        if hi < lo:
            continue
        cand = list(range(lo, hi + 1))
        chosen = sorted(rng.sample(cand, min(M, len(cand))))
        for m, a in enumerate(chosen):
            anchors[b, m] = a
            block_ids[b, m, 0] = toks[a]
            lab = toks[a + 1: a + S]
            labels[b, m, : len(lab)] = lab
            if topk is not None:
                ti, tl = topk[b]
                j0 = a + 1 - pl  # response row of label a+1 (a >= pl, so j0 >= 1)
                n = max(0, min(len(lab), ti.shape[0] - j0))
                soft_ids[b, m, :n] = ti[j0:j0 + n]
                soft_lp[b, m, :n] = tl[j0:j0 + n]
    if topk is not None:
        return feats, block_ids, anchors, labels, soft_ids, soft_lp
    return feats, block_ids, anchors, labels


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_loss(drafter, lm_head, embed_tokens, batch, weights, autocast: bool,
               vocab_subset: Optional[torch.Tensor] = None, kl_weight: float = 0.0, logits_fn=None):
    """Position-decayed CE over valid label rows (+ ``kl_weight`` x distillation). Returns (loss, stats).

    ``batch``: what :func:`make_batch` returns, ``(feats, block_ids, anchors, labels)`` or, with the
    target's top-k, ``(feats, block_ids, anchors, labels, soft_ids, soft_logp)``.
    ``vocab_subset`` (sorted int64 token ids, must contain every label and every top-k id): the
    softmax runs over these rows of the frozen LM head only (a sampled-softmax
    speed-up for CPU training; evaluation always uses the full vocabulary).
    ``soft_ids``/``soft_logp`` ``[B,M,S-1,k]``: the target's top-k log-probabilities at each label; the
    distillation term is the cross-entropy of the drafter to the target's top-k distribution renormalised
    over its k ids (= KL to it up to a constant), position-weighted like the CE.
    ``logits_fn``: :func:`block_logits` (default) or a compiled copy of it (``TrainConfig.compile``).
    Statistics (accuracy per position, tau of the argmax chain) count a position as a hit when its label's
    logit is the row's maximum."""
    feats, block_ids, anchors, labels = batch[:4]
    soft_ids, soft_logp = batch[4:] if len(batch) > 4 else (None, None)
    valid = labels >= 0
    W = lm_head.weight if vocab_subset is None else lm_head.weight.index_select(0, vocab_subset)
    y = labels.clamp(min=0)
    if vocab_subset is not None:
        y = torch.searchsorted(vocab_subset, y)
    w = weights.to(feats.device)[None, None, :] * valid.float()
    cols = soft = wk = None
    if kl_weight > 0 and soft_ids is not None:
        cols, soft = soft_ids.clamp(min=0), soft_logp
        if vocab_subset is not None:
            cols = torch.searchsorted(vocab_subset, cols)
        wk = w * (soft_ids[..., 0] >= 0).float()
    logits = (logits_fn or block_logits)(drafter, W, embed_tokens, feats, block_ids, anchors, autocast)
    loss, ce, kl = _loss_terms(logits, y, w, cols, soft, wk, float(kl_weight))
    with torch.no_grad():
        logits = logits.detach()
        hit = (logits.gather(-1, y[..., None])[..., 0] >= logits.amax(-1)) & valid
        pos_acc = (hit.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)).tolist()
        # tau of the argmax chain: 1 + consecutive hits from position 1 (only complete runs count)
        run = torch.cumprod(hit.long(), dim=-1).sum(-1)
        has = anchors >= 0
        tau = float((1 + run[has].float()).mean()) if has.any() else 0.0
        ce_mean = float(ce[valid].mean()) if valid.any() else 0.0
    return loss, {"ce": ce_mean, "kl": None if kl is None else float(kl), "pos_acc": pos_acc, "tau": tau,
                  "rows": int(valid.sum())}


def block_logits(drafter, W, embed_tokens, feats, block_ids, anchors, autocast: bool) -> torch.Tensor:
    """The drafter's logits over ``W`` ``[V', H]`` (the LM head rows the softmax runs over) at every block row
    but the bonus row: float32 ``[B,M,S-1,V']``. No shape depends on the data, so ``torch.compile`` takes it as
    one graph (``TrainConfig.compile``)."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        h = drafter.forward_blocks(feats, block_ids, anchors, embed_tokens)[:, :, 1:]  # [B,M,S-1,H]
        logits = F.linear(h if autocast else h.to(W.dtype), W)
    return logits.float()


def _loss_terms(logits, y, w, cols, soft_logp, wk, kl_weight: float):
    """Weighted CE (+ ``kl_weight`` x distillation) from ``logits`` ``[B,M,S-1,V']``: ``y`` label columns, ``w``
    row weights (0 where no label); ``cols``/``soft_logp``/``wk``: the target's top-k columns, log-probabilities
    and row weights (or None). Returns ``(loss, ce [B,M,S-1] detached, kl or None)``.

    Eager, not compiled: inductor's fused cross-entropy walked the ~900 x 6,000 logits column by column (~45 ms
    a step on one thread against aten's ~20)."""
    ce = F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none").view_as(y)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    kl = None
    if cols is not None:
        ls = torch.log_softmax(logits, -1).gather(-1, cols)  # student log-probs of the target's top-k
        q = torch.softmax(soft_logp, -1)
        kl_rows = (q * (torch.log(q.clamp(min=1e-12)) - ls)).sum(-1)  # KL(q || student) on the top-k ids
        kl = (kl_rows * wk).sum() / wk.sum().clamp(min=1e-6)
        loss = loss + kl_weight * kl
        kl = kl.detach()
    return loss, ce.detach(), kl


def feature_scale_from_data(ds: "ShardData", max_tokens: int = 200_000) -> torch.Tensor:
    """1 / RMS of every context-feature channel over the loaded shards (first
    token of each sequence, the attention-sink row, excluded)."""
    acc = None
    n = 0
    for s, b in sorted(ds.shards.items()):
        f = b["feats"].float()
        keep = torch.ones(len(f), dtype=torch.bool)
        keep[b["offsets"][:-1]] = False
        keep[b["offsets"][1:] - 1] = False
        f = f[keep]
        acc = f.pow(2).sum(0) if acc is None else acc + f.pow(2).sum(0)
        n += len(f)
        if n >= max_tokens:
            break
    rms = (acc / max(n, 1)).sqrt()
    return 1.0 / rms.clamp(min=1e-2)


def _init_weights(model: DFlashDrafter, std: float = 0.02):
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=std)


def _lr_at(step, total, warmup, base, min_ratio=0.1, time_frac=0.0):
    """Linear warmup, then cosine to ``min_ratio*base``; progress is the larger of
    the step fraction and ``time_frac`` (elapsed / time budget), so a run with a
    wall-clock budget ends its schedule on time whatever the throughput."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, max((step - warmup) / max(1, total - warmup), time_frac))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _save(out: Path, drafter, opt, step, rng, extra):
    tmp = out / "ckpt.pt.tmp"
    torch.save({"model": drafter.state_dict(), "feat_scale": drafter.feature_scale, "opt": opt.state_dict(), "step": step,
                "py_rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "extra": extra,
                "config": drafter.config.to_dict()}, tmp)
    os.replace(tmp, out / "ckpt.pt")
    drafter.save_pretrained(out / "drafter", dtype=torch.bfloat16)


# A layer's writes to the residual stream; zeroed, the layer adds nothing, so a drafter grown by such a layer
# starts as exactly the function of the one it came from and training decides what the new layer does.
_RESIDUAL_WRITES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def keep_layers(state_dict: dict, keep: List[int], num_layers: int) -> dict:
    """A drafter state dict with layers ``keep`` (in that order, renumbered ``0..len(keep)-1``); every other
    tensor unchanged. A repeated index adds a layer: a copy of that layer whose residual writes (attention
    output and MLP down projections) start at zero, so the deeper drafter starts as the parent's function
    (``[0, 1, 1]``: a third layer after the parent's last)."""
    if not keep or not all(0 <= k < num_layers for k in keep):
        raise ValueError(f"init_layers: expected layer indices in [0, {num_layers}), received {keep}")
    layers = {}
    for name, t in state_dict.items():
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            layers.setdefault(int(idx), {})[rest] = t
    out = {name: t for name, t in state_dict.items() if not name.startswith("layers.")}
    for new, old in enumerate(keep):
        grown = old in keep[:new]
        for rest, t in layers[old].items():
            out[f"layers.{new}.{rest}"] = torch.zeros_like(t) if grown and rest in _RESIDUAL_WRITES else t
    return out


@dataclass
class TrainConfig:
    """Options of :func:`train_drafter` (``train-drafter`` on the command line).

    ``init_from``: a drafter directory whose weights (and architecture, but ``block_size``) a NEW run starts
    from (a run that finds ``<out>/ckpt.pt`` resumes from it instead, architecture and block size included, and
    reads neither ``init_from``, ``num_layers`` nor ``block_size``);
    ``init_layers``: comma list of its layer indices to keep, in order (a shallower, cheaper drafter that starts
    from trained layers; default all); a repeated index adds a layer that starts as the identity (a deeper
    drafter that starts as the parent's function, see :func:`keep_layers`). ``kl_weight`` > 0 adds the
    distillation term to the target's top-k (needs data with top-k). ``holdout_shards``: comma list of shard
    indices never trained on.
    ``compile``: the forward up to the logits (:func:`block_logits`) through ``torch.compile`` (inductor; needs a
    C++ compiler): the first step compiles, later ones run faster (``bench/bench_train_speed.py``).
    ``bucket_by_length``: a batch is drawn from a window of ``4 * batch_size`` sequences of similar length (less
    padding for the context rows), not uniformly.
    """

    data: str
    out: str
    target: str = "smollm2"
    num_layers: int = 3
    intermediate_size: int = 1536
    block_size: int = 16
    gamma: float = 7.0
    anchors_per_seq: int = 16
    batch_size: int = 8
    max_seq_len: int = 640
    steps: int = 4000
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    save_every: int = 200
    holdout_shards: str = "0"
    bf16: bool = False
    seed: int = 0
    threads: Optional[int] = None
    max_minutes: Optional[float] = None
    mask_token_id: Optional[int] = None
    rescan_every: int = 100
    log_every: int = 10
    train_vocab: str = "seen"
    extra_negatives: int = 4096
    normalize_features: bool = True
    norm_lr_mult: float = 10.0
    init_from: Optional[str] = None
    init_layers: Optional[str] = None
    kl_weight: float = 0.0
    min_lr_ratio: float = 0.1
    compile: bool = False
    bucket_by_length: bool = False

    def __post_init__(self):
        if self.train_vocab not in ("seen", "full"):
            raise ValueError(f"train_vocab: expected 'seen' or 'full', received {self.train_vocab!r}")
        for name in ("num_layers", "intermediate_size", "anchors_per_seq", "batch_size", "max_seq_len", "steps",
                     "save_every", "rescan_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, received {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size: expected >= 2, received {self.block_size}")
        if self.kl_weight < 0:
            raise ValueError(f"kl_weight: expected >= 0, received {self.kl_weight}")
        if self.init_layers is not None:
            if self.init_from is None:
                raise ValueError("init_layers: needs init_from (the drafter whose layers are kept)")
            try:
                [int(x) for x in str(self.init_layers).split(",")]
            except ValueError:
                raise ValueError(f"init_layers: expected a comma list of layer indices, received "
                                 f"{self.init_layers!r}") from None
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            raise ValueError(f"init_from: expected a drafter directory with config.json, received {self.init_from!r}")


def train_drafter(cfg: TrainConfig):
    """Train (or resume) a drafter as configured; returns the drafter. See the module docstring."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg: expected TrainConfig, received {type(cfg).__name__}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    outp = Path(cfg.out)
    outp.mkdir(parents=True, exist_ok=True)
    holdout = [int(x) for x in str(cfg.holdout_shards).split(",") if x.strip()] if cfg.holdout_shards else []
    ds = ShardData(cfg.data, holdout=holdout)
    tmodel = _frozen_target(cfg.target)
    fresh = _fresh_config(cfg, tmodel.config, ds.meta)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    ck = outp / "ckpt.pt"
    st = torch.load(str(ck), weights_only=False) if ck.exists() else None
    model = _make_drafter(cfg, tmodel, fresh, ds.meta, st)
    opt = _optimizer(cfg, model.drafter)
    run = _restore(st, model.drafter, opt, rng, ck)
    _write_train_config(cfg, outp, model, ds, holdout)
    _train_loop(cfg, model, ds, opt, rng, run, outp)
    summary = {"step": run.step, "train_seconds": round(run.extra["train_seconds"], 1),
               "blocks_seen": run.extra["blocks_seen"], "rows_seen": run.extra["rows_seen"], "train_seqs": len(ds),
               "tokens_all_response": ds.token_counts()}
    (outp / "train_summary.json").write_text(json.dumps(portable_record(summary), indent=1))
    print(json.dumps(summary), flush=True)
    return model.drafter


@dataclass
class _Drafter:
    """The drafter in training with what its loss reads: its architecture (the checkpoint's when a run
    resumes, the parent's when it starts from one) and the frozen target's input embeddings and LM head."""

    drafter: DFlashDrafter
    config: DFlashConfig
    embed: torch.nn.Module
    head: torch.nn.Module
    logits_fn: Callable = block_logits  # or its torch.compile'd copy (TrainConfig.compile)


@dataclass
class _Progress:
    """What the step loop carries from one step to the next (``extra`` goes into every checkpoint)."""

    step: int
    extra: dict
    resumed: bool
    seg_t: float = 0.0  # start of the time segment not yet added to extra["train_seconds"]
    ema: Optional[float] = None
    seen_vocab: Optional[torch.Tensor] = None


def _frozen_target(name: str):
    """The target model with every parameter frozen (its embeddings and LM head are borrowed)."""
    from taps.models.target import load_target

    tmodel, _ = load_target(name)
    for p in tmodel.parameters():
        p.requires_grad_(False)
    return tmodel


def _fresh_config(cfg: TrainConfig, tc, meta: dict) -> DFlashConfig:
    """The architecture of a new drafter for target config ``tc`` reading the data's layers."""
    mask_id = DEFAULT_MASK_TOKEN_ID if cfg.mask_token_id is None else cfg.mask_token_id
    return DFlashConfig(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                        num_key_value_heads=tc.num_key_value_heads,
                        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                        rms_norm_eps=float(tc.rms_norm_eps),
                        rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 100000.0)),
                        vocab_size=tc.vocab_size, block_size=cfg.block_size, num_target_layers=tc.num_hidden_layers,
                        target_layer_ids=list(meta["layer_ids"]), mask_token_id=mask_id,
                        max_position_embeddings=tc.max_position_embeddings)


def _make_drafter(cfg: TrainConfig, tmodel, fresh: DFlashConfig, meta: dict, st: Optional[dict]) -> _Drafter:
    """The drafter to train, in train mode: the checkpoint's architecture (``st``), else the parent's layers
    (``cfg.init_from``), else ``fresh`` with new weights (output norm started at the target's final norm)."""
    dcfg = fresh
    if st is not None and st.get("config"):
        # the checkpoint carries its architecture: a resumed run needs neither init_from nor the parent it named
        dcfg = DFlashConfig.from_dict(st["config"])
        drafter = DFlashDrafter(dcfg)
    elif cfg.init_from is not None:
        dcfg, drafter = _drafter_from_parent(cfg, tmodel.config, meta)
    else:
        drafter = DFlashDrafter(dcfg)
        _init_weights(drafter)
        tnorm = getattr(getattr(tmodel, "model", None), "norm", None)
        if tnorm is not None and tnorm.weight.shape == drafter.norm.weight.shape:
            with torch.no_grad():  # start the output norm where the target's final norm is (same LM head)
                drafter.norm.weight.copy_(tnorm.weight.float())
    drafter.train()
    # inductor fuses the forward's elementwise passes around the GEMMs (masks, softmax, norms, RoPE, casts), which
    # take most of an eager bf16 step on one thread
    logits_fn = torch.compile(block_logits, dynamic=True) if cfg.compile else block_logits
    return _Drafter(drafter, dcfg, tmodel.get_input_embeddings(), tmodel.get_output_embeddings(), logits_fn)


def _drafter_from_parent(cfg: TrainConfig, tc, meta: dict):
    """``(config, drafter)`` started from ``cfg.init_from``: its architecture with ``cfg.block_size``, its
    layers ``cfg.init_layers`` (default all) and the full vocabulary."""
    from taps.models.drafter import load_drafter

    init = load_drafter(cfg.init_from, target_config=tc)
    if list(init.config.target_layer_ids) != list(meta["layer_ids"]):
        raise ValueError(f"init_from: drafter reads target layers {init.config.target_layer_ids}, the data "
                         f"holds {meta['layer_ids']}")
    dcfg = DFlashConfig.from_dict(init.config.to_dict())
    dcfg.draft_vocab_size = None
    dcfg.extra.pop("draft_vocab_file", None)
    dcfg.block_size = cfg.block_size
    keep = list(range(dcfg.num_hidden_layers)) if cfg.init_layers is None else \
        [int(x) for x in str(cfg.init_layers).split(",")]
    state = keep_layers(init.state_dict(), keep, dcfg.num_hidden_layers)
    dcfg.num_hidden_layers = len(keep)
    drafter = DFlashDrafter(dcfg)
    drafter.load_state_dict(state)
    print(f"initialised from {cfg.init_from} ({dcfg.num_hidden_layers} layers)", flush=True)
    return dcfg, drafter


def _optimizer(cfg: TrainConfig, drafter: DFlashDrafter) -> torch.optim.AdamW:
    """AdamW; the RMSNorm gains (no weight decay) at ``cfg.norm_lr_mult`` times the learning rate."""
    # RMSNorm gains get a larger learning rate: q_norm/k_norm gains set the attention
    # temperature (q and k are unit-RMS), and at lr ~1e-3 they take ~1000 steps to
    # move from 1 to 2, which keeps attention over the context nearly uniform.
    decay = [p for n, p in drafter.named_parameters() if not n.endswith("norm.weight")]
    nodecay = [p for n, p in drafter.named_parameters() if n.endswith("norm.weight")]
    # fused: one pass over each parameter's state (8.7M parameters on one thread: 11 ms a step, 43 for foreach)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
                              {"params": nodecay, "weight_decay": 0.0, "lr_mult": cfg.norm_lr_mult}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def _restore(st: Optional[dict], drafter: DFlashDrafter, opt, rng: random.Random, ck: Path) -> _Progress:
    """The loop's starting point: step 0, or the checkpoint ``st`` (weights, optimiser, step, RNG states,
    counters and feature scale put back)."""
    run = _Progress(step=0, extra={"train_seconds": 0.0, "blocks_seen": 0, "rows_seen": 0}, resumed=st is not None)
    if st is not None:
        drafter.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        run.step = st["step"]
        rng.setstate(st["py_rng"])
        torch.set_rng_state(st["torch_rng"])
        run.extra.update(st.get("extra", {}))
        drafter.set_feature_scale(st.get("feat_scale"))
        print(f"resumed from {ck} at step {run.step}", flush=True)
    return run


def _write_train_config(cfg: TrainConfig, outp: Path, model: _Drafter, ds: ShardData, holdout: List[int]) -> None:
    """``train_config.json``: the options, the held-out shards, the mask id and the drafter's architecture."""
    nparams = sum(p.numel() for p in model.drafter.parameters())
    (outp / "train_config.json").write_text(json.dumps(portable_record(dict(
        asdict(cfg), holdout_shards=holdout, mask_token_id=model.config.mask_token_id, params=nparams,
        drafter_config=model.config.to_dict())), indent=1))
    print(f"drafter params {nparams/1e6:.2f}M, train seqs {len(ds)}, tokens {ds.token_counts()}", flush=True)


def _train_loop(cfg: TrainConfig, model: _Drafter, ds: ShardData, opt, rng: random.Random, run: _Progress,
                outp: Path) -> None:
    """Steps until ``cfg.steps`` (or ``cfg.max_minutes``), logging every ``log_every`` steps and checkpointing
    every ``save_every`` and at the end."""
    from tqdm import tqdm

    weights = position_weights(model.config.block_size, cfg.gamma)
    with open(outp / "train_log.jsonl", "a") as log:
        pbar = tqdm(total=cfg.steps, initial=run.step, desc="train-drafter", unit="step")
        run.seg_t = time.time()
        while run.step < cfg.steps:
            if cfg.max_minutes is not None and run.extra["train_seconds"] + time.time() - run.seg_t > cfg.max_minutes * 60:
                print("time limit reached", flush=True)
                break
            if run.step % cfg.rescan_every == 0:
                _rescan(cfg, ds, model.config.vocab_size, run)
            if len(ds) == 0:
                time.sleep(10)
                continue
            if cfg.normalize_features and model.drafter.feature_scale is None and cfg.init_from is None \
                    and not run.resumed:
                model.drafter.set_feature_scale(feature_scale_from_data(ds))
                print("feature scale set from data (folded into fc.weight on save)", flush=True)
            loss, stats, gn, cur_lr = _train_step(cfg, model, ds, opt, rng, run, weights)
            lv = loss.item()
            run.ema = lv if run.ema is None else 0.95 * run.ema + 0.05 * lv
            pbar.update(1)
            pbar.set_postfix(loss=f"{run.ema:.3f}", acc1=f"{stats['pos_acc'][0]:.2f}", tau=f"{stats['tau']:.2f}")
            if run.step % cfg.log_every == 0:
                _log_step(log, run, loss, stats, gn, cur_lr)
            if run.step % cfg.save_every == 0:
                _save(outp, model.drafter, opt, run.step, rng, run.extra)
    run.extra["train_seconds"] += time.time() - run.seg_t
    _save(outp, model.drafter, opt, run.step, rng, run.extra)
    pbar.close()


def _rescan(cfg: TrainConfig, ds: ShardData, vocab_size: int, run: _Progress) -> None:
    """Picks up new shards; with ``train_vocab="seen"`` the softmax's token set follows the data."""
    if ds.rescan() or run.seen_vocab is None:
        print(f"step {run.step}: {len(ds)} train seqs, tokens (all, response) {ds.token_counts()}", flush=True)
        if cfg.train_vocab == "seen":
            run.seen_vocab = ds.response_vocab(vocab_size)
            print(f"  training softmax over {int(run.seen_vocab.sum())} seen tokens + {cfg.extra_negatives} random",
                  flush=True)


def _train_step(cfg: TrainConfig, model: _Drafter, ds: ShardData, opt, rng: random.Random, run: _Progress,
                weights: torch.Tensor):
    """One optimiser step on a random batch; returns ``(loss, stats, grad norm, learning rate)``."""
    tf = 0.0
    if cfg.max_minutes:
        tf = (run.extra["train_seconds"] + time.time() - run.seg_t) / (cfg.max_minutes * 60)
    cur_lr = _lr_at(run.step, cfg.steps, cfg.warmup, cfg.lr, min_ratio=cfg.min_lr_ratio, time_frac=tf)
    for g in opt.param_groups:
        g["lr"] = cur_lr * g.get("lr_mult", 1.0)
    batch = _sample_batch(cfg, model.config, ds, rng)
    subset = _vocab_subset(cfg, model.config.vocab_size, run.seen_vocab, batch)
    loss, stats = block_loss(model.drafter, model.head, model.embed, batch, weights, cfg.bf16, vocab_subset=subset,
                             kl_weight=cfg.kl_weight, logits_fn=model.logits_fn)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.drafter.parameters(), 1.0)
    opt.step()
    run.step += 1
    run.extra["blocks_seen"] += int((batch[2] >= 0).sum())
    run.extra["rows_seen"] += stats["rows"]
    return loss, stats, gn, cur_lr


def _sample_batch(cfg: TrainConfig, dcfg: DFlashConfig, ds: ShardData, rng: random.Random):
    """:func:`make_batch` of ``cfg.batch_size`` random sequences (with the target's top-k when
    ``cfg.kl_weight`` > 0)."""
    if cfg.bucket_by_length and len(ds) > cfg.batch_size:
        # a random window of 4 x batch_size sequences adjacent in length: the batch pads to its longest, and the
        # context projection, its K/V and the attention's keys run over the padding too
        order = ds.by_length()
        width = min(len(order), 4 * cfg.batch_size)
        lo = min(max(0, rng.randrange(len(order)) - width // 2), len(order) - width)
        keys = [order[lo + j] for j in rng.sample(range(width), cfg.batch_size)]
    else:
        keys = [rng.randrange(len(ds)) for _ in range(cfg.batch_size)]
    samples = [ds.get(k, cfg.max_seq_len) for k in keys]
    topk = None
    if cfg.kl_weight > 0:
        topk = [ds.get_topk(k, len(sm[0])) for k, sm in zip(keys, samples)]
        if any(t is None for t in topk):
            raise ValueError("kl_weight > 0 needs data with top-k log-probabilities (build-data --topk)")
    return make_batch(samples, dcfg.block_size, cfg.anchors_per_seq, dcfg.mask_token_id, rng, topk=topk)


def _vocab_subset(cfg: TrainConfig, vocab_size: int, seen_vocab: Optional[torch.Tensor], batch):
    """The sorted token ids the training softmax runs over (None: the full vocabulary): the seen tokens,
    ``cfg.extra_negatives`` random ones, and every label and top-k id of ``batch``."""
    if seen_vocab is None:
        return None
    sel = seen_vocab.clone()
    if cfg.extra_negatives:
        sel[torch.randint(0, vocab_size, (cfg.extra_negatives,))] = True
    labels = batch[3]
    sel[labels[labels >= 0]] = True
    if len(batch) > 4:
        soft_ids = batch[4]
        sel[soft_ids[soft_ids >= 0]] = True
    return sel.nonzero().squeeze(1)


def _log_step(log, run: _Progress, loss, stats: dict, gn, cur_lr: float) -> None:
    """One ``train_log.jsonl`` row; closes the current time segment."""
    now = time.time()
    run.extra["train_seconds"] += now - run.seg_t
    run.seg_t = now
    log.write(json.dumps({"step": run.step, "loss": round(float(loss.detach()), 4), "loss_ema": round(run.ema, 4),
                          "ce": round(stats["ce"], 4), "kl": None if stats["kl"] is None else round(stats["kl"], 4),
                          "lr": cur_lr, "grad_norm": round(float(gn), 3), "tau": round(stats["tau"], 3),
                          "acc": [round(a, 3) for a in stats["pos_acc"][:15]],
                          "train_seconds": round(run.extra["train_seconds"], 3), "rows_seen": run.extra["rows_seen"],
                          "blocks_seen": run.extra["blocks_seen"],
                          "wall": time.strftime("%H:%M:%S")}) + "\n")
    log.flush()
