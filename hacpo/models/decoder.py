"""A small decoder-only transformer in plain torch, with a KV cache for incremental decoding.

Pre-norm (RMSNorm), rotary position embeddings, SwiGLU MLP, tied input/output embeddings.
Positions are passed in explicitly (``position_ids [B, L]``), so left-padded batches and
per-row offsets are handled by the caller (see :mod:`hacpo.models.generation`).

Shapes: ``B`` batch, ``L`` new tokens this call, ``S`` cache length, ``D`` d_model,
``H`` heads, ``Dh`` head dim, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DecoderConfig:
    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None  # default: about 8/3 * d_model, rounded up to a multiple of 8
    max_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dim must be even for rotary embeddings")
        if self.d_ff is None:
            self.d_ff = -(-8 * self.d_model // 3 // 8) * 8


class KVCache:
    """Preallocated per-layer key/value buffers ``[B, H, S_max, Dh]``.

    ``key_mask [B, S_max]`` marks which cache slots hold real tokens (False for left padding
    and for slots not written yet); ``length`` is the number of slots written so far (the same
    for every row: rows are aligned by left padding). Only slots below ``length`` are ever
    read (those past it may hold anything, see :meth:`repeat_interleave`).
    """

    def __init__(self, cfg: DecoderConfig, batch: int, max_len: int, *, dtype, device):
        shape = (batch, cfg.n_heads, max_len, cfg.d_model // cfg.n_heads)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.max_len = max_len

    def reorder(self, index: torch.Tensor) -> None:
        """Select / repeat batch rows (e.g. expand B prompts to B*G samples after prefill)."""
        self.k = [k.index_select(0, index) for k in self.k]
        self.v = [v.index_select(0, index) for v in self.v]
        self.key_mask = self.key_mask.index_select(0, index)

    def repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in place of once (row b -> rows b*repeats ...
        (b+1)*repeats - 1): ``reorder(arange(B).repeat_interleave(repeats))``, copying only
        the ``length`` slots written so far (a slot past them is written before it is read,
        so the new buffers leave them uninitialized)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        n = self.length

        def rep(buf):
            B, *rest = buf.shape
            out = buf.new_empty(B * repeats, *rest)
            out.view(B, repeats, *rest)[:, :, :, :n].copy_(buf[:, None, :, :n])
            return out

        self.k = [rep(k) for k in self.k]
        self.v = [rep(v) for v in self.v]
        self.key_mask = self.key_mask.repeat_interleave(repeats, 0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype):
    """position_ids [B, L] -> cos, sin [B, 1, L, Dh] (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, L, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """The rotary embedding (rotate-half): x [..., Dh] -> x * cos + rotate_half(x) * sin.

    The reference formula; :func:`qkv_rope` computes the same values (bit for bit) for the
    attention's q and k with fewer passes over memory."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rope_into(out, x, cos, sin):
    """out = apply_rope(x, cos, sin), written into ``out`` (same shape as x), bit for bit:
    the first half is x1 * c - x2 * s (== x1 * c + (-x2) * s: negation is exact and a - b is
    a + (-b)), the second x2 * c + x1 * s."""
    h = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    out[..., :h].sub_(x[..., h:] * sin[..., :h])
    out[..., h:].add_(x[..., :h] * sin[..., h:])
    return out


def _rope_grad_into(out, g, cos, sin):
    """out = the gradient of apply_rope(x, cos, sin) w.r.t. x for the upstream gradient g, as
    autograd computes it for that formula (g * cos, plus the rotated half of g * sin: + its
    second half on the first, - its first half on the second)."""
    h = g.shape[-1] // 2
    gs = g * sin
    torch.mul(g, cos, out=out)
    out[..., :h].add_(gs[..., h:])
    out[..., h:].sub_(gs[..., :h])
    return out


class _QKVRope(torch.autograd.Function):
    """y [B, L, 3 * H * Dh] (the qkv projection) -> q, k (rotary applied) [B, H, L, Dh] and v
    (a view of y). The values and gradients of splitting y and applying :func:`apply_rope` to q
    and k with autograd, without that graph's temporaries (the rotated copy, the zero-filled
    gradients of the half slices, the stacked q/k/v gradient)."""

    @staticmethod
    def forward(ctx, y, cos, sin, n_heads, head_dim):
        B, L, _ = y.shape
        q, k, v = y.view(B, L, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)
        # laid out as [B, L, H, Dh] in memory, as the autograd formula's outputs are
        qr = _rope_into(y.new_empty(B, L, n_heads, head_dim).transpose(1, 2), q, cos, sin)
        kr = _rope_into(y.new_empty(B, L, n_heads, head_dim).transpose(1, 2), k, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.shape, ctx.dtype = (B, L, n_heads, head_dim), y.dtype
        return qr, kr, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        B, L, H, Dh = ctx.shape
        if torch.is_grad_enabled():     # create_graph=True: the gradient must be differentiable
            def d(g):
                if g is None:
                    return torch.zeros(B, H, L, Dh, dtype=ctx.dtype, device=cos.device)
                gs, h = g * sin, Dh // 2
                return g * cos + torch.cat([gs[..., h:], -gs[..., :h]], dim=-1)
            gy = torch.stack([d(gq), d(gk), gv if gv is not None else d(None)], dim=0)
            return (gy.permute(1, 3, 0, 2, 4).reshape(B, L, 3 * H * Dh),
                    None, None, None, None)
        gy = torch.empty(B, L, 3, H, Dh, dtype=ctx.dtype, device=cos.device)
        gq_, gk_, gv_ = gy.permute(2, 0, 3, 1, 4)
        for out, g in ((gq_, gq), (gk_, gk)):
            if g is None:
                out.zero_()
            else:
                _rope_grad_into(out, g, cos, sin)
        if gv is None:
            gv_.zero_()
        else:
            gv_.copy_(gv)
        return gy.view(B, L, 3 * H * Dh), None, None, None, None


def qkv_rope(y, cos, sin, n_heads: int, head_dim: int):
    """y [B, L, 3 * H * Dh] -> q, k, v [B, H, L, Dh] with the rotary embedding applied to q
    and k; equal (values and gradients, bit for bit) to splitting y and :func:`apply_rope`."""
    if (cos.requires_grad or sin.requires_grad     # never so here: positions are not trained
            or cos.dtype != y.dtype or sin.dtype != y.dtype):   # (autocast) type promotion
        B, L, _ = y.shape
        q, k, v = y.view(B, L, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
    return _QKVRope.apply(y, cos, sin, n_heads, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def project(self, x, cos, sin):
        """x [B, L, D] -> q, k, v [B, H, L, Dh] (rotary applied to q and k)."""
        return qkv_rope(self.qkv(x), cos, sin, self.n_heads, self.head_dim)

    def attend(self, q, k, v, attn_mask):
        """q [B, H, L, Dh], k/v [B, H, S, Dh], attn_mask [B, 1, L, S] -> [B, L, D]."""
        B, _, L, _ = q.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out(y.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))

    def forward(self, x, cos, sin, attn_mask, cache: KVCache | None, layer: int):
        L = x.shape[1]
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            start = cache.length
            cache.k[layer][:, :, start:start + L] = k
            cache.v[layer][:, :, start:start + L] = v
            k = cache.k[layer][:, :, :start + L]
            v = cache.v[layer][:, :, :start + L]
        return self.attend(q, k, v, attn_mask)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _RowsOfPrefixes:
    """Where each of N rows takes its prefix from (``prefix_of_row [N]``, CPU): the runs of
    consecutive rows with one prefix, and per occurrence k (a row is its prefix's k-th) the
    rows, for prefixes ordered by their number of rows (most first; ``perm``, ``inverse``)."""

    def __init__(self, prefix_of_row: torch.Tensor, n_prefixes: int):
        rows = prefix_of_row.tolist()
        if rows and not 0 <= min(rows) <= max(rows) < n_prefixes:
            raise IndexError(f"prefix_of_row: a prefix index is out of range [0, {n_prefixes})")
        self.P = n_prefixes
        self.runs = []                                    # (prefix, first row, end row)
        for r, p in enumerate(rows):
            if self.runs and self.runs[-1][0] == p and self.runs[-1][2] == r:
                self.runs[-1][2] = r + 1
            else:
                self.runs.append([p, r, r + 1])
        of_prefix: list[list[int]] = [[] for _ in range(n_prefixes)]
        for r, p in enumerate(rows):
            of_prefix[p].append(r)
        order = sorted(range(n_prefixes), key=lambda p: -len(of_prefix[p]))   # stable
        self.perm = torch.tensor(order, dtype=torch.long)
        self.inverse = torch.empty_like(self.perm)
        self.inverse[self.perm] = torch.arange(n_prefixes)
        most = len(of_prefix[order[0]]) if order else 0
        self.by_occurrence = []      # k -> rows (long [n_k]) of prefixes perm[:n_k], in order
        for k in range(most):
            rk = [of_prefix[p][k] for p in order if len(of_prefix[p]) > k]
            self.by_occurrence.append(torch.tensor(rk, dtype=torch.long))


class _PrefixCat(torch.autograd.Function):
    """kp [P, H, Lp, Dh], kr [N, H, Lr, Dh] -> [N, H, Lp + Lr, Dh]: each row's prefix keys (or
    values) then its own, i.e. ``cat([kp.index_select(0, prefix_of_row), kr], dim=2)``, with
    the same values and gradients bit for bit (float32 on CPU): the prefix part is copied once,
    and its gradient sums each prefix's rows in row order from zero as that index_select's
    backward (an index_add) does, with dense adds instead of a scatter."""

    @staticmethod
    def forward(ctx, kp, kr, plan: _RowsOfPrefixes):
        P, H, Lp, Dh = kp.shape
        N, _, Lr, _ = kr.shape
        out = kr.new_empty(N, H, Lp + Lr, Dh)
        for p, a, b in plan.runs:
            out[a:b, :, :Lp].copy_(kp[p:p + 1].expand(b - a, H, Lp, Dh))
        out[:, :, Lp:].copy_(kr)
        ctx.plan, ctx.Lp = plan, Lp
        return out

    @staticmethod
    def backward(ctx, g):
        plan, Lp = ctx.plan, ctx.Lp
        gp = g[:, :, :Lp]
        grad_kp = None
        if ctx.needs_input_grad[0]:
            acc = g.new_zeros((plan.P,) + gp.shape[1:])       # prefixes, most rows first
            for rows in plan.by_occurrence:
                acc[:rows.numel()].add_(gp.index_select(0, rows))
            grad_kp = acc.index_select(0, plan.inverse)
        return grad_kp, g[:, :, Lp:], None


def prefix_cat(kp: torch.Tensor, kr: torch.Tensor, prefix_of_row: torch.Tensor,
               plan: _RowsOfPrefixes | None = None) -> torch.Tensor:
    """``cat([kp.index_select(0, prefix_of_row), kr], dim=2)`` (kp [P, H, Lp, Dh], kr [N, H,
    Lr, Dh] -> [N, H, Lp + Lr, Dh]); float32 CPU tensors take :class:`_PrefixCat` (same bits,
    less memory traffic), others the formula itself. ``plan``: ``_RowsOfPrefixes`` of
    ``prefix_of_row`` (built once for all layers)."""
    if kp.dtype != torch.float32 or kp.device.type != "cpu" or kr.dtype != torch.float32:
        return torch.cat([kp.index_select(0, prefix_of_row), kr], dim=2)
    if plan is None:
        plan = _RowsOfPrefixes(prefix_of_row.cpu(), kp.shape[0])
    return _PrefixCat.apply(kp, kr, plan)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn_mask, cache, layer):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, cache, layer)
        return x + self.mlp(self.mlp_norm(x))

    def forward_prefix(self, xp, rope_p, mask_p):
        """Prefixes xp [P, Lp, D], causal among themselves -> (xp', k, v [P, H, Lp, Dh])."""
        qp, kp, vp = self.attn.project(self.attn_norm(xp), *rope_p)
        xp = xp + self.attn.attend(qp, kp, vp, mask_p)
        return xp + self.mlp(self.mlp_norm(xp)), kp, vp

    def forward_continued(self, xr, rope_r, mask_r, kp, vp, prefix_of_row, plan=None):
        """Rows xr [N, Lr, D] attend to their prefix's keys/values kp, vp [P, H, Lp, Dh]
        (``prefix_of_row [N]``; ``plan``: its ``_RowsOfPrefixes``, or None) and causally to
        their own -> xr'."""
        qr, kr, vr = self.attn.project(self.attn_norm(xr), *rope_r)
        k = prefix_cat(kp, kr, prefix_of_row, plan)
        v = prefix_cat(vp, vr, prefix_of_row, plan)
        xr = xr + self.attn.attend(qr, k, v, mask_r)
        return xr + self.mlp(self.mlp_norm(xr))


@dataclass
class PrefixStates:
    """What continuations of P shared prefixes need: per layer the prefixes' keys and values
    ``kv[i] = (k, v)`` [P, H, Lp, Dh] (rotary applied; for HF models whatever their cache
    holds, e.g. [P, kv_heads, Lp, head_dim], see :mod:`hacpo.models.hf_states`), the
    final-norm hidden state of each prefix's last real token ``last`` [P, D] (it predicts a
    continuation's first token), the prefix mask [P, Lp] and lengths [P]."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    last: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """The differentiable tensors, in a fixed order (``kv`` flattened, then ``last``)."""
        return [t for kv in self.kv for t in kv] + [self.last]

    def detached(self) -> "PrefixStates":
        """The same states as new autograd leaves (``requires_grad``): continuations built on
        them stop their backward at the leaves, whose ``.grad`` then holds what they sent into
        the prefixes; :meth:`backward_from` carries it on through the prefix forward once."""
        leaf = [t.detach().requires_grad_(t.requires_grad) for t in self.tensors()]
        kv = [(leaf[2 * i], leaf[2 * i + 1]) for i in range(len(self.kv))]
        return PrefixStates(kv, leaf[-1], self.mask, self.lengths)

    def backward_from(self, leaves: "PrefixStates") -> bool:
        """Backpropagate the gradients accumulated on ``leaves`` (from :meth:`detached`)
        through the computation of these states. Returns False when no gradient arrived."""
        pairs = [(t, g.grad) for t, g in zip(self.tensors(), leaves.tensors())
                 if t.requires_grad and g.grad is not None]
        if not pairs:
            return False
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return True


class Decoder(nn.Module):
    """Decoder-only transformer.

    ``forward(input_ids, attention_mask=None, position_ids=None, cache=None) -> logits``;
    ``hidden(...)`` returns the final-norm hidden states and ``output_weight`` the ``[V, D]``
    projection, so callers can project only the positions they need.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size,
                                                                 bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if max_len > self.cfg.max_len:
            raise ValueError(f"cache length {max_len} exceeds max_len={self.cfg.max_len}")
        w = self.embed.weight
        return KVCache(self.cfg, batch, max_len, dtype=w.dtype, device=w.device)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None,
               cache: KVCache | None = None, *, check_positions: bool = True) -> torch.Tensor:
        """input_ids [B, L] -> hidden [B, L, D].

        attention_mask [B, L] (1 = real token). Without a cache, positions default to the
        count of real tokens before each one (so left or right padding both work). With a
        cache, the new tokens are written at slots ``cache.length ...`` and attend to every
        real slot before them; pass ``position_ids`` explicitly. A position >= max_len is a
        ValueError; ``check_positions=False`` skips that check (a device->host read) for a
        caller that guarantees it (the sampler's decode steps: prompt + new tokens <= max_len).
        """
        B, L = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, L, dtype=torch.bool, device=dev)
        attention_mask = attention_mask.bool()
        if position_ids is None:
            if cache is not None and cache.length:
                raise ValueError("position_ids are required when decoding with a non-empty cache")
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if check_positions and position_ids.max() >= self.cfg.max_len:
            raise ValueError(f"position {int(position_ids.max())} >= max_len={self.cfg.max_len}")
        start = cache.length if cache is not None else 0
        if cache is not None:
            if start + L > cache.max_len:
                raise ValueError(f"cache overflow: {start + L} > {cache.max_len} slots")
            cache.key_mask[:, start:start + L] = attention_mask
            key_mask = cache.key_mask[:, :start + L]
        else:
            key_mask = attention_mask
        # [B, 1, L, S]: causal over slots, real keys only; a query always sees itself so that
        # padded rows stay finite (their outputs are ignored).
        q_slot = torch.arange(start, start + L, device=dev)[:, None]
        k_slot = torch.arange(start + L, device=dev)[None, :]
        mask = (k_slot <= q_slot)[None] & key_mask[:, None, :]
        mask = (mask | (k_slot == q_slot)[None])[:, None]

        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.cfg.d_model // self.cfg.n_heads,
                                self.cfg.rope_theta, x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.length = start + L
        return self.norm(x)

    def encode_prefix(self, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor) -> PrefixStates:
        """prefix_ids, prefix_mask [P, Lp] (right-padded; 1 = real token, >= 1 per row) ->
        :class:`PrefixStates` for :meth:`hidden_continued`."""
        P, Lp = prefix_ids.shape
        dev = prefix_ids.device
        if Lp > self.cfg.max_len:
            raise ValueError(f"prefix of {Lp} tokens exceeds max_len={self.cfg.max_len}")
        prefix_mask = prefix_mask.bool()
        lengths = prefix_mask.long().sum(-1)                                  # [P]
        if P and int(lengths.min()) < 1:
            raise ValueError("encode_prefix: every prefix needs at least one real token")
        pos = torch.arange(Lp, device=dev)
        x = self.embed(prefix_ids)
        rope = rope_cos_sin(pos.expand(P, Lp), self.cfg.d_model // self.cfg.n_heads,
                            self.cfg.rope_theta, x.dtype)
        # causal over real keys; a query always sees itself, so padding stays finite
        mask = (((pos[None, :] <= pos[:, None])[None] & prefix_mask[:, None, :])
                | (pos[None, :] == pos[:, None])[None])[:, None]
        kv = []
        for block in self.blocks:
            x, k, v = block.forward_prefix(x, rope, mask)
            kv.append((k, v))
        last = self.norm(x[torch.arange(P, device=dev), lengths - 1])          # [P, D]
        return PrefixStates(kv, last, prefix_mask, lengths)

    def hidden_continued(self, states: PrefixStates, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor,
                         prefix_of_row: torch.Tensor) -> torch.Tensor:
        """Continuations input_ids, attention_mask [N, Lr] (right-padded) of the prefixes
        ``prefix_of_row [N]`` (long) -> final-norm hidden states [N, Lr, D], equal (up to float
        rounding) to ``hidden`` on each concatenation prefix + row."""
        N, Lr = input_ids.shape
        dev = input_ids.device
        attention_mask = attention_mask.bool()
        Lp = states.mask.shape[1]
        pos = states.lengths.index_select(0, prefix_of_row)[:, None] + torch.arange(Lr, device=dev)
        # real tokens only: a short row's padding next to a long row may run past max_len
        # (rotary positions are computed, not looked up, so those slots are harmless)
        if int(pos.masked_fill(~attention_mask, 0).max() if N and Lr else 0) >= self.cfg.max_len:
            raise ValueError(f"prefix + continuation exceeds max_len={self.cfg.max_len}")
        x = self.embed(input_ids)
        rope = rope_cos_sin(pos, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta,
                            x.dtype)
        q, k = torch.arange(Lr, device=dev)[:, None], torch.arange(Lr, device=dev)[None]
        own = ((k <= q)[None] & attention_mask[:, None, :]) | (k == q)[None]      # [N, Lr, Lr]
        pre = states.mask.index_select(0, prefix_of_row)[:, None, :].expand(N, Lr, Lp)
        mask = torch.cat([pre, own], dim=-1)[:, None]
        plan = (_RowsOfPrefixes(prefix_of_row.cpu(), states.mask.shape[0])
                if dev.type == "cpu" and x.dtype == torch.float32 else None)
        for block, (kp, vp) in zip(self.blocks, states.kv):
            x = block.forward_continued(x, rope, mask, kp, vp, prefix_of_row, plan)
        return self.norm(x)

    def hidden_prefixed(self, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor,
                        input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        prefix_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing with shared prefixes: each prefix is computed once for all its rows.

        prefix_ids, prefix_mask [P, Lp]; input_ids, attention_mask [N, Lr]; prefix_of_row [N].
        Returns (final-norm hidden state of each prefix's last token [P, D], rows' hidden
        states [N, Lr, D]); gradients flow into the shared prefix from every row.
        """
        states = self.encode_prefix(prefix_ids, prefix_mask)
        return states.last, self.hidden_continued(states, input_ids, attention_mask,
                                                  prefix_of_row)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        """-> logits [B, L, V] (in the parameter dtype)."""
        return F.linear(self.hidden(input_ids, attention_mask, position_ids, cache),
                        self.output_weight)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def to_llama(model: Decoder, *, eos_id: int | None = None, pad_id: int | None = None,
             bos_id: int | None = None):
    """The same network as a transformers ``LlamaForCausalLM`` (``hacpo export``).

    The decoder is Llama's architecture with fused projections: RMSNorm (normalized in float32,
    then scaled), rotate-half rotary embeddings with ``rope_theta``, full multi-head attention
    (as many key/value heads as heads), SwiGLU, no biases. The fused ``qkv`` ``[3D, D]`` holds
    q, k and v row blocks of ``D`` (head-major inside each) and ``gate_up`` ``[2F, D]`` the gate
    then the up rows, so the split is by rows; every tensor is copied (the result shares no
    storage with ``model``), in the decoder's dtype. Tied embeddings stay tied."""
    from hacpo.engine.errors import require
    require("transformers", "a decoder policy as a Hugging Face LlamaForCausalLM")
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.cfg
    w = model.embed.weight
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                      num_key_value_heads=c.n_heads, max_position_embeddings=c.max_len,
                      rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                      hidden_act="silu", attention_bias=False, mlp_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                      eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=bos_id)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):     # its random init is overwritten below
        llama = LlamaForCausalLM(cfg).to(device=w.device, dtype=w.dtype)
    D, F_ = c.d_model, c.d_ff
    sd = {"model.embed_tokens.weight": w, "model.norm.weight": model.norm.weight}
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        q, k, v = b.attn.qkv.weight.split(D, dim=0)
        gate, up = b.mlp.gate_up.weight.split(F_, dim=0)
        sd.update({p + "input_layernorm.weight": b.attn_norm.weight,
                   p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v,
                   p + "self_attn.o_proj.weight": b.attn.out.weight,
                   p + "post_attention_layernorm.weight": b.mlp_norm.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": b.mlp.down.weight})
    sd["lm_head.weight"] = model.output_weight     # tied: the embedding itself
    params = dict(llama.named_parameters(remove_duplicate=False))
    if set(params) != set(sd):
        raise RuntimeError(f"to_llama: Llama's parameters {sorted(set(params) ^ set(sd))} "
                           f"have no decoder tensor / no place")
    with torch.no_grad():
        for name, t in sd.items():
            params[name].copy_(t)
    return llama.eval()
