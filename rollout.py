"""The rollout sampler: G completions per prompt from a KV-cached model, with what RL needs to learn
from them: for every sampled token its id, whether it belongs to the completion (mask), the log-prob
the rollout model gave it, and for every MoE layer the experts it was routed to.

    prefill    each prompt runs once, all prompts in one left-padded batch; the attention layers
               write their keys/values straight into the G cache rows of that prompt's samples, and
               the last position's logits give every sample its first token.
    decode     one token per row and step against a static KV cache (`KVCache`: N rows, S slots,
               allocated once per batch shape and pooled per model with its graph); every shape is
               fixed, so on CUDA the step (forward, sampling, bookkeeping) is captured once as a
               CUDA graph and replayed.

Left padding: prompt p of length n_p sits in the last n_p of Tp columns (Tp rounded up to a multiple
of 16, so nearby lengths share a shape); positions count from its first real token, padded keys are
masked out, a padded query attends only to itself. So each row computes what it would alone, up to
float summation order.

Sampling, per row and step, from the logits z (fp32) at temperature tau:

    logprobs  = log_softmax(z / tau)                the FULL tempered distribution: this is returned
    kept      = top-k, then top-p of the survivors  (renormalized), as Hugging Face applies them
    token     = argmax_{v in kept} p_v / E_v,   E_v ~ Exp(1) i.i.d.   (exponential race = sampling
                from p restricted to kept and renormalized; no torch.multinomial, no host sync)
    returned  = logprobs[token]                     what the trainer recomputes for the same token

temperature = 0 is greedy (argmax of z) and returns log_softmax(z). A row stops after eos_id (the
EOS token is part of the completion, mask 1) or max_new_tokens; later columns hold pad_id, mask 0,
log-prob 0. Routes are recorded when a token is fed (the last token is fed once more to record its
own); `Rollout.sequences()` lays prompt + completion out as the trainer's rows, routes included (for
R3, moe.py's forced routes).

Random numbers are counter-based: E_v of row n at completion position t is a hash of (seed, row id,
t, v) (`sampling_noise`: two rounds of a 32-bit xor-shift / multiply mixer, u from its top 23 bits,
E = -log(u)). A row's tokens depend only on its logits and (seed, row id), with or without the CUDA
graph and whatever rows share its batch, so torchrun ranks sampling their shares of a batch
(`row_offset`) produce exactly the rollouts one process would. On CUDA (gpu_kernels/sampling.py) the
noise is one Triton launch, bit for bit its torch twin (`use_noise_kernel`), and without top-k /
top-p one fused kernel samples (`use_fused_sampler`). `score` re-scores given rows in one prefill,
tools/audit.py's check of the engine's numerics.

Left out on purpose: continuous batching (finished rows keep their slot), paged or shared-prefix
attention, chunked prefill, speculative decoding, stop strings, repetition penalties, min-p.

Shape letters: P prompts, G samples per prompt, N = P*G rows (prompt-major: rows p*G .. p*G+G-1 are
prompt p's), Tp padded prompt width, T completion width, W = prompt + completion width (trainer
rows), S cache slots, V vocab, L layers, Hkv key/value heads, hd head dim, A experts per token.
"""

import dataclasses
import operator
import warnings
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from moe import MoETransformer

# triton ships with CUDA builds of torch on Linux; without it the torch twins run
try:
    from gpu_kernels import sampling as sampling_kernels
except ImportError:
    sampling_kernels = None

PROMPT_WIDTH_MULTIPLE = 16  # prompt widths are rounded up to this, so nearby lengths share a graph
FINISHED_CHECK_INTERVAL = 16  # CUDA: decode steps between host checks for "every row has finished"
PREFILL_LOGITS_BUDGET = 1 << 27  # max logits (rows * Tp * V elements) one prefill forward produces
MAX_POOLED_STATES = 4  # decode states (cache + graph) kept per model, least recently used dropped


class Sequences(NamedTuple):
    """Prompt + completion as right-padded trainer rows: row n holds its prompt, then its
    completion, then pad.

    With right padding the trainer needs no mask or positions: `logits = model(tokens)` computes
    each row exactly as it would alone. logprobs[:, j] is the rollout's log-prob of tokens[:, j]
    given tokens[:, :j], so it lines up with
    `log_softmax(logits[:, :-1] / temperature).gather(-1, tokens[:, 1:, None])` shifted by one:
    compare `logprobs[:, 1:]` where `loss_mask[:, 1:]`.
    """

    tokens: Tensor  # (N, W) int64, pad_id after the end of each row
    valid_mask: Tensor  # (N, W) bool: prompt or completion token (not padding)
    loss_mask: Tensor  # (N, W) bool: completion token (the ones the policy is trained on)
    logprobs: Tensor  # (N, W) fp32: rollout log-prob of each completion token, 0 elsewhere
    # (L, N, W, A) int64: experts of every valid token; padding repeats a valid token's
    routes: Tensor | None


@dataclasses.dataclass
class Rollout:
    """G sampled completions of P prompts, prompt-major: row p*G + g is sample g of prompt p."""

    prompt_ids: Tensor  # (N, Tp) int64, left-padded with pad_id
    prompt_mask: Tensor  # (N, Tp) bool, True at real prompt tokens
    prompt_lengths: Tensor  # (N,) int64
    completion_ids: Tensor  # (N, T) int64; the EOS token is included, pad_id after it
    completion_mask: Tensor  # (N, T) bool; True up to and including EOS
    logprobs: Tensor  # (N, T) fp32: log_softmax(z / temperature)[token], 0 where masked
    routes: Tensor | None  # (L, N, T, A) int64: experts per completion token (where masked 1)
    # (L, N, Tp, A) int64: experts per prompt token (where prompt_mask)
    prompt_routes: Tensor | None
    num_samples: int  # G
    temperature: float  # the trainer must score the tokens at this temperature (0: untempered)
    pad_id: int
    used_cuda_graph: bool  # whether the decode loop replayed a captured CUDA graph

    @property
    def completion_lengths(self) -> Tensor:
        """(N,) int64: tokens per completion, EOS included."""
        return self.completion_mask.sum(dim=1)

    def sequences(self) -> Sequences:
        """The rows the trainer scores: prompt then completion, right-padded (see `Sequences`)."""
        Tp = self.prompt_ids.shape[1]
        lengths = self.prompt_lengths + self.completion_lengths  # (N,)
        W = int(lengths.max())
        # With left-padded prompts, [prompt_ids | completion_ids] holds each row's tokens
        # contiguously from column Tp - prompt_length on: shifting every row left by its padding
        # right-pads it.
        tokens = torch.cat((self.prompt_ids, self.completion_ids), dim=1)  # (N, Tp + T)
        columns = torch.arange(W, device=tokens.device)  # (W,)
        valid = columns < lengths[:, None]  # (N, W)
        first_column = Tp - self.prompt_lengths  # (N,) where each row's prompt starts
        source = (first_column[:, None] + columns).clamp(max=tokens.shape[1] - 1)  # (N, W)
        # padding columns read the row's last valid column, so gathered routes stay valid ids
        source = torch.where(valid, source, (first_column + lengths - 1)[:, None])
        loss_mask = valid & (columns >= self.prompt_lengths[:, None])
        prompt_logprobs = torch.zeros_like(self.prompt_ids, dtype=torch.float32)
        logprobs = torch.cat((prompt_logprobs, self.logprobs), dim=1)  # (N, Tp + T)
        routes = None
        if self.routes is not None:
            all_routes = torch.cat((self.prompt_routes, self.routes), dim=2)  # (L, N, Tp + T, A)
            L = all_routes.shape[0]
            A = all_routes.shape[-1]
            index = source[None, :, :, None].expand(L, -1, -1, A)  # (L, N, W, A)
            routes = all_routes.gather(2, index)  # (L, N, W, A)
        return Sequences(
            tokens=torch.where(valid, tokens.gather(1, source), self.pad_id),
            valid_mask=valid,
            loss_mask=loss_mask,
            routes=routes,
            logprobs=torch.where(loss_mask, logprobs.gather(1, source), 0.0),
        )


class KVCache:
    """Keys and values of every layer for N rows and S slots, written in place (moe.py's cache
    interface). Two modes, one per phase:
    - prefill (`prefill_rows` set): the prompt's keys (P', Hkv, Tp, hd) are copied to slots [0, Tp)
      of the G rows of each prompt; the layer gets its own keys back (a prompt attends only to
      itself).
    - decode: the new keys (N, Hkv, 1, hd) go to slot `length` (a device tensor, so a CUDA graph can
      replay the write at the next slot); the layer gets all S slots back and the caller's mask
      hides the unwritten.
    """

    def __init__(
        self,
        n_layers: int,
        rows: int,
        n_kv_heads: int,
        slots: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (n_layers, rows, n_kv_heads, slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # (1,) int64: slots written; the next goes here
        self.length = torch.zeros(1, dtype=torch.int64, device=device)
        self.prefill_rows: slice | None = None  # cache rows the current prefill chunk fills
        self.samples_per_prompt = 1  # G: each prompt's keys are copied to this many rows

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.prefill_rows is not None:
            T = k.shape[2]
            G = self.samples_per_prompt
            self.keys[layer_idx, self.prefill_rows, :, :T] = k.repeat_interleave(G, dim=0)
            self.values[layer_idx, self.prefill_rows, :, :T] = v.repeat_interleave(G, dim=0)
            return k, v
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # (N, Hkv, S, hd)
        keys.index_copy_(2, self.length, k.to(keys.dtype))
        values.index_copy_(2, self.length, v.to(values.dtype))
        return keys, values


def prefill(
    model: MoETransformer,
    cache: KVCache,
    prompt_ids: Tensor,
    pad_lengths: Tensor,
    samples_per_prompt: int,
) -> tuple[Tensor, Tensor]:
    """Run the left-padded prompts (P, Tp), filling slots [0, Tp) of each prompt's G cache rows.
    Returns the last position's logits (P, V) and the prompt routes (L, P, Tp, A).

    Prompts go through in chunks so that one forward never produces more than
    PREFILL_LOGITS_BUDGET logits (the model computes logits at every position; only the last is
    needed)."""
    P, Tp = prompt_ids.shape
    G = samples_per_prompt
    columns = torch.arange(Tp, device=prompt_ids.device)
    chunk = max(1, PREFILL_LOGITS_BUDGET // (Tp * model.config.vocab_size))
    last_logits = []
    routes = []
    try:
        for start in range(0, P, chunk):
            pad = pad_lengths[start : start + chunk, None]  # (P', 1)
            positions = (columns - pad).clamp(min=0)  # (P', Tp)
            query = columns[:, None]  # (Tp, 1)
            key = columns[None, :]  # (1, Tp)
            real_key = key >= pad[:, :, None]  # (P', 1, Tp)
            attn_mask = ((key <= query) & real_key) | (key == query)  # (P', Tp, Tp)
            cache.prefill_rows = slice(start * G, (start + pad.shape[0]) * G)
            cache.samples_per_prompt = G
            logits, chunk_routes = model(
                prompt_ids[start : start + chunk],
                positions,
                attn_mask[:, None],
                kv_cache=cache,
                return_routes=True,
            )
            last_logits.append(logits[:, -1])  # (P', V)
            routes.append(chunk_routes)  # (L, P', Tp, A)
    finally:
        cache.prefill_rows = None
    return torch.cat(last_logits), torch.cat(routes, dim=1)


class DecodeState:
    """Everything one decode step reads and writes, allocated once per batch shape: the step is a
    fixed function of these buffers, which is what lets a CUDA graph replay it."""

    def __init__(
        self,
        model: MoETransformer,
        rows: int,
        prompt_width: int,
        max_new_tokens: int,
        sampling: dict,
    ):
        c = model.config
        device = model.embed.weight.device

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        # S slots in whole 16-element rows: they keep the attention mask aligned for fused kernels
        S = -(-(prompt_width + max_new_tokens) // 16) * 16
        T = max_new_tokens + 1  # Tmax + 1 completion columns
        dtype = model.embed.weight.dtype
        self.cache = KVCache(c.n_layers, rows, c.n_kv_heads, S, c.head_dim, dtype, device)
        self.prompt_width = prompt_width  # Tp: completion token t sits in cache slot Tp + t
        self.pad_lengths = zeros(rows)  # (N,) int64: left padding of each row (Tp - prompt length)
        self.slots = torch.arange(S, device=device)  # (S,) int64: 0 .. S-1, for the attention mask
        self.next_input = zeros(rows, 1)  # (N, 1) int64: the token each row feeds next
        # (N,) bool: the row's next_input is a completion token (it has not ended)
        self.alive = zeros(rows, dtype=torch.bool)
        # (N, Tmax + 1) int64: completion tokens; column Tmax is scratch
        self.tokens = zeros(rows, T)
        self.token_mask = zeros(rows, T, dtype=torch.bool)  # (N, Tmax + 1)
        self.token_logprobs = zeros(rows, T, dtype=torch.float32)  # (N, Tmax + 1)
        # (L, N, Tmax, A) int64: experts of completion token t, recorded when it is fed
        self.routes = zeros(c.n_layers, rows, max_new_tokens, c.n_active)
        # (1,) int64: the current call's seed_key (read by the graph at each replay)
        self.seed = zeros(1)
        # (N,) int64: each row's id within the whole batch (row_offset + n)
        self.row_ids = torch.arange(rows, device=device)
        # temperature, top_k, top_p, eos_id, pad_id: constants of the captured step
        self.sampling = sampling
        self.graph: "torch.cuda.CUDAGraph | None" = None
        self.capture_tried = False


def decode_step(model: MoETransformer, state: DecodeState, hand_offs: dict | None = None) -> None:
    """Feed every row's next_input, record its routes, sample the following token. Only device
    tensors and in-place writes to `state`: capturable as a CUDA graph, no host sync. hand_offs:
    passed to the model's forward (moe.py), for layers that take something per call (TRACE)."""
    cache = state.cache
    sampling = state.sampling
    step = cache.length - state.prompt_width  # (1,) which completion token is fed
    positions = (cache.length - state.pad_lengths)[:, None]  # (N, 1)
    # (N, S): the row's own slots, up to and including the one written now
    attn_mask = (state.slots >= state.pad_lengths[:, None]) & (state.slots <= cache.length)
    # (N, 1, V) and (L, N, 1, A)
    logits, routes = model(
        state.next_input,
        positions,
        attn_mask[:, None, None],
        kv_cache=cache,
        return_routes=True,
        hand_offs=hand_offs,
    )
    cache.length.add_(1)
    state.routes.index_copy_(2, step, routes)
    alive = state.alive
    if sampling["eos_id"] is not None:
        # a row that just fed EOS has ended
        alive = alive & (state.next_input[:, 0] != sampling["eos_id"])
    column = step + 1
    tokens, logprobs = sample_next(logits[:, -1], sampling, state.seed, state.row_ids, column)
    tokens = torch.where(alive, tokens, sampling["pad_id"])
    state.tokens.index_copy_(1, column, tokens[:, None])
    state.token_mask.index_copy_(1, column, alive[:, None])
    state.token_logprobs.index_copy_(1, column, torch.where(alive, logprobs, 0.0)[:, None])
    state.alive.copy_(alive)
    state.next_input.copy_(tokens[:, None])


def capture_decode_graph(model: MoETransformer, state: DecodeState) -> None:
    """Warm up decode_step on a side stream (lazy initializations, Triton autotuning, cuBLAS
    workspaces, outside the capture), then capture one step. Called after a prefill: the warm-up's
    writes (cache slots Tp and Tp + 1, garbage in the other buffers) are overwritten or reset before
    use, and layers that set themselves up from their first input (an uncalibrated RAC selector,
    rac.py) have seen the prompts by then. Once per state: a step that cannot be captured (a host
    sync, say) is reported, and the state decodes eagerly."""
    state.capture_tried = True
    # in-range slots and columns for the warm-up's writes
    state.cache.length.fill_(state.prompt_width)
    try:
        side = torch.cuda.Stream(state.cache.keys.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                decode_step(model, state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # The noise is a function of state.seed, state.row_ids and the cache length, all device
        # tensors the graph reads at each replay: no generator state to register.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            decode_step(model, state)
        state.graph = graph
    except Exception as error:
        warnings.warn(
            f"rollout.py: CUDA graph capture of the decode step failed, decoding eagerly "
            f"(cuda_graph=False skips the attempt): {type(error).__name__}: {error}"
        )
        torch.cuda.synchronize()


# model -> (weights signature, {shape and sampling key: DecodeState}). Weak keys: a deleted model
# takes its caches and graphs with it. The states never reference the model, or it could never be
# collected.
_POOLS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def weights_signature(model: nn.Module) -> tuple:
    """What a captured decode graph has baked in: the identity of every module, the address of every
    tensor the modules hold (parameters, buffers, plain tensor attributes, dataclass fields such as
    an NVFP4Tensor's), and the modules' plain Python settings (ints, floats, bools, strings: a RAC
    selector's ratio, a training flag), which choose branches while the step is captured. If any of
    these changes (a layer swapped, a weight re-created rather than copied in place, a setting
    changed) the pooled graphs are stale and are dropped. Weights updated in place (rac.py's
    sync_weights and calibrate_rac, read after train.py) keep them."""
    signature = []
    for module in model.modules():
        signature.append(id(module))
        held = [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]
        for name, value in held:
            if isinstance(value, (bool, int, float, str)):
                signature.append((name, value))
            elif isinstance(value, Tensor):
                signature.append(value.data_ptr())
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
                signature.extend(t.data_ptr() for t in fields if isinstance(t, Tensor))
    return tuple(signature)


def get_decode_state(
    model: MoETransformer,
    rows: int,
    prompt_width: int,
    max_new_tokens: int,
    sampling: dict,
    cuda_graph: bool,
) -> DecodeState:
    """The pooled state for these shapes and sampling settings, or a new one (its graph is captured
    by generate, after the first prefill)."""
    signature = weights_signature(model)
    pool = _POOLS.get(model)
    if pool is None or pool[0] != signature:
        pool = [signature, OrderedDict()]
        _POOLS[model] = pool
    states = pool[1]
    key = (rows, prompt_width, max_new_tokens, cuda_graph, tuple(sorted(sampling.items())))
    if key not in states:
        while len(states) >= MAX_POOLED_STATES:
            states.popitem(last=False)
        states[key] = DecodeState(model, rows, prompt_width, max_new_tokens, sampling)
    states.move_to_end(key)
    return states[key]


def last_decode_state(model: nn.Module) -> "DecodeState | None":
    """The pooled state the model's latest generate call decoded with (a benchmark replays its
    graph), or None if it has none."""
    pool = _POOLS.get(model)
    return next(reversed(pool[1].values())) if pool and pool[1] else None


def free_decode_states(model: nn.Module) -> None:
    """Drop the model's pooled KV caches and CUDA graphs (they are also dropped with the model)."""
    _POOLS.pop(model, None)


MASK32 = 0xFFFFFFFF
# odd and < 2^31: a product with a 32-bit value fits in int64
MIX_MULTIPLIERS = (0x7FEB352D, 0x1B873593)
# odd "Weyl" increments, one per input of the hash
ROW_STRIDE = 0x27D4EB2F
POSITION_STRIDE = 0x165667B1
TOKEN_STRIDE = 0x61C88647
UNIFORM_BITS = 23  # u = (top 23 bits + 1/2) * 2^-23: exact in fp32, never 0 or 1


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift / multiply rounds) of int64 tensors holding values in
    [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MULTIPLIERS[0]) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MULTIPLIERS[1]) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 64-bit seed folded and mixed into the 32-bit key the noise starts from (seeds that differ
    only above bit 32 still differ)."""
    return int(_mix32(torch.tensor((seed ^ (seed >> 32)) & MASK32)))


def sampling_noise_reference(
    seed_key: Tensor, rows: Tensor, position: Tensor, vocab: int
) -> Tensor:
    """Twin of the noise kernel in torch integer ops: E (N, V) = -log(u), u in (0, 1) from the hash
    of (seed key, row id, position, token id). seed_key and position are (1,) int64 tensors, rows
    (N,)."""
    keys = _mix32((seed_key + rows * ROW_STRIDE + position * POSITION_STRIDE) & MASK32)  # (N,)
    tokens = torch.arange(vocab, device=rows.device, dtype=torch.int64)
    x = _mix32((keys[:, None] + tokens[None, :] * TOKEN_STRIDE) & MASK32)  # (N, V)
    uniform = ((x >> (32 - UNIFORM_BITS)).float() + 0.5) * 2.0**-UNIFORM_BITS
    return uniform.log_().neg_()


def use_noise_kernel(rows: Tensor) -> bool:
    """Where the noise kernel (gpu_kernels/sampling.py) runs: CUDA. A benchmark may replace this."""
    return sampling_kernels is not None and rows.is_cuda


def sampling_noise(seed_key: Tensor, rows: Tensor, position: Tensor, vocab: int) -> Tensor:
    """E (N, V) ~ Exp(1) i.i.d., a pure function of (seed, row id, position, token id): one Triton
    launch on CUDA, the torch twin otherwise (the same hash bit for bit)."""
    if use_noise_kernel(rows):
        return sampling_kernels.sampling_noise(seed_key, rows, position, vocab)
    return sampling_noise_reference(seed_key, rows, position, vocab)


def sample_tokens(
    logits: Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """logits (B, V) -> (tokens (B,) int64, logprobs (B,) fp32 of those tokens under
    log_softmax(z / tau)): the reference sampler.

    The token is drawn from the top-k/top-p truncated distribution; the log-prob is the full
    tempered one (see the module docstring). noise (B, V): i.i.d. Exp(1) draws, all > 0
    (`sampling_noise`; needed unless greedy). temperature 0: argmax, untempered log-prob. No host
    sync.
    """
    logits = logits.float()
    if temperature == 0:
        logprobs = F.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logprobs.argmax(dim=-1)
    else:
        logprobs = F.log_softmax(logits / temperature, dim=-1)  # (B, V)
        kept = truncate(logprobs, top_k, top_p)  # -inf outside
        if noise is None:
            raise ValueError("sample_tokens: temperature > 0 needs noise (B, V) of Exp(1) draws")
        # p / E with E ~ Exp(1) is an exponential race: argmax picks v with probability
        # p_v / sum(p). sampling_noise's E is never 0 (u <= 1 - 2^-24, so E >= 6e-8): a truncated
        # token's 0 / E stays 0.
        tokens = (kept.exp() / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def use_fused_sampler(logits: Tensor, top_k: int, top_p: float) -> bool:
    """Where the fused sampler (gpu_kernels/sampling.py: noise, tempered softmax, race and log-prob
    in one kernel) runs: CUDA, no top-k / top-p (RL's default), token ids below 2^24 (they pass
    through fp32)."""
    V = logits.shape[-1]
    return (
        sampling_kernels is not None
        and logits.is_cuda
        and not 0 < top_k < V
        and top_p >= 1.0
        and V < 2**24
    )


def sample_next(
    logits: Tensor, sampling: dict, seed_key: Tensor, rows: Tensor, position: Tensor
) -> tuple[Tensor, Tensor]:
    """One token per row of logits (B, V): the fused sampler where it applies, else the noise of
    (seed, row ids, position), then sample_tokens."""
    temperature = sampling["temperature"]
    top_k = sampling["top_k"]
    top_p = sampling["top_p"]
    if use_fused_sampler(logits, top_k, top_p):
        return sampling_kernels.sample_tokens(logits, temperature, seed_key, rows, position)
    noise = None if temperature == 0 else sampling_noise(seed_key, rows, position, logits.shape[-1])
    return sample_tokens(logits, temperature, top_k, top_p, noise)


def truncate(logprobs: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set to -inf every token outside the top-k, then outside the top-p mass of what is left (the
    smallest set of most likely tokens whose probability reaches top_p; the most likely token always
    stays). Tokens tied with the k-th keep their place. top_k 0 and top_p 1 switch each off."""
    if 0 < top_k < logprobs.shape[-1]:
        kth = logprobs.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if top_p < 1.0:
        logprobs = F.log_softmax(logprobs, dim=-1)  # renormalize over the top-k survivors
        sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
        sorted_probs = sorted_logprobs.exp()
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        drop_sorted = mass_before >= top_p
        # back from sorted order to token order
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logprobs = logprobs.masked_fill(drop, float("-inf"))
    return logprobs


@torch.no_grad()
def generate(
    model: MoETransformer,
    prompts,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_id: int | None = None,
    pad_id: int = 0,
    seed: int = 0,
    cuda_graph: bool = True,
    row_offset: int = 0,
    decode_hand_offs: dict | None = None,
) -> Rollout:
    """Sample num_samples completions of each prompt (a list of token-id lists, any lengths) ->
    Rollout.

    temperature 0 is greedy; top_k 0 and top_p 1 disable truncation. eos_id None: every row runs to
    max_new_tokens. pad_id fills prompt padding and the columns after EOS (any valid token id). seed
    and row_offset choose the sampling noise: row n of this call draws the noise of row id
    row_offset + n (so a process sampling rows [r, r + N) of a larger batch gets exactly those rows'
    tokens). cuda_graph: replay the decode step as a CUDA graph (CUDA only; False runs it eagerly).
    decode_hand_offs: {layer path: object} handed to the layers on every decode step's forward
    (moe.py's hand_offs; TRACE's rac.InputRecorder slots); the decode then runs eagerly. Runs under
    no_grad (not inference_mode, so the results can serve as constants in the trainer's graph).
    """
    c = model.config
    device = model.embed.weight.device
    prompts = _check_arguments(
        c,
        prompts,
        num_samples,
        max_new_tokens,
        temperature,
        top_p,
        top_k,
        eos_id,
        pad_id,
        seed,
        row_offset,
    )
    P = len(prompts)
    G = num_samples
    N = P * G
    lengths = [len(p) for p in prompts]
    prompt_width = -(-max(lengths) // PROMPT_WIDTH_MULTIPLE) * PROMPT_WIDTH_MULTIPLE
    prompt_width = min(prompt_width, c.max_seq_len)
    sampling = dict(
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        eos_id=eos_id,
        pad_id=int(pad_id),
    )
    use_graph = cuda_graph and device.type == "cuda" and decode_hand_offs is None
    state = get_decode_state(model, N, prompt_width, max_new_tokens, sampling, use_graph)

    # ---- prefill: each prompt once, its keys/values copied to its G rows of the cache
    left_padded = [[int(pad_id)] * (prompt_width - len(p)) + p for p in prompts]
    prompt_ids = torch.tensor(left_padded, device=device)  # (P, Tp)
    pad_lengths = prompt_width - torch.tensor(lengths, dtype=torch.int64, device=device)  # (P,)
    # (P, V) and (L, P, Tp, A)
    last_logits, prompt_routes = prefill(model, state.cache, prompt_ids, pad_lengths, G)
    if use_graph and not state.capture_tried:
        capture_decode_graph(model, state)

    # ---- first token of every sample, from its prompt's last logits; reset the decode buffers
    state.seed.fill_(seed_key(seed))
    state.row_ids.copy_(torch.arange(row_offset, row_offset + N, device=device))
    first_logits = last_logits.repeat_interleave(G, dim=0)  # (N, V)
    position = torch.zeros_like(state.seed)  # completion position 0
    tokens, logprobs = sample_next(first_logits, sampling, state.seed, state.row_ids, position)
    state.pad_lengths.copy_(pad_lengths.repeat_interleave(G))
    state.cache.length.fill_(prompt_width)
    state.next_input.copy_(tokens[:, None])
    state.alive.fill_(True)
    state.tokens.fill_(pad_id)
    state.tokens[:, 0] = tokens
    state.token_mask.zero_()
    state.token_mask[:, 0] = True
    state.token_logprobs.zero_()
    state.token_logprobs[:, 0] = logprobs

    # ---- decode: step t feeds completion token t (recording its routes) and samples token t + 1
    check_interval = FINISHED_CHECK_INTERVAL if device.type == "cuda" else 1
    for step in range(max_new_tokens):
        if state.graph is not None:
            state.graph.replay()
        else:
            decode_step(model, state, decode_hand_offs)
        checking = (step + 1) % check_interval == 0 and step + 1 < max_new_tokens
        if eos_id is not None and checking:
            if not bool(state.alive.any()):  # the one host sync, every check_interval steps
                break

    # ---- trim to the longest completion (every kept token has been fed: its routes are recorded)
    width = int(state.token_mask[:, :max_new_tokens].sum(dim=1).max())
    trim = prompt_width - max(lengths)  # columns of padding shared by every row
    prompt_mask = torch.arange(prompt_width, device=device) >= state.pad_lengths[:, None]  # (N, Tp)
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(G, dim=0)[:, trim:],
        prompt_mask=prompt_mask[:, trim:],
        prompt_lengths=prompt_width - state.pad_lengths.clone(),
        completion_ids=state.tokens[:, :width].clone(),
        completion_mask=state.token_mask[:, :width].clone(),
        logprobs=state.token_logprobs[:, :width].clone(),
        routes=state.routes[:, :, :width].clone(),
        prompt_routes=prompt_routes.repeat_interleave(G, dim=1)[:, :, trim:],
        num_samples=G,
        temperature=float(temperature),
        pad_id=int(pad_id),
        used_cuda_graph=state.graph is not None,
    )


@torch.no_grad()
def score(model: MoETransformer, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """Re-score token rows with the rollout model in one prefill (no sampling, no cache):
    (N, W) -> (N, W).

    fp32; column j holds log_softmax(z_{j-1} / temperature)[tokens[:, j]], the log-prob of token j
    given the tokens before it, exactly what `generate` records while sampling (temperature 0:
    untempered); column 0 has no context and holds 0. Rows are right-padded (`Sequences.tokens`):
    with causal attention the padding after a row's end never reaches its tokens, so no mask is
    needed; the values at padding columns are meaningless (mask them with `Sequences.loss_mask`).

    Why: the same tokens in one prefill instead of one decode step at a time separate the engine's
    own nondeterminism (a token's rounding depends on the other rows of its GEMM, e.g. through a
    dynamic activation scale) from the trainer's precision. Chunks of at most PREFILL_LOGITS_BUDGET
    logits.
    """
    _require(
        tokens.dim() == 2 and tokens.dtype in (torch.int64, torch.int32),
        f"tokens must be an integer tensor (N, W), got {tuple(tokens.shape)} {tokens.dtype}",
    )
    _require(
        tokens.shape[1] >= 2,
        f"tokens must have at least 2 columns (a context and a token), got {tuple(tokens.shape)}",
    )
    _require(temperature >= 0, f"temperature must be >= 0 (0 = untempered), got {temperature!r}")
    N, W = tokens.shape
    chunk = max(1, PREFILL_LOGITS_BUDGET // (W * model.config.vocab_size))
    logprobs = torch.zeros(N, W, dtype=torch.float32, device=tokens.device)
    for start in range(0, N, chunk):
        rows = tokens[start : start + chunk]
        logits = model(rows)[:, :-1].float()  # (n, W-1, V)
        # the sampler's own formula (sample_tokens), so that only the model's numerics can differ
        if temperature > 0:
            logits = logits / temperature
        token_logprobs = F.log_softmax(logits, dim=-1)  # (n, W-1, V)
        next_tokens = rows[:, 1:, None].long()  # (n, W-1, 1)
        logprobs[start : start + chunk, 1:] = token_logprobs.gather(-1, next_tokens).squeeze(-1)
    return logprobs


def _require(ok, message: str, error: type = ValueError) -> None:
    if not ok:
        raise error(message)


def _integer_dtype(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _is_token_id(value) -> bool:
    """A Python or NumPy integer, or an integer 0-d tensor (not a bool, not a float with an integer
    value)."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and _integer_dtype(value)
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def _token_ids(prompt, name) -> list[int]:
    """One prompt (a list/tuple of integers or a 1-D integer tensor) -> list of ints; anything else,
    such as a string or float ids, is a TypeError naming the argument (int() would silently
    truncate 2.7)."""
    if isinstance(prompt, Tensor):
        _require(
            prompt.dim() == 1 and _integer_dtype(prompt),
            f"{name} must be a 1-D integer tensor of token ids, "
            f"got {prompt.dtype} of shape {tuple(prompt.shape)}",
            TypeError,
        )
        return prompt.tolist()
    text = " (encode text with the tokenizer first)" if isinstance(prompt, (str, bytes)) else ""
    _require(
        isinstance(prompt, (list, tuple)),
        f"{name} must be a list of integer token ids, got {type(prompt).__name__}{text}",
        TypeError,
    )
    bad = [t for t in prompt if not _is_token_id(t)]
    if bad:
        raise TypeError(
            f"{name} must hold integer token ids, got {bad[0]!r} ({type(bad[0]).__name__})"
        )
    return [int(t) for t in prompt]


def _check_arguments(
    config,
    prompts,
    num_samples,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    eos_id,
    pad_id,
    seed,
    row_offset,
) -> list[list[int]]:
    """Validate generate's arguments (each failure one line naming the argument); return the prompts
    as lists of ints."""
    _require(
        isinstance(prompts, (list, tuple)) and len(prompts) > 0,
        "prompts must be a non-empty list of token-id lists (one list per prompt, any lengths)",
    )
    prompts = [_token_ids(prompt, f"prompts[{i}]") for i, prompt in enumerate(prompts)]
    V = config.vocab_size
    max_len = config.max_seq_len
    for i, prompt in enumerate(prompts):
        _require(len(prompt) > 0, f"prompt {i} is empty; every prompt needs at least one token")
        outside = [t for t in prompt if not 0 <= t < V]
        if outside:
            raise ValueError(
                f"prompts[{i}] holds token id {outside[0]}, outside [0, {V}) (the vocabulary)"
            )
    for name, value in (("num_samples", num_samples), ("max_new_tokens", max_new_tokens)):
        _require(
            isinstance(value, int) and value >= 1, f"{name} must be an int >= 1, got {value!r}"
        )
    longest = max(map(len, prompts))
    _require(
        longest + max_new_tokens <= max_len,
        f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
        f"exceeds the model's max_seq_len={max_len}",
    )
    # NaN fails the comparison, so it is refused too
    _require(temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    _require(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p!r}")
    _require(
        isinstance(top_k, int) and top_k >= 0, f"top_k must be an int >= 0 (0 = off), got {top_k!r}"
    )
    _require(
        eos_id is None or _is_token_id(eos_id),
        f"eos_id must be None or an integer token id, got {eos_id!r}",
        TypeError,
    )
    _require(_is_token_id(pad_id), f"pad_id must be an integer token id, got {pad_id!r}", TypeError)
    _require(
        eos_id is None or 0 <= eos_id < V,
        f"eos_id must be None or a token id in [0, {V}), got {eos_id!r}",
    )
    _require(
        0 <= pad_id < V,
        f"pad_id must be a token id in [0, {V}) (finished rows feed it to the model), "
        f"got {pad_id!r}",
    )
    _require(
        not isinstance(seed, bool) and isinstance(seed, int) and 0 <= seed < 2**63,
        f"seed must be an int in [0, 2^63), got {seed!r}",
    )
    _require(
        not isinstance(row_offset, bool) and isinstance(row_offset, int) and row_offset >= 0,
        f"row_offset must be an int >= 0, got {row_offset!r}",
    )
    return prompts
