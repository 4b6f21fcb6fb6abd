"""The MoE layer's small steps around the expert GEMMs as Triton kernels: the routing's sort of
(token, expert) assignments by expert, the sum of each token's expert rows, and the router's top-k.

Twins (in moe.py) and how each kernel equals its twin:
- route_tokens = moe.route_tokens_reference, equal in every integer. A stable counting sort in two
  launches instead of a radix sort, a scatter, searchsorted and four small ops: (1) each chunk of
  assignments counts its experts (a one-hot tile summed over rows); (2) each chunk places its
  assignments: position = where the expert's rows start + that expert's rows in earlier chunks + its
  earlier rows in this chunk (an exclusive cumulative sum down the one-hot tile), so ties keep
  assignment order, as a stable sort does. Up to MAX_ASSIGNMENTS assignments (the second pass reads
  every chunk's counts at once) and MAX_EXPERTS experts (a chunk's one-hot tile stays in registers).
- sum_expert_rows = moe.sum_expert_rows_reference, bit for bit. One program per (token, block of D)
  gathers the token's A rows through inverse_order and adds them in fp32 in the twin's order, one
  rounding at the end: a gather and a reduction launch become one (H200, a decode step of 256
  tokens: 8.7 us a layer, the fused launch 3.6).
- router_top_k = moe.router_top_k_reference, to fp32 rounding. One program per token: the softmax of
  its E logits in fp32, then A rounds of argmax (lowest id on ties, as torch.topk's selection on
  CUDA) with the winner masked out; the weights are the winners' probabilities (or the replayed
  experts'), renormalized by their sum taken in slot order, so replaying a token's own routes gives
  its weights bit for bit. One launch where torch took five (softmax, top-k's select and sort, sum,
  divide). The exponential and the sums round in another order than torch's (fp32 units; equal
  logits stay equal probabilities, so the chosen experts are torch's).

Shape letters: T tokens, A experts per token, E experts, N = T*A assignments, D model dim.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels.rounding import ROUNDED_DTYPES, round_to

CHUNK = 64  # assignments per program of the counting sort
MAX_ASSIGNMENTS = 64 * CHUNK  # the second pass reads every chunk's counts at once
MAX_EXPERTS = 256  # a chunk's one-hot (CHUNK, E) tile stays in registers
MAX_LOGITS = 4096  # the router: one token's E logits in one program's registers


# ----------------------------------------------------------------------------- the counting sort
@triton.jit
def _route_count_kernel(ids_ptr, chunk_counts_ptr, N, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    n = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + n, mask=n < N, other=-1)
    one_hot = (ids[:, None] == tl.arange(0, E_BLOCK)[None, :]).to(tl.int32)  # (CHUNK, E)
    tl.store(chunk_counts_ptr + chunk * E_BLOCK + tl.arange(0, E_BLOCK), tl.sum(one_hot, axis=0))


@triton.jit
def _route_place_kernel(
    ids_ptr,
    chunk_counts_ptr,
    order_ptr,
    token_ids_ptr,
    inverse_ptr,
    counts_ptr,
    offsets_ptr,
    N,
    E,
    n_chunks,
    n_active,
    CHUNK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    chunks = tl.arange(0, CHUNKS)
    # (CHUNKS, E)
    per_chunk = tl.load(
        chunk_counts_ptr + chunks[:, None] * E_BLOCK + experts[None, :],
        mask=(chunks < n_chunks)[:, None],
        other=0,
    )
    counts = tl.sum(per_chunk, axis=0)  # (E,)
    earlier = tl.sum(tl.where((chunks < chunk)[:, None], per_chunk, 0), axis=0)
    ends = tl.cumsum(counts, axis=0)  # (E,) offsets
    base = ends - counts + earlier  # expert's start + its rows in earlier chunks
    n = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = n < N
    ids = tl.load(ids_ptr + n, mask=valid, other=-1)
    one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # (CHUNK, E)
    before = tl.cumsum(one_hot, axis=0) - one_hot  # same expert, earlier in the chunk
    position = tl.sum(one_hot * (before + base[None, :]), axis=1)  # (CHUNK,)
    tl.store(inverse_ptr + n, position.to(tl.int64), mask=valid)
    tl.store(order_ptr + position, n.to(tl.int64), mask=valid)
    tl.store(token_ids_ptr + position, (n // n_active).to(tl.int64), mask=valid)
    if chunk == 0:
        tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)
        tl.store(offsets_ptr + experts, ends, mask=experts < E)


def route_tokens(expert_ids, n_experts):
    """moe.route_tokens as two launches -> (order, token_ids, inverse_order, counts, offsets), the
    fields of moe.Routing. Expert ids must lie in [0, n_experts), as a router's do."""
    ids = expert_ids.reshape(-1)  # (N,)
    N, device = ids.numel(), ids.device
    n_chunks = max(1, triton.cdiv(N, CHUNK))
    e_block = triton.next_power_of_2(n_experts)
    chunk_counts = torch.empty(n_chunks, e_block, dtype=torch.int32, device=device)
    order = torch.empty(N, dtype=torch.int64, device=device)
    token_ids = torch.empty(N, dtype=torch.int64, device=device)
    inverse_order = torch.empty(N, dtype=torch.int64, device=device)
    # the second pass writes every count and offset (no fill launch)
    new = torch.empty if N else torch.zeros
    counts = new(n_experts, dtype=torch.int64, device=device)
    offsets = new(n_experts, dtype=torch.int32, device=device)
    if N:
        _route_count_kernel[(n_chunks,)](ids, chunk_counts, N, CHUNK=CHUNK, E_BLOCK=e_block)
        _route_place_kernel[(n_chunks,)](
            ids,
            chunk_counts,
            order,
            token_ids,
            inverse_order,
            counts,
            offsets,
            N,
            n_experts,
            n_chunks,
            expert_ids.shape[-1],
            CHUNK=CHUNK,
            E_BLOCK=e_block,
            CHUNKS=triton.next_power_of_2(n_chunks),
        )
    return order, token_ids, inverse_order, counts, offsets


# ----------------------------------------------------------------------------- sum of expert rows
@triton.jit
def _sum_rows_kernel(y_ptr, inverse_ptr, out_ptr, D, A: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = tl.load(inverse_ptr + token * A)
    total = tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    for a in tl.static_range(1, A):
        row = tl.load(inverse_ptr + token * A + a)
        total += tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    total = round_to(total, out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * D + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_expert_rows(y_sorted, inverse_order, n_active):
    """y_sorted (N, D) rows in expert order, bfloat16 or float32, already weighted -> (T, D): each
    token's A rows (found through the routing's inverse_order) added in fp32 in the order
    a = 0..A-1."""
    n = inverse_order.numel()
    # rows the kernel would read out of bounds
    if y_sorted.dim() != 2 or y_sorted.shape[0] != n or n_active < 1 or n % n_active:
        raise ValueError(
            f"sum_expert_rows: y_sorted {tuple(y_sorted.shape)} must be (N, D) with N = {n}, "
            f"the routing's assignments, a multiple of n_active={n_active}"
        )
    if y_sorted.dtype not in ROUNDED_DTYPES:
        raise ValueError(
            f"sum_expert_rows: y_sorted must be bfloat16 or float32, got {y_sorted.dtype}"
        )
    y_sorted = y_sorted.contiguous()
    N, D = y_sorted.shape
    out = torch.empty((N // n_active, D), dtype=y_sorted.dtype, device=y_sorted.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(D))
        _sum_rows_kernel[(out.shape[0], triton.cdiv(D, block))](
            y_sorted, inverse_order, out, D, A=n_active, BLOCK=block
        )
    return out


# ----------------------------------------------------------------------------- the router's top-k
@triton.jit
def _router_top_k_kernel(
    logits_ptr,
    routes_ptr,
    weights_ptr,
    ids_ptr,
    E,
    A: tl.constexpr,
    NORM: tl.constexpr,
    FORCED: tl.constexpr,
    BLOCK: tl.constexpr,
    A_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK)
    z = tl.load(logits_ptr + row * E + experts, mask=experts < E, other=float("-inf"))
    z = z.to(tl.float32)
    e = tl.exp(z - tl.max(z, axis=0))
    p = e / tl.sum(e, axis=0)
    left = tl.where(experts < E, p, -1.0)  # probabilities not yet chosen (-1: taken or padding)
    slots = tl.arange(0, A_BLOCK)
    weights = tl.zeros((A_BLOCK,), dtype=tl.float32)
    ids = tl.zeros((A_BLOCK,), dtype=tl.int64)
    total = 0.0
    for a in tl.static_range(A):
        best, expert = tl.max(left, axis=0, return_indices=True, return_indices_tie_break_left=True)
        ids = tl.where(slots == a, expert.to(tl.int64), ids)
        left = tl.where(experts == expert, -1.0, left)
        if FORCED:
            route = tl.load(routes_ptr + row * A + a)
            best = tl.sum(tl.where(experts == route, p, 0.0), axis=0)  # p[route], exactly
        weights = tl.where(slots == a, best, weights)
        total += best
    if NORM:
        weights = weights / total
    tl.store(weights_ptr + row * A + slots, weights, mask=slots < A)
    tl.store(ids_ptr + row * A + slots, ids, mask=slots < A)


def router_top_k(logits, n_active, norm_topk_prob, routes=None):
    """moe.router_top_k_reference as one launch (forward only): logits (T, E) -> (weights (T, A)
    fp32, ids (T, A) int64), the weights those of `routes` (T, A) when given."""
    T, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(T, n_active, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, n_active, dtype=torch.int64, device=logits.device)
    if T:
        _router_top_k_kernel[(T,)](
            logits,
            ids if routes is None else routes.contiguous(),
            weights,
            ids,
            E,
            A=n_active,
            NORM=norm_topk_prob,
            FORCED=routes is not None,
            BLOCK=triton.next_power_of_2(E),
            A_BLOCK=triton.next_power_of_2(n_active),
            num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


class RouterTopK(torch.autograd.Function):
    """Forward through the fused kernel; backward through `weights_of(logits, chosen,
    norm_topk_prob)` recomputed, the twin's weights of the same experts (the caller passes moe's:
    the gradient of the same function, the forward equal to fp32 rounding). apply(logits, n_active,
    norm_topk_prob, routes, weights_of)."""

    @staticmethod
    def forward(ctx, logits, n_active, norm_topk_prob, routes, weights_of):
        weights, ids = router_top_k(logits, n_active, norm_topk_prob, routes)
        ctx.save_for_backward(logits, ids if routes is None else routes)
        ctx.norm_topk_prob, ctx.weights_of = norm_topk_prob, weights_of
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, grad_ids):
        logits, chosen = ctx.saved_tensors
        with torch.enable_grad():
            logits_ = logits.detach().requires_grad_()
            weights = ctx.weights_of(logits_, chosen, ctx.norm_topk_prob)
        return torch.autograd.grad(weights, logits_, grad_weights)[0], None, None, None, None
