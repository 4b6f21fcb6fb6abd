"""The rollout side: NVFP4 W4A4 layers with residual activation compensation (RAC), the conversion of a
moe.py model into its rollout twin, weight sync, and the Triton (and Gluon) GEMMs those layers run on.

A rollout layer computes y = x @ W.T, W (N, K), both operands blocked by 16 along K (G = K / 16 blocks):

    W_q = quantize_weight(W)              nvfp4.py's one weight rule: the codes qat.py trains with
    x_q = Q(x)                            NVFP4 with a dynamic global scale amax(|x|) / (6 * 448) per call
    r   = x - DQ(x_q)                     the activation's quantization residual, exact in fp32
    r_q = Q(S * r)                        S keeps whole 16-channel blocks: the round(rac_ratio * G) blocks
                                          with the largest mean |r| (calibrated), zero elsewhere
    y   = DQ(x_q) @ DQ(W_q).T + DQ(r_q) @ DQ(W_q).T  =  (DQ(x_q) + DQ(r_q)) @ DQ(W_q).T

Compensating whole blocks keeps the weight's codes and block scales valid for the residual term: the
GEMM applies both activation terms to the weight tile it already holds, so RAC never re-reads weights.
rac_ratio 0 is naive NVFP4; 1 compensates every block (QUADS uses about 0.5). The residual shares x's
global scale: a residual block is 6-16x smaller than its x block, so its E4M3 block scale still fits.
(quantize_activation_reference is these lines in code.)

Why a dynamic global scale: in RL the weights change every step, so a calibrated static activation
scale goes stale between syncs, and anything above it saturates: exactly the outlier channels that
hurt NVFP4 most. The price is that a token's rounding depends on the largest value in its batch.

How to read this file: the idea first, as the slow twins (plain PyTorch: quantize, dequantize, matmul in
fp32), then block selection, the experts' weight layout, the layers (each runs the Triton path on a GPU of
compute capability 8.9+, whose E4M3 conversions the kernels use, and its twin elsewhere), conversion and
sync. Then what the fast path needs: input checks, the twins of the Hopper kernels' fp16 operands, and the
kernels, one section per twin (quantizer, dense GEMM, experts' grouped GEMM in Triton and in Gluon,
Blackwell), each ending with the function that launches them; last, the one place a hardware path is
chosen.

Hopper kernels (also run on the CPU under TRITON_INTERPRET=1). Hopper has no FP4 tensor cores and
`tl.dot_scaled` does not compile for sm_90, so the weight is decoded in registers: an E2M1 code c put
in an E4M3 byte as (c & 7) << 2 | (c & 8) << 4 *is* c's value times 2^-6 (OPERAND_SHIFT), and the
hardware E4M3 -> fp16 conversion times the block scale gives value * block_scale * 2^-6 exactly (<= 6
significant bits). The activation operand is (DQ(x_q) + DQ(r_q)) / global_scale * 2^-6 in fp16: exact
for each term; the sum rounds to fp16's 11 bits (bf16's 8 would lose much of what the residual adds
back). A weight byte holds elements 2i and 2i+1, so K is consumed as an even and an odd half: two
products per K step, no shuffles. Accumulation is fp32; 2^12 (EPILOGUE_SCALE) and both global scales
are applied at the end.
  - Decode: one quantizer launch writes the fp16 operand once (codes, block scales, the residual of the
    selected blocks: nvfp4.py's arithmetic, bit-identical to the twin). At one token the GEMM is a GEMV
    on fp32 FMAs (tl.dot needs 16 rows): each program streams a few weight rows over all of K, and it
    loads its first weight tile while the quantizer still runs. Quantizing x inside the GEMV measured
    slower: every program repeats the whole of x's quantization chain. More rows: the GEMM decodes its
    weight tile in registers and runs the fp16 tensor cores, as y.T = W @ x.T (the weight rows on the
    MMA's wide side) or, X_FIRST, as y = x @ W.T. Which is faster depends on the shape; the autotuner
    picks among both. Split-K gives the weight stream enough programs: each split stores a partial tile,
    and the last to arrive (an atomic counter per tile) sums them in a fixed order: deterministic.
  - Prefill (M >= PREFILL_ROWS): one pass decodes the weight to fp16 (exactly), then both operands
    stream into shared memory; an in-register decode would repeat M / BLOCK_M times (slower from a
    few hundred rows on: bench.py).
  - Experts: one grouped launch over (expert, row tile, N tile). Rows are sorted by expert once
    (moe.route_tokens); a program finds its expert from the per-expert counts on the device (no host
    sync), so experts without tokens cost nothing. The gate/up GEMM gathers token rows and applies
    SwiGLU in its epilogue; the down GEMM scales each row by its router weight, read through
    routing.order (no gather launch). The expert weights are stored in ExpertWeights' blocked layout
    (16-row blocks by 128-element K chunks), so that a program streams a few contiguous runs. On sm_89
    and sm_90 the kernel is written in Gluon, Triton's layout-explicit dialect, to decode the codes
    straight into mma.sync's operand registers with the weight rows on the MMA's left, in tiles of 8 to
    64 token rows (a tile at most half full runs as a tile of half the rows, one at most three quarters
    full as half plus a quarter; GPU only: the CPU tests compile it for sm_90). The Triton kernel
    (X_FIRST at decode) runs under the interpreter, for K not a multiple of 64, and where Triton has no
    Gluon.
  - Stacked weights: up to three weights (an attention's q/k/v_proj) in one GEMM, each weight's global
    scale applied to its own columns and its output stored as its own (M, N_i) tensor.
  - Launches (sm_90+): programmatic dependent launch. A kernel may be launched while the one ahead of it
    still runs, and its programs wait for that kernel's end before any load or store. The partial max
    and the experts' quantizers let the next kernel launch as soon as they have started: it runs many
    waves of programs. Before a dense GEMM of about one wave that cost more than it saved. The one-token
    quantizer lets the GEMV launch early too, which loads its first weight tile before it waits (the
    one load allowed before the wait).
Blackwell (sm_100+): `tl.dot_scaled(..., "e2m1", ...)` reads the packed codes and E4M3 scales as they
are (dense and grouped). Chosen in one place (`gemm_backend`), checked against the Hopper kernels on
first use and dropped with a one-line warning if they disagree. Its numerics are UNTESTED (no such GPU
here; the interpreter reads E4M3 scales as E8M0); a CPU test compiles it for sm_100.

Shape letters: M rows (tokens or token-expert assignments), K reduction dim, N output features,
G = K / 16 blocks, T tokens, A active experts per token, R = T * A assignments, E experts,
D model dim, I expert hidden dim.

An attention's q/k/v_proj read one input: they share one block selection, one quantization and one
GEMM over their stacked weights, each weight's global scale on its own columns (SharedInput).

Left out: static activation scales, a gate/up-style stacking of q/k/v in the trainer (qat.py keeps
three layers), per-expert RAC block selection (one selection per layer input), FP4 KV caches. The FP8
baseline lives in fp8.py.
"""
import itertools
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8
import moe
import nvfp4
from nvfp4 import BLOCK_SIZE, NVFP4Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # triton ships with CUDA builds of torch on Linux; without it the torch twins run
    triton = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # Triton before 3.5: the experts run on the Triton kernel
    gluon = None

MODES = ("bf16", "fp8", "nvfp4")
OPERAND_SHIFT = 2.0 ** -6          # the Hopper kernels' fp16 operands hold value * block_scale * 2^-6
EPILOGUE_SCALE = OPERAND_SHIFT ** -2  # 2^12: undoes the two operands' 2^-6
AMAX_IN_LAUNCH = 4096             # inputs up to this size (M * K): the quantizer reduces the amax itself
GEMV_ROWS, GEMV_WARPS = 4, 4       # the one-token GEMV's weight rows and warps a program
GEMV_BLOCK_K = 4096                # ... and its K step: up to this, all of K is one load
PREFILL_ROWS = 257                 # from this many rows on, the weight is decoded once per call
EARLY_LAUNCH_PROGRAMS = 256        # an experts' quantizer launch this small lets the GEMM launch as it starts
EXPERT_ROW_BLOCK = 16              # expert weights are stored in blocks of 16 rows ...
EXPERT_K_CHUNK = 128               # ... by chunks of 128 elements of K (all of K when it is not a multiple)
KERNEL_CAPABILITY = (8, 9)         # the kernels' E4M3 conversions (cvt.*.e4m3x2) need sm_89 or later
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_OLD_GPUS_WARNED = set()


def use_triton(x):
    """The one test for the fast path: Triton on CUDA tensors of a GPU the kernels compile for (compute
    capability 8.9+), the torch twins elsewhere; on an older GPU (an A100: 8.0) with a warning, once."""
    if not nvfp4._use_triton(x):
        return False
    capability, index = _capability(x.device), _cuda_index(x.device)
    if capability >= KERNEL_CAPABILITY:
        return True
    if index not in _OLD_GPUS_WARNED:
        _OLD_GPUS_WARNED.add(index)
        need, have = ".".join(map(str, KERNEL_CAPABILITY)), ".".join(map(str, capability))
        warnings.warn(f"rac: the W4A4 kernels need compute capability {need}+ (this GPU: {have}); the NVFP4 "
                      "layers run their torch twins (correct, slow)", stacklevel=2)
    return False


# ======================================================================== the slow twins (plain PyTorch)
def quantize_activation_reference(x, rac_mask=None):
    """x (M, K) -> (x_q, residual): NVFP4 codes of x (dynamic global scale), and of the residual
    x - DQ(x_q) on the blocks where rac_mask (G,) is True (zero elsewhere), with x's global scale;
    residual is None without a mask."""
    _check_matrix(x, "quantize_activation_reference")
    _check_rac_mask(rac_mask, x)
    return nvfp4.quantize_activation(x, rac_mask)


def _compensated(x_q, residual):
    """DQ(x_q) + DQ(residual) in fp32, or DQ(x_q) alone: the activation the layer's GEMM multiplies."""
    x = nvfp4.dequantize_reference(x_q, torch.float32)
    return x if residual is None else x + nvfp4.dequantize_reference(residual, torch.float32)


def matmul_reference(x_q, w_q, residual=None, out_dtype=torch.bfloat16, w=None):
    """(DQ(x_q) + DQ(residual)) @ DQ(w_q).T in fp32: x_q (M, K), w_q (N, K) -> (M, N) out_dtype. w: DQ(w_q)
    in fp32 when the caller keeps it (the rollout layers do, between weight loads)."""
    _check_operands(x_q, w_q, residual, "matmul_reference")
    x = _compensated(x_q, residual)
    w = nvfp4.dequantize_reference(w_q, torch.float32) if w is None else w
    return (x @ w.T).to(out_dtype)


def nvfp4_linear_reference(x, w_q, rac_mask=None):
    """The NVFP4 layer's twin: quantize x (and its RAC residual), dequantize, fp32 matmul -> (M, N) fp32."""
    x_q, residual = quantize_activation_reference(x, rac_mask)
    return matmul_reference(x_q, w_q, residual, out_dtype=torch.float32)


def grouped_matmul_reference(x_q, w_q, counts, residual=None, row_ids=None, row_weights=None, swiglu=False,
                             out_dtype=torch.bfloat16, w=None, row_weight_ids=None):
    """The experts' GEMM: rows (x_q's, or x_q[row_ids]) grouped by expert, counts (E,) rows each, row
    block e multiplied by DQ(w_q[e]).T (w_q (E, N, K): an NVFP4Tensor, or ExpertWeights). swiglu: the N
    weight rows are [gate; up] and the output is silu(gate) * up (N/2 columns). Output row r is scaled by
    row_weights[r], or by row_weights[row_weight_ids[r]] (the router weights (T * A,) and routing.order).
    A loop in fp32. w: DQ(w_q) in fp32 when the caller keeps it."""
    _check_operands(x_q, w_q, residual, "grouped_matmul_reference", stacked=True)
    _check_row_weights(row_weights, row_weight_ids, row_ids.numel() if row_ids is not None else x_q.shape[0],
                       "grouped_matmul_reference")
    x = _compensated(x_q, residual)
    if row_ids is not None:
        x = x[row_ids]                                                                  # (R, K)
    w = _dequantized(w_q) if w is None else w                                           # (E, N, K)
    outputs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        y = x[start:start + n] @ w[e].T                                                 # (n, N)
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up                                                       # (n, N/2)
        outputs.append(y)
        start += n
    y = torch.cat(outputs)
    if row_weights is not None:
        row_weights = row_weights if row_weight_ids is None else row_weights[row_weight_ids]    # (R,)
        y = y * row_weights.float()[:, None]
    return y.to(out_dtype)


# ======================================================================== RAC block selection
def block_residual_error(x):
    """Mean |x - DQ(Q(x))| per 16-channel block of x (M, K), with x's dynamic global scale -> (G,) fp32."""
    residual = x.float() - nvfp4.dequantize(nvfp4.quantize(x), torch.float32)          # (M, K)
    return residual.abs().reshape(-1, x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE).mean(dim=(0, 2))


class RACSelector(nn.Module):
    """Which 16-channel blocks of one layer input get residual compensation: the `mask` buffer (G,)
    bool, True on the round(rac_ratio * G) (half up) blocks with the largest mean |x - DQ(Q(x))| over
    the calibration inputs. `calibrate_rac` opens a calibration window (start / finish); a selector
    that was never calibrated calibrates from the first input it sees. Ratio 0 selects nothing."""

    def __init__(self, n_blocks, rac_ratio=0.0, device=None):
        super().__init__()
        self.n_blocks = n_blocks
        self.register_buffer("mask", torch.zeros(n_blocks, dtype=torch.bool, device=device))
        self.register_buffer("error_sum", torch.zeros(n_blocks, dtype=torch.float64, device=device),
                             persistent=False)
        self.set_ratio(rac_ratio)

    def set_ratio(self, rac_ratio):
        _check_ratio(rac_ratio)
        self.rac_ratio = float(rac_ratio)
        self.n_selected = int(self.rac_ratio * self.n_blocks + 0.5)
        self.mask.fill_(self.n_selected == self.n_blocks)
        self.calibrated = self.n_selected in (0, self.n_blocks)   # nothing to choose
        self.calibrating = False

    def start_calibration(self):
        self.error_sum.zero_()
        self.calibrating = True

    def finish_calibration(self):
        self.calibrating, self.calibrated = False, True

    @torch.no_grad()
    def forward(self, x):
        """x (M, K) -> the mask (G,) bool to use now, or None for naive NVFP4."""
        if self.n_selected == 0:
            return None
        if self.calibrating or not self.calibrated:
            self.error_sum += block_residual_error(x).double() * x.shape[0]
            self.mask.zero_()
            self.mask[torch.topk(self.error_sum, self.n_selected).indices] = True
            self.calibrated = self.calibrated or not self.calibrating
        return self.mask

    def extra_repr(self):
        return f"n_blocks={self.n_blocks}, rac_ratio={self.rac_ratio}, n_selected={self.n_selected}"


# ======================================================================== the experts' weight layout
class ExpertWeights(NamedTuple):
    """Stacked expert weights (E, N, K) in the order the grouped kernels stream them: each expert's rows in
    blocks of EXPERT_ROW_BLOCK, each block's K in chunks of `chunk` elements, one (block, chunk) stored as
    one run of 16 rows x chunk/2 bytes. A program's weight tile for a K step is then a few such runs, and
    its whole stream a few contiguous regions, where row-major codes give it 64-byte pieces 1 KB apart:
    the Gluon kernel's gate/up GEMM at 64 decode tokens took 84 us on it against 102 us on row-major codes
    (H200, README). The codes and scales are nvfp4.quantize_weight's, moved (chunk_experts,
    unchunk_experts)."""
    data: torch.Tensor          # uint8 (E, N / 16, K / chunk, 16, chunk / 2)
    block_scale: torch.Tensor   # float8_e4m3fn (E, N / 16, K / chunk, 16, chunk / 16)
    global_scale: torch.Tensor  # float32 (E,)

    @property
    def shape(self):
        E, blocks, chunks, rows, half = self.data.shape
        return (E, blocks * rows, chunks * half * 2)

    @property
    def chunk(self):
        return self.data.shape[-1] * 2

    @property
    def device(self):
        return self.data.device


def expert_chunk(K):
    return EXPERT_K_CHUNK if K % EXPERT_K_CHUNK == 0 else K


def chunk_experts(w_q):
    """NVFP4Tensor (E, N, K) -> ExpertWeights (N a multiple of 16)."""
    E, N, K = w_q.shape
    chunk, rows = expert_chunk(K), EXPERT_ROW_BLOCK
    if N % rows:
        raise ValueError(f"chunk_experts: N={N} rows is not a multiple of {rows}")

    def blocked(t, per_byte):  # (E, N, K / per_byte) -> (E, N / 16, K / chunk, 16, chunk / per_byte)
        return t.reshape(E, N // rows, rows, K // chunk, chunk // per_byte).transpose(2, 3).contiguous()
    return ExpertWeights(blocked(w_q.data, 2), blocked(w_q.block_scale, BLOCK_SIZE), w_q.global_scale)


def unchunk_experts(w):
    """ExpertWeights -> NVFP4Tensor (E, N, K): a view when K is one chunk, else a copy."""
    E, N, _ = w.shape
    return NVFP4Tensor(*(t.transpose(2, 3).reshape(E, N, -1) for t in (w.data, w.block_scale)),
                       w.global_scale)


# ======================================================================== rollout layers
class DequantizedWeight:
    """DQ(W) in fp32 for a layer's twin path (the CPU's), kept while the weight's three buffers are the same
    tensors, unmodified since (their version counters): load_weight and sync_weights write into them, so
    the next call dequantizes again. Without it the twin dequantizes every fixed rollout weight at every
    decode step (a sixth of `python train.py`'s time on a CPU). Costs an fp32 copy of the weights; the
    Triton path never uses it. Inference tensors keep no version counter: those are never kept."""

    def __init__(self):
        self.tensors, self.versions, self.value = (), (), None

    def __call__(self, q):
        tensors = (q.data, q.block_scale, q.global_scale)
        if any(t.is_inference() for t in tensors):
            return _dequantized(q)
        versions = tuple(t._version for t in tensors)
        if not (len(self.tensors) == 3 and all(a is b for a, b in zip(tensors, self.tensors))
                and versions == self.versions):
            self.tensors, self.versions = tensors, versions  # held: their memory is not reused meanwhile
            self.value = _dequantized(q)
        return self.value


def _dequantized(q):
    """DQ(q) in fp32, (..., N, K): an NVFP4Tensor, or experts' ExpertWeights."""
    q = unchunk_experts(q) if isinstance(q, ExpertWeights) else q
    return nvfp4.dequantize_reference(q, torch.float32)


def _quantized_input(x2, rac_mask):
    """What a layer's GEMM takes of x2 (M, K): layer_input on the Triton path, else the twin's codes."""
    if use_triton(x2):
        return layer_input(x2, rac_mask)
    return quantize_activation_reference(x2, rac_mask)


class NVFP4Linear(nn.Module):
    """W4A4 replacement for nn.Linear: NVFP4 weights (nvfp4.quantize_weight), activations quantized
    per call, RAC on the blocks its RACSelector picks. `weight_q` is the packed NVFP4Tensor."""

    def __init__(self, in_features, out_features, bias=False, rac_ratio=0.0, device=None):
        super().__init__()
        _check_features(in_features, "NVFP4Linear")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_data", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                        device=device))
        self.register_buffer("weight_block_scale", torch.zeros(out_features, in_features // BLOCK_SIZE,
                                                               dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones((), dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
                     if bias else None)
        self.rac = RACSelector(in_features // BLOCK_SIZE, rac_ratio, device=device)
        self.weight_fp32 = DequantizedWeight()  # the twin path's DQ(W)
        self.shared_input = None  # a SharedInput when layers read the same input (convert_for_rollout)

    @property
    def weight_q(self):
        return NVFP4Tensor(self.weight_data, self.weight_block_scale, self.weight_global_scale)

    @classmethod
    def from_float(cls, linear, rac_ratio=0.0):
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    rac_ratio=rac_ratio, device=linear.weight.device)
        layer.load_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_weight(self, weight, bias=None):
        """Quantize a master weight (N, K) with nvfp4.quantize_weight, in place (the trainer's rule)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"NVFP4Linear: weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        q = nvfp4.quantize_weight(weight.detach())
        self.weight_data.copy_(q.data)
        self.weight_block_scale.copy_(q.block_scale)
        self.weight_global_scale.copy_(q.global_scale)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        fp8.check_layer_input(x, self.in_features, self.weight_data.device, "NVFP4Linear")
        x2 = x.reshape(-1, self.in_features)                                             # (M, K)
        if self.shared_input is not None:
            y = self.shared_input.output(self, x, x2)
        else:
            rac_mask = self.rac(x2)
            y = self._matmul(x2, _quantized_input(x2, rac_mask))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _matmul(self, x2, act):
        """x2 (M, K) @ DQ(W).T in x2's dtype, on act = _quantized_input(x2, rac_mask)."""
        if use_triton(x2):
            return layer_matmul(act, self.weight_q, x2.dtype)
        x_q, residual = act                                                              # the twin's codes
        w_q = self.weight_q
        return matmul_reference(x_q, w_q, residual, torch.float32, self.weight_fp32(w_q)).to(x2.dtype)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, rac_ratio={self.rac.rac_ratio}"


def stack_weights(weights):
    """NVFP4 weights (N_i, K), each with its own global scale, as one (sum N_i, K) NVFP4Tensor whose
    global_scale holds the (len(weights),) scales: what nvfp4_linear_triton takes with splits = the N_i."""
    return NVFP4Tensor(torch.cat([w.data for w in weights]), torch.cat([w.block_scale for w in weights]),
                       torch.stack([w.global_scale.reshape(()) for w in weights]))


class SharedInput:
    """One input read by several NVFP4Linear layers (an attention's q_proj, k_proj and v_proj, which share
    one RACSelector). The first layer to read an input computes every layer's output and keeps the
    others' until each has read it once or another input arrives. On the Triton path that is one GEMM:
    the layers' weight buffers are views of one stacked NVFP4 weight (N_q + N_k + N_v rows), each
    weight's global scale applied to its own columns; equal to three GEMMs up to fp32 accumulation order.
    The twin path quantizes x once and runs each layer's own matmul: bit for bit unshared layers.
    Reuse needs the very tensor object, unmodified since (its version counter), so it is always of the
    values the layer would see itself. Inference tensors keep no version counter: each layer then runs
    alone."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.splits = [layer.out_features for layer in self.layers]
        self.input, self.version, self.outputs, self.waiting, self.warned = None, None, None, (), False
        self.weight_q = stack_weights([layer.weight_q for layer in self.layers])
        start = 0
        for i, (layer, rows) in enumerate(zip(self.layers, self.splits)):  # the buffers become views of it
            layer.weight_data = self.weight_q.data[start:start + rows]
            layer.weight_block_scale = self.weight_q.block_scale[start:start + rows]
            layer.weight_global_scale = self.weight_q.global_scale[i]
            start += rows
        self.offsets = self._offsets()

    def _offsets(self):
        q = self.weight_q
        return [mine.data_ptr() - stacked.data_ptr() for layer in self.layers
                for mine, stacked in ((layer.weight_data, q.data), (layer.weight_block_scale, q.block_scale),
                                      (layer.weight_global_scale, q.global_scale))]

    def _stacked(self):
        """The stacked weight, or None (and one warning) if a layer's buffers are no longer views of it."""
        if self._offsets() == self.offsets:
            return self.weight_q
        if not self.warned:
            warnings.warn("rac.SharedInput: q/k/v_proj's weights are no longer views of their stacked weight "
                          "(the model moved or a buffer was replaced after convert_for_rollout?): running "
                          "three GEMMs; convert after moving the model to keep one")
            self.warned = True
        return None

    def output(self, layer, x, x2):
        """`layer`'s output on x (x2: x as (M, K)), computed now or kept from the first reader of x."""
        if self.input is x and x._version == self.version and layer in self.waiting:
            self.waiting = tuple(other for other in self.waiting if other is not layer)
            y = self.outputs[self.layers.index(layer)]
            if not self.waiting:  # everyone has read it: keep nothing alive
                self.input = self.outputs = None
            return y
        rac_mask = layer.rac(x2)
        act = _quantized_input(x2, rac_mask)
        if x.is_inference():
            return layer._matmul(x2, act)
        stacked = self._stacked() if use_triton(x2) else None
        if stacked is not None:
            outputs = layer_matmul(act, stacked, x2.dtype, self.splits)
        else:
            outputs = [other._matmul(x2, act) for other in self.layers]
        self.input, self.version, self.outputs = x, x._version, outputs
        self.waiting = tuple(other for other in self.layers if other is not layer)
        return outputs[self.layers.index(layer)]


class NVFP4Experts(nn.Module):
    """W4A4 replacement for moe.Experts: stacked NVFP4 weights (one global scale per expert, the
    trainer's rule), two grouped GEMMs, RAC on each GEMM's input (one block selection per input)."""

    def __init__(self, n_experts, dim, expert_dim, rac_ratio=0.0, device=None):
        super().__init__()
        _check_features(dim, "NVFP4Experts (model dim)")
        _check_features(expert_dim, "NVFP4Experts (expert dim)")
        self.n_experts, self.dim, self.expert_dim = n_experts, dim, expert_dim
        E, D, I = n_experts, dim, expert_dim
        for name, (N, K) in (("gate_up", (2 * I, D)), ("down", (D, I))):  # in ExpertWeights' layout
            empty = NVFP4Tensor(torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device),
                                torch.zeros(E, N, K // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
                                torch.ones(E, dtype=torch.float32, device=device))
            for part, buffer in zip(("data", "block_scale", "global_scale"), chunk_experts(empty)):
                self.register_buffer(f"{name}_{part}", buffer)
        self.rac_gate_up = RACSelector(D // BLOCK_SIZE, rac_ratio, device=device)
        self.rac_down = RACSelector(I // BLOCK_SIZE, rac_ratio, device=device)
        self.gate_up_fp32, self.down_fp32 = DequantizedWeight(), DequantizedWeight()  # the twin path's

    @property
    def gate_up_w(self):
        return ExpertWeights(self.gate_up_data, self.gate_up_block_scale, self.gate_up_global_scale)

    @property
    def down_w(self):
        return ExpertWeights(self.down_data, self.down_block_scale, self.down_global_scale)

    @classmethod
    def from_float(cls, experts, rac_ratio=0.0):
        E, two_I, D = experts.gate_up_proj.shape
        layer = cls(E, D, two_I // 2, rac_ratio, device=experts.gate_up_proj.device)
        layer.load_weights(experts.gate_up_proj, experts.down_proj)
        return layer

    @torch.no_grad()
    def load_weights(self, gate_up_proj, down_proj):
        """Quantize the master stacks with nvfp4.quantize_weight (per-expert global scales), in place."""
        for name, w in (("gate_up", gate_up_proj), ("down", down_proj)):
            expected = getattr(self, f"{name}_w").shape
            if tuple(w.shape) != expected:
                raise ValueError(f"NVFP4Experts: {name} weight shape {tuple(w.shape)} does not match "
                                 f"{expected}")
            q = chunk_experts(nvfp4.quantize_weight(w.detach()))
            getattr(self, f"{name}_data").copy_(q.data)
            getattr(self, f"{name}_block_scale").copy_(q.block_scale)
            getattr(self, f"{name}_global_scale").copy_(q.global_scale)

    def forward(self, x, expert_ids, expert_weights):
        """x (T, D), expert_ids (T, A) int64, expert_weights (T, A) -> (T, D) in x.dtype, as moe.Experts."""
        fp8.check_layer_input(x, self.dim, self.gate_up_data.device, "NVFP4Experts")
        T, A = expert_ids.shape
        routing = moe.route_tokens(expert_ids, self.n_experts)
        forward = self._forward_triton if use_triton(x) else self._forward_reference
        y_sorted = forward(x, routing, expert_weights.reshape(-1))                       # (R, D), weighted
        return moe.sum_expert_rows(y_sorted, routing, A).to(x.dtype)

    def _forward_triton(self, x, routing, expert_weights):
        """x (T, D), routing, expert_weights (T * A,) -> (R, D): each sorted row times its router weight."""
        native = gemm_backend(x.device) == "native"  # codes for tl.dot_scaled, else the fp16 operand
        act = quantize_activation_triton(x, self.rac_gate_up(x), codes=native, operand=not native,
                                         early_launch=True)
        hidden = grouped_matmul_triton(act, self.gate_up_w, routing.counts, row_ids=routing.token_ids,
                                       swiglu=True, out_dtype=x.dtype)                   # (R, I)
        act = quantize_activation_triton(hidden, self.rac_down(hidden), codes=native, operand=not native,
                                         early_launch=True)
        return grouped_matmul_triton(act, self.down_w, routing.counts, row_weights=expert_weights,
                                     row_weight_ids=routing.order, out_dtype=x.dtype)    # (R, D)

    def _forward_reference(self, x, routing, expert_weights):
        """The twin: the same quantization steps, dequantized, a loop of fp32 matmuls over experts."""
        gate_up_w, down_w = self.gate_up_w, self.down_w
        x_q, residual = quantize_activation_reference(x, self.rac_gate_up(x))
        hidden = grouped_matmul_reference(x_q, gate_up_w, routing.counts, residual,
                                          row_ids=routing.token_ids, swiglu=True, out_dtype=x.dtype,
                                          w=self.gate_up_fp32(gate_up_w))
        h_q, residual = quantize_activation_reference(hidden, self.rac_down(hidden))
        return grouped_matmul_reference(h_q, down_w, routing.counts, residual, row_weights=expert_weights,
                                        out_dtype=torch.float32, w=self.down_fp32(down_w),
                                        row_weight_ids=routing.order)

    def extra_repr(self):
        return (f"n_experts={self.n_experts}, dim={self.dim}, expert_dim={self.expert_dim}, "
                f"rac_ratio={self.rac_gate_up.rac_ratio}")


# ======================================================================== conversion, sync, calibration
def convert_for_rollout(model, mode, rac_ratio=0.0, quantize_router=False, quantize_lm_head=False):
    """Swap a moe.py model's layers for rollout layers in place; returns the model.

    mode "bf16": unchanged. "fp8": W8A8 (fp8.FP8Linear, fp8.FP8Experts). "nvfp4": W4A4 (NVFP4Linear,
    NVFP4Experts) with residual compensation on round(rac_ratio * G) blocks of each layer input.
    Converted: every moe.Attention's nn.Linear projections and every moe.Experts (a qat.py model's
    layers subclass those, so it converts too); with the flags also the routers and the LM head. An
    attention's q/k/v_proj read one input: in nvfp4 mode they share its selection, its quantization and
    one GEMM (SharedInput).
    Embeddings and norms stay in full precision. The weights are quantized from the model's own.
    """
    if mode not in MODES:
        raise ValueError(f"unknown rollout mode {mode!r}; choose one of {list(MODES)}")
    _check_ratio(rac_ratio)
    if rac_ratio > 0 and mode != "nvfp4":
        raise ValueError(f"rac_ratio={rac_ratio} compensates NVFP4 activations; mode {mode!r} has none")
    if mode == "bf16":
        return model
    for parent, name, child in moe.swappable_layers(model, quantize_router, quantize_lm_head):
        experts = isinstance(child, moe.Experts)
        if mode == "nvfp4":
            new = (NVFP4Experts if experts else NVFP4Linear).from_float(child, rac_ratio)
        else:
            new = (fp8.FP8Experts if experts else fp8.FP8Linear).from_float(child)
        setattr(parent, name, new)
    for attention in model.modules():
        layers = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if isinstance(attention, moe.Attention) and all(isinstance(m, NVFP4Linear) for m in layers):
            shared = SharedInput(layers)  # one input x: one block selection, quantization and GEMM
            for layer in layers:
                layer.rac, layer.shared_input = layers[0].rac, shared
    return model


_QUANTIZED_LAYERS = (NVFP4Linear, NVFP4Experts, fp8.FP8Linear, fp8.FP8Experts)


@torch.no_grad()
def sync_weights(rollout_model, trainer_model):
    """Reload every rollout weight in place from the trainer's master weights.

    Quantized layers re-quantize the trainer's `weight` / `gate_up_proj` / `down_proj` (NVFP4 through
    nvfp4.quantize_weight, the function qat.py's fake quantization uses, so the rollout's codes are
    the trainer's QAT weights bit for bit; FP8 through its per-channel rule). Everything else in full
    precision (embeddings, norms, routers, LM head, bf16-mode layers) is copied by parameter name.
    The RAC block selection is left alone: call calibrate_rac when it should be refreshed.
    """
    params = dict(trainer_model.named_parameters(remove_duplicate=False))

    def master(path, name):
        key = f"{path}.{name}" if path else name
        if key not in params:
            raise ValueError(f"sync_weights: the trainer model has no parameter {key!r} "
                             f"(rollout layer {path!r})")
        return params[key]

    quantized = set()
    for path, module in rollout_model.named_modules():
        if isinstance(module, (NVFP4Linear, fp8.FP8Linear)):
            module.load_weight(master(path, "weight"),
                               master(path, "bias") if module.bias is not None else None)
        elif isinstance(module, (NVFP4Experts, fp8.FP8Experts)):
            module.load_weights(master(path, "gate_up_proj"), master(path, "down_proj"))
        if isinstance(module, _QUANTIZED_LAYERS):
            quantized.add(path)
    for name, param in rollout_model.named_parameters(remove_duplicate=False):
        path, _, leaf = name.rpartition(".")
        if path not in quantized:  # a quantized layer's bias was loaded above
            param.copy_(master(path, leaf))


@torch.no_grad()
def calibrate_rac(rollout_model, tokens):
    """Choose each NVFP4 layer input's compensated blocks from one forward pass on `tokens` (B, T).

    Each selector sees the activations its layer actually receives (upstream layers already run with
    their fresh selection) and keeps the blocks with the largest mean |x - DQ(Q(x))|. Call it after
    sync_weights, or every N steps: the caller decides. A selector's ratio is its own (RACSelector.set_ratio
    changes it). Returns the model.
    """
    selectors = [m for m in rollout_model.modules() if isinstance(m, RACSelector)]
    for selector in selectors:
        selector.start_calibration()
    try:
        rollout_model(tokens)
    finally:
        for selector in selectors:
            selector.finish_calibration()
    return rollout_model


# ======================================================================== input checks
def _check_ratio(rac_ratio):
    if not isinstance(rac_ratio, (int, float)) or not 0.0 <= rac_ratio <= 1.0:
        raise ValueError(f"rac_ratio must be a number in [0, 1], got {rac_ratio!r}")


def _check_features(features, name):
    if features % BLOCK_SIZE:
        raise ValueError(f"{name}: {features} features is not a multiple of the NVFP4 block size "
                         f"{BLOCK_SIZE}")


def _check_matrix(x, name):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a 2-D tensor (M, K), got {shape}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected bfloat16/float16/float32 activations, got dtype {x.dtype}")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: K={x.shape[-1]} is not a multiple of the NVFP4 block size {BLOCK_SIZE}")


def _check_rac_mask(rac_mask, x):
    if rac_mask is None:
        return
    n_blocks = x.shape[-1] // BLOCK_SIZE
    if (not isinstance(rac_mask, torch.Tensor) or rac_mask.dtype != torch.bool
            or rac_mask.shape != (n_blocks,)):
        got = (f"{rac_mask.dtype} {tuple(rac_mask.shape)}" if isinstance(rac_mask, torch.Tensor)
               else type(rac_mask).__name__)
        raise ValueError(f"rac_mask must be a bool tensor of shape (G,) = ({n_blocks},), got {got}")
    if rac_mask.device != x.device:
        raise ValueError(f"rac_mask is on {rac_mask.device} but the activation is on {x.device}")


def _check_operands(x_q, w_q, residual, name, stacked=False):
    for label, q in (("x_q", x_q), ("w_q", w_q), ("residual", residual)):
        allowed = (NVFP4Tensor, ExpertWeights) if stacked and label == "w_q" else NVFP4Tensor
        if q is not None and not isinstance(q, allowed):
            kinds = " or ExpertWeights" if isinstance(allowed, tuple) else ""
            raise ValueError(f"{name}: {label} must be an NVFP4Tensor{kinds}, got {type(q).__name__}")
    if len(x_q.shape) != 2 or len(w_q.shape) != (3 if stacked else 2):
        raise ValueError(f"{name}: expected x_q (M, K) and w_q {'(E, N, K)' if stacked else '(N, K)'}, "
                         f"got {x_q.shape} and {w_q.shape}")
    if x_q.shape[-1] != w_q.shape[-1]:
        raise ValueError(f"{name}: K differs: x_q {x_q.shape} vs w_q {w_q.shape}")
    if x_q.device != w_q.device:
        raise ValueError(f"{name}: x_q is on {x_q.device} but w_q is on {w_q.device}")
    if residual is not None:
        if residual.shape != x_q.shape or residual.device != x_q.device:
            raise ValueError(f"{name}: residual {residual.shape} on {residual.device} does not match x_q")
        if not torch.equal(residual.global_scale.reshape(()), x_q.global_scale.reshape(())):
            raise ValueError(f"{name}: the residual must share x_q's global scale")


def _check_row_weights(row_weights, row_weight_ids, n_rows, name):
    """The experts' GEMM scales row r by row_weights[r], or by row_weights[row_weight_ids[r]]."""
    if row_weight_ids is not None and (row_weights is None or row_weight_ids.shape != (n_rows,)):
        weights = None if row_weights is None else tuple(row_weights.shape)
        raise ValueError(f"{name}: row_weight_ids must index row_weights with one id per row ({n_rows},), "
                         f"got {tuple(row_weight_ids.shape)} and row_weights {weights}")
    if row_weights is not None and row_weight_ids is None and row_weights.shape != (n_rows,):
        raise ValueError(f"{name}: row_weights must hold one weight per row ({n_rows},), got "
                         f"{tuple(row_weights.shape)}")


# ======================================================================== twins of the Hopper fp16 operands
def _values_without_global_scale(q):
    """code_value * block_scale in fp32 (exact), (..., K)."""
    values = nvfp4.decode_e2m1(nvfp4.unpack_codes(q.data))                              # (..., K)
    values = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE) * q.block_scale.float().unsqueeze(-1)
    return values.reshape(q.shape)


def _planes(values):
    """(M, K) -> (2, M, K/2) fp16: even columns, then odd ones (the order a packed byte holds them)."""
    return torch.stack((values[:, 0::2], values[:, 1::2])).to(torch.float16).contiguous()


def activation_operand(x_q, residual=None):
    """Twin of the Hopper kernels' activation operand: (DQ(x_q) + DQ(residual)) / global_scale * 2^-6
    as fp16 planes (2, M, K/2). Each term is exact in fp32; the fp16 rounding of their sum is the one
    step the kernels add to matmul_reference."""
    values = _values_without_global_scale(x_q)
    if residual is not None:
        values = values + _values_without_global_scale(residual)
    return _planes(values * OPERAND_SHIFT)


def weight_operand_reference(w_q):
    """Twin of the prefill weight pass: DQ(w_q) / global_scale * 2^-6 as fp16 planes (2, N, K/2), exact."""
    return _planes(_values_without_global_scale(w_q) * OPERAND_SHIFT)


# ======================================================================== Triton: the activation quantizer
if triton is not None:
    from kernels.nvfp4_quantize import _e2m1_value, _load_pairs, _quantize_pairs, _to_bf16_bits, \
        contiguous_pairs, pair_view

    _DIVISOR = tl.constexpr(nvfp4.GLOBAL_SCALE_DIVISOR)  # 2688: global_scale = amax / (6 * 448)
    _SHIFT = tl.constexpr(OPERAND_SHIFT)
    _EPILOGUE = tl.constexpr(EPILOGUE_SCALE)
    EXPERT_ROWS = tl.constexpr(EXPERT_ROW_BLOCK)

    @triton.jit
    def _after_previous_kernel(PDL: tl.constexpr, EARLY: tl.constexpr = False):
        """PDL (programmatic dependent launch, sm_90+): this kernel may start while the one before it in the
        stream still runs, so each program first waits for that kernel's end and writes, before any load or
        store. EARLY: the next kernel may launch once every program of this one has started."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            if EARLY:
                tl.extra.cuda.gdc_launch_dependents()

    # Twin: quantize_activation_reference (codes) and activation_operand (the fp16 operand). A program
    # quantizes BLOCKS 16-element blocks of the flattened (M * G, 16) input as two (BLOCKS, 8) tiles of
    # even and odd elements (nvfp4.py's pair layout: a bf16 pair is one 32-bit load, and a packed byte
    # is code(even) | code(odd) << 4) with nvfp4.py's own arithmetic: bit for bit the twin.
    @triton.jit
    def _scale_from_amax(amax):
        """nvfp4.compute_global_scale: amax / 2688, 1.0 for an all-zero input, NaN if not finite."""
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, _DIVISOR))
        return tl.where(amax < float("inf"), scale, float("nan"))

    @triton.jit
    def _abs_max(x_ptr, start, stop, CHUNK: tl.constexpr):
        """max |x| over elements start..stop (a strided loop of CHUNK-wide loads); NaN counts as Inf."""
        running = tl.zeros((CHUNK,), dtype=tl.float32)
        for begin in range(start, stop, CHUNK):
            offs = begin + tl.arange(0, CHUNK)
            v = tl.abs(tl.load(x_ptr + offs, mask=offs < stop, other=0.0).to(tl.float32))
            running = tl.maximum(running, tl.where(v == v, v, float("inf")))
        return tl.max(running, axis=0)

    @triton.jit
    def _mul_rn(a, b, GPU: tl.constexpr):
        """a * b rounded to fp32 as a step of its own. A plain product followed by an addition is fused
        into one FMA by the GPU compiler, which skips that rounding (the twin makes it): mul.rn is never
        fused. Seen on the H200: RAC residual codes that differed from the twin's."""
        if GPU:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return a * b

    @triton.jit
    def _quantize_blocks(x_words_ptr, rac_mask_ptr, blocks, in_range, blocks_per_row, global_scale,
                         HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, GPU: tl.constexpr):
        """Flat block indices (BLOCKS,) -> codes and E4M3 bytes of x and of its RAC residual, and the
        operand values (DQ(x_q) + DQ(r_q)) / global_scale as fp32 (BLOCKS, 8) even and odd tiles."""
        pairs = tl.arange(0, 8)
        even, odd = _load_pairs(x_words_ptr, blocks, pairs, in_range[:, None], X_BF16)  # (BLOCKS, 8) each
        code_even, code_odd, block_scale, scale_byte = _quantize_pairs(even, odd, global_scale)
        value_even = _e2m1_value(code_even) * block_scale[:, None]
        value_odd = _e2m1_value(code_odd) * block_scale[:, None]
        r_even, r_odd, r_byte = code_even, code_odd, scale_byte  # (placeholders without a residual)
        if HAS_RESIDUAL:
            keep = (tl.load(rac_mask_ptr + blocks % blocks_per_row, mask=in_range, other=0) != 0)[:, None]
            res_even = tl.where(keep, even - _mul_rn(value_even, global_scale, GPU), 0.0)  # x - DQ(x_q)
            res_odd = tl.where(keep, odd - _mul_rn(value_odd, global_scale, GPU), 0.0)
            r_even, r_odd, r_scale, r_byte = _quantize_pairs(res_even, res_odd, global_scale)
            value_even += _e2m1_value(r_even) * r_scale[:, None]                         # exact in fp32
            value_odd += _e2m1_value(r_odd) * r_scale[:, None]
        return code_even, code_odd, scale_byte, r_even, r_odd, r_byte, value_even, value_odd

    @triton.jit
    def _store_codes(data_ptr, scale_ptr, blocks, in_range, code_even, code_odd, scale_byte):
        pairs = tl.arange(0, 8)
        tl.store(data_ptr + blocks[:, None] * 8 + pairs[None, :], (code_even | (code_odd << 4)).to(tl.uint8),
                 mask=in_range[:, None])
        tl.store(scale_ptr + blocks, scale_byte.to(tl.uint8), mask=in_range)

    @triton.jit
    def _quantize_activation_kernel(
        # pointers: input (elements, and its pair view), selection, scales, outputs
        x_ptr, x_words_ptr, rac_mask_ptr, partial_amax_ptr, global_scale_ptr,
        data_ptr, block_scale_ptr, res_data_ptr, res_block_scale_ptr, operand_ptr,
        # sizes (plane_size: elements in one operand plane, M * K / 2)
        numel, n_blocks, blocks_per_row, n_partials, plane_size,
        # meta-parameters
        AMAX_HERE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, WRITE_CODES: tl.constexpr,
        WRITE_OPERAND: tl.constexpr, BLOCKS: tl.constexpr, CHUNK: tl.constexpr, PARTIALS: tl.constexpr,
        GPU: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        _after_previous_kernel(PDL, EARLY)
        pid = tl.program_id(0)
        if AMAX_HERE:  # a small input: every program reduces all of it (L2-resident) itself
            global_scale = _scale_from_amax(_abs_max(x_ptr, 0, numel, CHUNK))
        else:          # the maxima of _partial_amax_kernel's slices
            idx = tl.arange(0, PARTIALS)
            partial = tl.load(partial_amax_ptr + idx, mask=idx < n_partials, other=0.0)
            global_scale = _scale_from_amax(tl.max(partial, axis=0))
        tl.store(global_scale_ptr, global_scale, mask=pid == 0)
        blocks = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        in_range = blocks < n_blocks
        code_even, code_odd, scale_byte, r_even, r_odd, r_byte, value_even, value_odd = _quantize_blocks(
            x_words_ptr, rac_mask_ptr, blocks, in_range, blocks_per_row, global_scale, HAS_RESIDUAL, X_BF16,
            GPU)
        if WRITE_CODES:
            _store_codes(data_ptr, block_scale_ptr, blocks, in_range, code_even, code_odd, scale_byte)
            if HAS_RESIDUAL:
                _store_codes(res_data_ptr, res_block_scale_ptr, blocks, in_range, r_even, r_odd, r_byte)
        if WRITE_OPERAND:  # fp16 planes, 16 contiguous bytes per block in each
            offs = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]
            tl.store(operand_ptr + offs, (value_even * _SHIFT).to(tl.float16), mask=in_range[:, None])
            tl.store(operand_ptr + plane_size + offs, (value_odd * _SHIFT).to(tl.float16),
                     mask=in_range[:, None])

    @triton.jit
    def _partial_amax_kernel(x_ptr, partial_ptr, numel, SLICE: tl.constexpr, CHUNK: tl.constexpr,
                             PDL: tl.constexpr, EARLY: tl.constexpr):
        """One max |x| per program over a slice (no atomics, nothing to zero first)."""
        _after_previous_kernel(PDL, EARLY)
        start = tl.program_id(0).to(tl.int64) * SLICE
        amax = _abs_max(x_ptr, start, tl.minimum(start + SLICE, numel), CHUNK)
        tl.store(partial_ptr + tl.program_id(0), amax)


_CAPABILITIES = {}  # device index -> compute capability, asked once (the launch paths ask every call)


def _cuda_index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


def _capability(device):
    index = _cuda_index(device)
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


def _pdl(device):
    """Launch the quantizer and GEMM kernels with programmatic dependent launch? Yes on sm_90+ GPUs: a
    kernel's programs can then be set up while the kernel ahead of it finishes (the README has the gain)."""
    return not _INTERPRET and device.type == "cuda" and _capability(device) >= (9, 0)


def _launch_options(device, early=None):
    """A kernel's PDL flags and launch option; early (kernels that can trigger): may the next kernel launch
    as soon as this one has started? Early launch pays before a kernel of many waves of programs (the
    quantizer after the partial max, the experts' GEMM after their quantizer); before a dense GEMM of
    about one wave of programs it cost more than it saved on the H200 (q_proj, M = 256: 23.0 -> 29.9 us;
    M = 16: 10.6 -> 11.9)."""
    pdl = _pdl(device)
    options = dict(PDL=pdl, launch_pdl=pdl)
    if early is not None:
        options["EARLY"] = pdl and early
    return options


def _require_triton():
    if triton is None:
        raise RuntimeError("the Triton kernels need the `triton` package; use the *_reference twins instead")


def _as_int16(y):
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y


def _check_out_dtype(out_dtype):
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16/float16/float32, got {out_dtype}")


def _empty_planes(rows, half_k, device):
    """An fp16 operand buffer (2, rows, K/2), the planes a multiple of 64 elements apart (16-byte aligned)."""
    plane = triton.cdiv(rows * half_k, 64) * 64
    return (torch.empty((2, plane), dtype=torch.float16, device=device)[:, :rows * half_k]
            .view(2, rows, half_k))


class Activation(NamedTuple):
    """An activation quantized for the W4A4 GEMMs (the fields a path does not need are None)."""
    x_q: NVFP4Tensor | None       # codes and block scales of x, with the global scale
    residual: NVFP4Tensor | None  # RAC residual codes (zero blocks where not compensated), same global scale
    operand: torch.Tensor | None  # (2, M, K/2) fp16 planes of (DQ(x_q) + DQ(residual)) / global_scale * 2^-6
    global_scale: torch.Tensor    # () fp32


_AMAX_CHUNK = AMAX_IN_LAUNCH  # elements per load in the amax loops: small inputs in one load
_AMAX_SLICES = 256       # at most this many partial maxima: every quantizer program reads all of them


def _partial_chunk(numel):
    """Elements per load of the partial-max launch. A program's loads over its slice wait one for another
    (plain loads are not pipelined), so inputs that would take more than two chunks a slice take chunks 4x
    wider: on the H200 the quantizer of 4096 x 4096 takes 47 instead of 57 us; decode-sized inputs are faster
    with the narrow chunk."""
    return _AMAX_CHUNK * (4 if numel > 2 * _AMAX_SLICES * _AMAX_CHUNK else 1)


def _partial_amax(x):
    """max |x| over each of at most _AMAX_SLICES slices of the flattened x, one launch -> (slices,) fp32."""
    chunk = _partial_chunk(x.numel())
    slice_ = chunk * triton.cdiv(triton.cdiv(x.numel(), chunk), _AMAX_SLICES)
    partials = torch.empty(triton.cdiv(x.numel(), slice_), dtype=torch.float32, device=x.device)
    _partial_amax_kernel[(partials.numel(),)](x, partials, x.numel(), SLICE=slice_, CHUNK=chunk,
                                              **_launch_options(x.device, early=True))
    return partials


def quantize_activation_triton(x, rac_mask=None, codes=False, operand=True, early_launch=False):
    """The quantizer: x (M, K) -> Activation with the fp16 operand (operand=True) and/or the NVFP4
    codes of x and of its RAC residual (codes=True). Dynamic global scale amax(|x|) / 2688: reduced
    inside the launch for inputs up to AMAX_IN_LAUNCH, by one partial-max launch before it otherwise.
    early_launch: the next kernel (the experts' GEMM) may launch while this one runs (sm_90+), if the
    launch has at most EARLY_LAUNCH_PROGRAMS programs (more, 768 at batch 256, measured slower)."""
    _require_triton()
    _check_matrix(x, "quantize_activation_triton")
    _check_rac_mask(rac_mask, x)
    x = contiguous_pairs(x)
    M, K = x.shape
    n_blocks, device = M * K // BLOCK_SIZE, x.device
    dummy = torch.empty(1, dtype=torch.uint8, device=device)
    data = block_scale = res_data = res_block_scale = out_operand = None
    if codes:
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=device)
        block_scale = torch.empty((M, K // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=device)
        if rac_mask is not None:
            res_data, res_block_scale = torch.empty_like(data), torch.empty_like(block_scale)
    if operand:
        out_operand = _empty_planes(M, K // 2, device)
    global_scale = torch.empty((), dtype=torch.float32, device=device)
    amax_here = x.numel() <= AMAX_IN_LAUNCH
    partials = dummy if amax_here else _partial_amax(x)

    def ptr(t, view=None):
        return dummy if t is None else (t.view(view) if view is not None else t)

    blocks = 32 if n_blocks <= 16384 else 128  # small inputs: more programs, shorter chains
    programs = triton.cdiv(n_blocks, blocks)
    _quantize_activation_kernel[(programs,)](
        x, pair_view(x), ptr(rac_mask, torch.uint8), partials, global_scale,
        ptr(data), ptr(block_scale, torch.uint8), ptr(res_data), ptr(res_block_scale, torch.uint8),
        ptr(out_operand),
        x.numel(), n_blocks, K // BLOCK_SIZE, partials.numel() if not amax_here else 0,
        out_operand.stride(0) if operand else 0,
        AMAX_HERE=amax_here, HAS_RESIDUAL=rac_mask is not None, X_BF16=x.dtype == torch.bfloat16,
        WRITE_CODES=codes, WRITE_OPERAND=operand, BLOCKS=blocks, CHUNK=_AMAX_CHUNK, GPU=not _INTERPRET,
        PARTIALS=triton.next_power_of_2(partials.numel()),
        **_launch_options(device, early=early_launch and programs <= EARLY_LAUNCH_PROGRAMS))
    x_q = NVFP4Tensor(data, block_scale, global_scale) if codes else None
    residual = (NVFP4Tensor(res_data, res_block_scale, global_scale) if codes and rac_mask is not None
                else None)
    return Activation(x_q, residual, out_operand, global_scale)


# Packed E2M1 codes -> fp16 x 2^-6 (even and odd nibbles), 4 bytes an invocation: shared by the Triton and
# the Gluon kernels (_e2m1_pairs_to_fp16 says how it works).
_E2M1_PAIRS_PTX = None if triton is None else tl.constexpr("""
{
.reg .b32 lo, hi, t;
.reg .b16 l0, l1, h0, h1;
and.b32 t, $4, 0x08080808;
shl.b32 t, t, 4;
and.b32 lo, $4, 0x07070707;
shl.b32 lo, lo, 2;
or.b32 lo, lo, t;
shr.b32 hi, $4, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, $4, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}
""")


# ======================================================================== Triton: the dense GEMM
if triton is not None:
    # ------------------------------------------------------------------ GEMM building blocks
    @triton.jit
    def _e4m3_to_fp16(byte, GPU: tl.constexpr):
        """E4M3 bytes (uint8) -> fp16, exact. The GPU decodes 0x7F as NaN; the interpreter as 480."""
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        if not GPU:
            value = tl.where((byte & 0x7F) == 0x7F, float("nan"), value).to(tl.float16)
        return value

    @triton.jit
    def _e2m1_pairs_to_fp16(packed, GPU: tl.constexpr):
        """Packed bytes -> (even, odd) fp16 tensors of the same shape: the low and the high nibble's
        E2M1 value times 2^-6, via the code's E4M3 byte ((c & 7) << 2 | (c & 8) << 4). On the GPU the
        bit arithmetic runs on 32-bit words (4 codes per instruction) and cvt.rn.f16x2.e4m3x2 converts
        two bytes per instruction; elementwise, so however Triton groups 4 bytes the result is the same."""
        if GPU:
            even, odd = tl.inline_asm_elementwise(
                asm=_E2M1_PAIRS_PTX,
                constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=True,
                pack=4)
        else:
            even = (((packed & 7) << 2) | ((packed & 8) << 4)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
            odd = (((packed >> 2) & 0x1C) | (packed & 0x80)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return even, odd

    @triton.jit
    def _weight_tile(data_ptr, scale_ptr, rows, row_mask, k0, K, stride_data, stride_scale,
                     ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GPU: tl.constexpr,
                     CHUNK: tl.constexpr = 0, stride_chunk=0, stride_scale_chunk=0):
        """Columns k0..k0+BLOCK_K of NVFP4 rows as (ROWS, BLOCK_K/2) fp16 even and odd tiles holding
        value * block_scale * 2^-6 exactly, for the tensor cores: each row's BLOCK_K/2 bytes load as one
        run (16-byte loads). CHUNK: the rows are in ExpertWeights' layout of CHUNK-element chunks (a step
        within one chunk). _weight_bytes loads, _decoded_tile decodes; the GEMV calls them itself, for
        blocked tiles."""
        packed, scale_byte = _weight_bytes(data_ptr, scale_ptr, rows, row_mask, k0, K, stride_data,
                                           stride_scale, ROWS, BLOCK_K, EVEN_K, False, CHUNK, stride_chunk,
                                           stride_scale_chunk)
        return _decoded_tile(packed, scale_byte, ROWS, BLOCK_K, False, GPU)

    @triton.jit
    def _weight_bytes(data_ptr, scale_ptr, rows, row_mask, k0, K, stride_data, stride_scale,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCKED: tl.constexpr = False, CHUNK: tl.constexpr = 0, stride_chunk=0,
                      stride_scale_chunk=0):
        """_weight_tile's codes and E4M3 scale bytes, as loaded."""
        tl.static_assert(not (BLOCKED and CHUNK), "ExpertWeights' layout: flat tiles only")
        GB: tl.constexpr = BLOCK_K // 16
        blocks = k0 // 16 + tl.arange(0, GB)                                            # (GB,)
        if BLOCKED:
            byte_cols = (blocks[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :]       # (1, GB, 8)
            data_ptrs = data_ptr + rows[:, None, None] * stride_data + byte_cols
            data_mask = row_mask[:, None, None] & (byte_cols < K // 2)
        else:
            byte_cols = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]                   # (1, BLOCK_K/2)
            if CHUNK:  # ExpertWeights' layout: stride_data / _scale step a row block; the step in one chunk
                block, row = rows // EXPERT_ROWS, rows % EXPERT_ROWS
                chunk, within = k0 // CHUNK, k0 % CHUNK  # within: a multiple of BLOCK_K (wide loads)
                step = tl.multiple_of(chunk * stride_chunk + within // 2, BLOCK_K // 2)
                data_ptrs = (data_ptr + (block * stride_data + row * (CHUNK // 2))[:, None]
                             + (step + tl.arange(0, BLOCK_K // 2))[None, :])
            else:
                data_ptrs = data_ptr + rows[:, None] * stride_data + byte_cols
            data_mask = row_mask[:, None] & (byte_cols < K // 2)
        if CHUNK:
            step = tl.multiple_of(chunk * stride_scale_chunk + within // 16, GB)
            scale_ptrs = (scale_ptr + (block * stride_scale + row * (CHUNK // 16))[:, None]
                          + (step + tl.arange(0, GB))[None, :])
        else:
            scale_ptrs = scale_ptr + rows[:, None] * stride_scale + blocks[None, :]
        if EVEN_K:  # masks constant along K: wide loads
            packed = tl.load(data_ptrs, mask=data_mask if not BLOCKED else row_mask[:, None, None], other=0)
            scale_byte = tl.load(scale_ptrs, mask=row_mask[:, None], other=0)           # (ROWS, GB)
        else:
            packed = tl.load(data_ptrs, mask=data_mask, other=0)
            scale_byte = tl.load(scale_ptrs, mask=row_mask[:, None] & (blocks < K // 16)[None, :], other=0)
        return packed, scale_byte

    @triton.jit
    def _decoded_tile(packed, scale_byte, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKED: tl.constexpr,
                      GPU: tl.constexpr):
        """_weight_bytes' codes and scale bytes -> _weight_tile's even and odd fp16 tiles."""
        GB: tl.constexpr = BLOCK_K // 16
        block_scale = _e4m3_to_fp16(scale_byte, GPU)[:, :, None]                        # (ROWS, GB, 1)
        even, odd = _e2m1_pairs_to_fp16(packed, GPU)
        if BLOCKED:
            even, odd = even * block_scale, odd * block_scale                           # exact in fp16
        else:
            even = tl.reshape(tl.reshape(even, (ROWS, GB, 8)) * block_scale, (ROWS, BLOCK_K // 2))
            odd = tl.reshape(tl.reshape(odd, (ROWS, GB, 8)) * block_scale, (ROWS, BLOCK_K // 2))
        return even, odd

    @triton.jit
    def _operand_tile(x_ptr, rows, row_mask, k0, K, stride_row, plane_size, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCKED: tl.constexpr = False):
        """Columns k0..k0+BLOCK_K of fp16 operand planes (2, rows, K/2) as (rows, BLOCK_K/2) even and odd
        tiles, or (rows, BLOCK_K/16, 8) ones (BLOCKED)."""
        if BLOCKED:
            cols = (k0 // 2 + tl.arange(0, BLOCK_K // 16)[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :]
            ptrs = x_ptr + rows[:, None, None].to(tl.int64) * stride_row + cols
            mask = row_mask[:, None, None] & (cols < K // 2)
        else:
            cols = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
            ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_row + cols
            mask = row_mask[:, None] & (cols < K // 2)
        return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + plane_size, mask=mask, other=0.0)

    @triton.jit
    def _mainloop(x_ptr, row0, M, stride_x, x_plane, w_ptr, w_scale_ptr, cols, col_mask, stride_w, stride_ws,
                  w_plane, K, k_begin, k_end, W_FP16: tl.constexpr, GPU: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, x_rows,
                  X_FIRST: tl.constexpr, CHUNK: tl.constexpr = 0, stride_wc=0, stride_sc=0):
        """acc (BLOCK_N, BLOCK_M) = W[cols] @ X[x_rows].T over columns k_begin..k_end, in fp32, without the
        global scales and 2^12. X: fp16 operand planes; W: NVFP4 codes, or fp16 operand planes (W_FP16).
        X_FIRST: X is the MMA's left operand (M side) and the weight its right one, whose staged codes
        Triton decodes straight into mma.sync's operand registers; fewer instructions per weight element
        than the weight on the left, whose wgmma register layout makes Triton read the codes two bytes at
        a time (seen in the SASS). CHUNK: W in ExpertWeights' layout (_weight_tile)."""
        row_mask = (row0 + tl.arange(0, BLOCK_M)) < M
        if X_FIRST:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if W_FP16:
                w_even, w_odd = _operand_tile(w_ptr, cols, col_mask, k0, K, stride_w, w_plane, BLOCK_K,
                                              EVEN_K)
            else:
                w_even, w_odd = _weight_tile(w_ptr, w_scale_ptr, cols, col_mask, k0, K, stride_w, stride_ws,
                                             BLOCK_N, BLOCK_K, EVEN_K, GPU, CHUNK, stride_wc, stride_sc)
            x_even, x_odd = _operand_tile(x_ptr, x_rows, row_mask, k0, K, stride_x, x_plane, BLOCK_K, EVEN_K)
            if X_FIRST:
                acc = tl.dot(x_even, tl.trans(w_even), acc)
                acc = tl.dot(x_odd, tl.trans(w_odd), acc)
            else:
                acc = tl.dot(w_even, tl.trans(x_even), acc)
                acc = tl.dot(w_odd, tl.trans(x_odd), acc)
        if X_FIRST:
            acc = tl.trans(acc)                                                          # (BLOCK_N, BLOCK_M)
        return acc

    @triton.jit
    def _store_at(y_ptr, offs, mask, value, OUT_BF16: tl.constexpr):
        """Store fp32 values at element offsets of y. BF16 rounds to nearest-even by integer arithmetic
        through an int16 view of y (the interpreter's own cast truncates)."""
        if OUT_BF16:
            tl.store(y_ptr + offs, _to_bf16_bits(value).to(tl.int16), mask=mask)
        else:
            tl.store(y_ptr + offs, value.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_tile(y_ptr, rows, row_mask, cols, col_mask, stride_y, value, OUT_BF16: tl.constexpr):
        """Store a (cols, rows) tile of fp32 values into y (M, N)."""
        offs = rows[None, :].to(tl.int64) * stride_y + cols[:, None]
        _store_at(y_ptr, offs, row_mask[None, :] & col_mask[:, None], value, OUT_BF16)

    @triton.jit
    def _split_columns(cols, M, N, N1, N2):
        """Up to three weights stacked along N, split at columns N1 and N2 (N1 = N2 = N: one weight).
        Their outputs lie one after another in y, each (M, its N) row-major. -> per column (cols,): which
        weight (its global scale's index), y's offset of its row 0, and the row stride."""
        which = (cols >= N1).to(tl.int32) + (cols >= N2).to(tl.int32)
        start = tl.where(which == 0, 0, tl.where(which == 1, N1, N2)).to(tl.int64)
        end = tl.where(which == 0, N1, tl.where(which == 1, N2, N)).to(tl.int64)
        return which, M * start + cols - start, end - start

    @triton.jit
    def _store_split(y_ptr, rows, row_mask, col_base, col_stride, col_mask, value, OUT_BF16: tl.constexpr):
        """Store a (cols, rows) tile at _split_columns' offsets."""
        offs = rows[None, :].to(tl.int64) * col_stride[:, None] + col_base[:, None]
        _store_at(y_ptr, offs, row_mask[None, :] & col_mask[:, None], value, OUT_BF16)

    @triton.jit
    def _weight_operand_kernel(data_ptr, scale_ptr, out_ptr, N, K, stride_data, stride_scale, plane_size,
                               GPU: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """Prefill: NVFP4 (N, K) -> fp16 planes (2, N, K/2), once per call. Twin: weight_operand_reference."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        k0 = tl.program_id(1) * BLOCK_K
        row_mask = rows < N
        even, odd = _weight_tile(data_ptr, scale_ptr, rows, row_mask, k0, K, stride_data, stride_scale,
                                 ROWS, BLOCK_K, False, GPU)
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs = rows[:, None].to(tl.int64) * (K // 2) + cols[None, :]
        mask = row_mask[:, None] & (cols < K // 2)[None, :]
        tl.store(out_ptr + offs, even, mask=mask)
        tl.store(out_ptr + plane_size + offs, odd, mask=mask)

    # ------------------------------------------------------------------ autotuning
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K[, X_FIRST[, maxnreg]]) per M bucket (M = 1 takes
    # the GEMV). maxnreg caps the registers a thread (more programs an SM, at the price of spills).
    # Decode buckets stream the weight: small BLOCK_M, wide BLOCK_K (long contiguous byte runs per row),
    # and enough (N tile, K split) programs to keep every SM's loads in flight. Under the interpreter one
    # small configuration per bucket, splitting K in the decode buckets so tests run the split epilogue,
    # and X_FIRST in two buckets so tests run both operand orders.
    DENSE_CONFIGS = {
        16: [(16, 64, 256, 4, 3, 4), (16, 32, 256, 4, 3, 8), (16, 64, 256, 4, 3, 2), (16, 128, 256, 8, 3, 2)],
        64: [(32, 64, 256, 4, 3, 2), (64, 64, 256, 8, 3, 4), (32, 64, 256, 4, 3, 4), (32, 32, 256, 4, 3, 4)],
        256: [(64, 128, 128, 4, 3, 2, True), (64, 64, 256, 4, 3, 1, True), (128, 64, 128, 4, 3, 1, True),
              (128, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 2), (64, 64, 128, 4, 3, 1)],
        4096: [(128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1)],
    }
    # Not (128, 128, 64, 8 warps, 3 stages): under Triton 3.6 on the H200 the grouped kernel compiled
    # with it gave non-deterministic results with NaN rows; tests/test_rac.py runs every configuration
    # of both kernels repeatedly on the GPU. (On sm_89 / sm_90 the experts take the Gluon kernel; this
    # table serves the shapes it does not take and other GPUs.)
    GROUPED_CONFIGS = {
        16: [(16, 64, 256, 4, 3, 1, True), (16, 128, 128, 4, 3, 1, True), (16, 32, 256, 4, 3, 1, True),
             (16, 64, 128, 4, 4, 1, True), (16, 128, 256, 4, 3, 1, True), (16, 32, 256, 4, 3, 1),
             (16, 64, 256, 4, 2, 1, True, 128)],
        64: [(32, 64, 128, 4, 3, 1), (64, 64, 128, 4, 3, 1), (32, 64, 128, 4, 3, 1, True),
             (32, 128, 128, 4, 3, 1, True)],
        256: [(64, 128, 64, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
        4096: [(64, 128, 64, 4, 3, 1), (64, 64, 128, 4, 3, 1)],
    }
    _INTERPRETER_CONFIGS = {bucket: [(16, 32, 64, 4, 1, 2 if bucket <= 64 else 1, bucket in (16, 256))]
                            for bucket in DENSE_CONFIGS}

    def _m_bucket(m, table):
        return next(b for b in table if m <= b or b == 4096)

    def _configs(table):
        configs = []
        for bucket, entries in (_INTERPRETER_CONFIGS if _INTERPRET else table).items():
            if bucket not in table:
                continue
            for bm, bn, bk, warps, stages, split_k, *rest in entries:  # rest: X_FIRST, maxnreg
                configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k,
                                              "BUCKET": bucket, "X_FIRST": bool(rest and rest[0])},
                                             num_warps=warps, num_stages=stages,
                                             maxnreg=rest[1] if len(rest) > 1 else None))
        return configs

    def _prune(configs, named_args, **kwargs):
        """Keep the configs of the call's M bucket: autotuning times 2-4 candidates, not all of them."""
        return [c for c in configs if c.kwargs["BUCKET"] == named_args["M_BUCKET"]]

    _HEURISTICS = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0}

    def _bench_in_graph(kernel_call, quantiles):
        """Autotuning times candidates as CUDA-graph replays: decode kernels run for a few microseconds,
        where eager timing is mostly launch overhead and picked poor configurations (seen on the H200)."""
        return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)

    # ------------------------------------------------------------------ dense GEMM (Hopper)
    # Twin: matmul_reference on the quantizer's operand.
    @triton.autotune(configs=_configs(DENSE_CONFIGS), key=["M_BUCKET", "N", "K", "W_FP16"],
                     prune_configs_by={"early_config_prune": _prune}, do_bench=_bench_in_graph)
    @triton.heuristics(_HEURISTICS)
    @triton.jit(do_not_specialize=["M"])
    def _dense_kernel(
        # pointers: the operand planes and their global scale; split-K: partial tiles and per-tile arrival
        # counters
        x_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr, workspace_ptr, counter_ptr,
        # sizes (M_BUCKET: the autotuning key; *_plane: elements in one operand plane; the columns from N1
        # on take the second weight global scale, from N2 on the third: stacked q/k/v weights)
        M, N, K, M_BUCKET, x_plane, w_plane, N1, N2,
        # strides (operand planes and y in elements, w in bytes, scales in blocks)
        stride_x, stride_w, stride_ws,
        # meta-parameters
        W_FP16: tl.constexpr, OUT_BF16: tl.constexpr, GPU: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BUCKET: tl.constexpr,
        EVEN_K: tl.constexpr, X_FIRST: tl.constexpr, PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        # N tiles vary fastest: programs running together share the activation rows and stream
        # disjoint weight rows, which is what a weight-bound decode wants.
        pid, pid_k = tl.program_id(0), tl.program_id(1)
        n_tiles = tl.cdiv(N, BLOCK_N)
        row0 = (pid // n_tiles) * BLOCK_M
        cols = ((pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_mask = cols < N
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_begin = pid_k * k_per_split
        k_end = tl.minimum(K, k_begin + k_per_split)
        rows = row0 + tl.arange(0, BLOCK_M)
        acc = _mainloop(x_ptr, row0, M, stride_x, x_plane, w_ptr, w_scale_ptr, cols, col_mask, stride_w,
                        stride_ws, w_plane, K, k_begin, k_end, W_FP16, GPU, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                        rows, X_FIRST)
        which, col_base, col_stride = _split_columns(cols, M, N, N1, N2)
        w_global = tl.load(w_global_ptr + which, mask=col_mask, other=0.0)[:, None]
        scale = _EPILOGUE * tl.load(x_global_ptr) * w_global
        if SPLIT_K == 1:
            _store_split(y_ptr, rows, rows < M, col_base, col_stride, col_mask, acc * scale, OUT_BF16)
        else:
            # each split stores its partial tile; the last to arrive (an acq_rel counter per tile) adds
            # the SPLIT_K partials in a fixed order (deterministic), resets the counter and stores y
            tile: tl.constexpr = BLOCK_N * BLOCK_M
            offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            part_ptr = workspace_ptr + pid.to(tl.int64) * (SPLIT_K * tile) + offs
            tl.store(part_ptr + pid_k * tile, acc)
            tl.debug_barrier()                                                           # all partials issued
            arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
            tl.debug_barrier()
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for split in range(SPLIT_K):
                    total += tl.load(part_ptr + split * tile, cache_modifier=".cg")
                # ready for the next call
                tl.atomic_xchg(counter_ptr + pid, 0)
                _store_split(y_ptr, rows, rows < M, col_base, col_stride, col_mask, total * scale, OUT_BF16)

    # ------------------------------------------------------------------ one-token GEMV (Hopper)
    # Twin: matmul_reference on the quantizer's operand.
    @triton.jit
    def _gemv_kernel(x_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr, N, K, x_plane, N1, N2,
                     stride_w, stride_ws, OUT_BF16: tl.constexpr, GPU: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
        """M = 1: y = W @ x on fp32 FMAs. A program takes BLOCK_N weight rows over all of K, so there is no
        split-K handoff; many small programs keep the weight bytes in flight. Tiles are blocked, (rows,
        BLOCK_K/16, 8), and x is loaded once per weight row (from L1) in the same shape: both get one
        layout, with no shuffle through shared memory.
        The first K step's weight tile is loaded before the PDL wait, while the quantizer ahead of this
        kernel still runs (it lets this one launch early). Safe because that kernel never writes weights
        and itself waits for every kernel before it before it lets this one start, so weights written by
        an earlier kernel (a sync) are complete. x, its scale and y wait."""
        cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_mask = cols < N
        packed, scale_byte = _weight_bytes(w_ptr, w_scale_ptr, cols, col_mask, 0, K, stride_w, stride_ws,
                                           BLOCK_N, BLOCK_K, EVEN_K, True)
        _after_previous_kernel(PDL)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for step in tl.static_range(STEPS):  # unrolled: the next step's bytes load during this one's FMAs
            w_even, w_odd = _decoded_tile(packed, scale_byte, BLOCK_N, BLOCK_K, True, GPU)
            if step + 1 < STEPS:
                packed, scale_byte = _weight_bytes(w_ptr, w_scale_ptr, cols, col_mask, (step + 1) * BLOCK_K,
                                                   K, stride_w, stride_ws, BLOCK_N, BLOCK_K, EVEN_K, True)
            x_even, x_odd = _operand_tile(x_ptr, 0 * cols, col_mask, step * BLOCK_K, K, 0, x_plane, BLOCK_K,
                                          EVEN_K, True)
            products = (w_even.to(tl.float32) * x_even.to(tl.float32)   # products of fp16 values: exact
                        + w_odd.to(tl.float32) * x_odd.to(tl.float32))
            acc += tl.sum(tl.sum(products, axis=2), axis=1)
        which, col_base, col_stride = _split_columns(cols, 1, N, N1, N2)
        scale = _EPILOGUE * tl.load(x_global_ptr) * tl.load(w_global_ptr + which, mask=col_mask, other=0.0)
        rows = tl.arange(0, 1)
        _store_split(y_ptr, rows, rows < 1, col_base, col_stride, col_mask, (acc * scale)[:, None], OUT_BF16)


_SPLIT_COUNTERS = {}


def _split_k_buffers(M, N, bucket, device):
    """Scratch for split-K partial tiles (written before read: no init) and the per-tile arrival
    counters (zero, reset to zero by the kernel itself: kept per device). Counters are shared by all
    calls, so split-K launches must not run concurrently on two streams."""
    configs = (_INTERPRETER_CONFIGS if _INTERPRET else DENSE_CONFIGS)[bucket]
    splits = [(bm, bn, split) for bm, bn, _, _, _, split, *_ in configs if split > 1]
    if not splits:
        return (torch.empty(1, dtype=torch.float32, device=device),
                torch.empty(1, dtype=torch.int32, device=device))
    size = max(split * triton.cdiv(M, bm) * bm * triton.cdiv(N, bn) * bn for bm, bn, split in splits)
    tiles = max(triton.cdiv(M, bm) * triton.cdiv(N, bn) for bm, bn, _ in splits)
    counters = _SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _SPLIT_COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return torch.empty(size, dtype=torch.float32, device=device), counters


def _split_output(y, M, N, splits):
    """The dense kernels' flat output -> (M, N), or one contiguous (M, n) tensor per stacked weight."""
    if splits is None:
        return y.view(M, N)
    return tuple(part.view(M, n) for part, n in zip(y.split([M * n for n in splits]), splits))


def _column_splits(w_q, splits):
    """(N1, N2) for the kernels' per-column weight global scale: w_q stacks len(splits) weights along N."""
    N = w_q.shape[0]
    ends = list(itertools.accumulate(splits or ()))[:-1] + [N, N]  # where weights 2 and 3 begin, else N
    return ends[0], ends[1]


def _dense_portable(w_q, out_dtype, act, splits=None):
    """The Hopper dense kernels on a quantized `act`: the GEMV at one row, else the tiled GEMM."""
    M = act.operand.shape[1]
    N, K = w_q.shape
    device = w_q.device
    y = torch.empty(M * N, dtype=out_dtype, device=device)  # splits: each weight's (M, n) after another
    w_data, w_scale = w_q.data.contiguous(), w_q.block_scale.contiguous().view(torch.uint8)
    out_bf16, gpu = out_dtype == torch.bfloat16, not _INTERPRET
    if M == 1:
        block_k = min(triton.next_power_of_2(K), GEMV_BLOCK_K)
        _gemv_kernel[(triton.cdiv(N, GEMV_ROWS),)](
            act.operand, act.global_scale, w_data, w_scale, w_q.global_scale.contiguous(), _as_int16(y), N, K,
            act.operand.stride(0), *_column_splits(w_q, splits), w_data.stride(0), w_scale.stride(0),
            OUT_BF16=out_bf16, GPU=gpu, BLOCK_N=GEMV_ROWS, BLOCK_K=block_k, STEPS=triton.cdiv(K, block_k),
            EVEN_K=K % block_k == 0, num_warps=GEMV_WARPS, **_launch_options(device))
        return _split_output(y, M, N, splits)
    w_fp16 = M >= PREFILL_ROWS
    w_ptr, stride_w, w_plane = w_data, w_data.stride(0), 0
    if w_fp16:
        w_operand = _empty_planes(N, K // 2, device)
        rows, block_k = 64, 256
        _weight_operand_kernel[(triton.cdiv(N, rows), triton.cdiv(K, block_k))](
            w_data, w_scale, w_operand, N, K, w_data.stride(0), w_scale.stride(0), w_operand.stride(0),
            GPU=gpu, ROWS=rows, BLOCK_K=block_k)
        w_ptr, stride_w, w_plane = w_operand, K // 2, w_operand.stride(0)
    bucket = _m_bucket(M, DENSE_CONFIGS)
    workspace, counters = _split_k_buffers(M, N, bucket, device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    _dense_kernel[grid](act.operand, act.global_scale, w_ptr, w_scale, w_q.global_scale.contiguous(),
                        _as_int16(y), workspace, counters, M, N, K, bucket, act.operand.stride(0), w_plane,
                        *_column_splits(w_q, splits), act.operand.stride(1), stride_w, w_scale.stride(0),
                        W_FP16=w_fp16, OUT_BF16=out_bf16, GPU=gpu, **_launch_options(device))
    return _split_output(y, M, N, splits)


def layer_input(x, rac_mask):
    """What the Triton GEMM takes of x (M, K): on Blackwell the codes, else the fp16 operand. One row:
    the quantizer lets the GEMV launch early, which then loads its first weight tile meanwhile."""
    if gemm_backend(x.device) == "native":
        return quantize_activation_triton(x, rac_mask, codes=True, operand=False)
    return quantize_activation_triton(x, rac_mask, early_launch=x.shape[0] == 1)


def layer_matmul(act, w_q, out_dtype, splits=None):
    """The layer's GEMM on layer_input's `act` (Triton, CUDA). At one row the GEMV reads its weight before it
    waits for the kernel ahead of it (_gemv_kernel says why that is safe): launch it right after layer_input
    or another layer_matmul, as the layers do, never right after a kernel that writes w_q."""
    if act.operand is None:
        return _dense_native(act.x_q, act.residual, w_q, out_dtype, splits)
    return _dense_portable(w_q, out_dtype, act, splits)


def nvfp4_linear_triton(x, w_q, rac_mask=None, out_dtype=torch.bfloat16, splits=None):
    """The NVFP4 layer's fast path, x (M, K) -> (M, N): one quantizer launch, then the GEMV (one row),
    the tiled GEMM, or on Blackwell the native kernel.
    splits: w_q stacks up to three weights along N (their row counts), global_scale one per weight:
    q/k/v_proj as one GEMM, equal to three (up to fp32 accumulation order)."""
    _require_triton()
    _check_matrix(x, "nvfp4_linear")
    _check_rac_mask(rac_mask, x)
    _check_out_dtype(out_dtype)
    if x.shape[1] != w_q.shape[1] or x.device != w_q.device:
        raise ValueError(f"nvfp4_linear: x {tuple(x.shape)} on {x.device} does not match the weight "
                         f"{tuple(w_q.shape)} on {w_q.device}")
    n_scales = 1 if splits is None else len(splits)
    if splits is not None and not (1 <= len(splits) <= 3 and sum(splits) == w_q.shape[0]):
        raise ValueError(f"nvfp4_linear: splits {tuple(splits)} must be 1 to 3 row counts adding up to the "
                         f"weight's N = {w_q.shape[0]}")
    if w_q.global_scale.numel() != n_scales:
        raise ValueError(f"nvfp4_linear: the weight has {w_q.global_scale.numel()} global scales; "
                         f"expected {n_scales} (one per stacked weight)")
    return layer_matmul(layer_input(x, rac_mask), w_q, out_dtype, splits)


# ======================================================================== Triton: the experts' grouped GEMM
if triton is not None:
    @triton.jit
    def _expert_tile(counts_ptr, E, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
        """Which (expert, row tile) is program pid_m's? Expert e owns cdiv(counts[e], BLOCK_M) tiles,
        laid end to end; a prefix sum over the E counts answers it on the device. -> (expert, first
        sorted row of the tile, end row of the expert); expert >= E: beyond the last tile, no work.
        Tiles and rows share one int64 prefix sum (tiles in the high 32 bits, rows below: no carry as
        long as there are fewer than 2^32 rows), so the program takes one cumulative sum and two
        reductions, each a round of barriers, where it took two and five."""
        experts = tl.arange(0, E_POW2)
        counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int64)    # (E_POW2,)
        packed = (((counts + BLOCK_M - 1) // BLOCK_M) << 32) + counts
        ends = tl.cumsum(packed, axis=0)                               # (tile end << 32) + row end
        expert = tl.sum(((ends >> 32) <= pid_m).to(tl.int32), axis=0)
        start = tl.sum(tl.where(experts == expert, ends - packed, 0), axis=0)
        first_tile = start >> 32
        first_row = (start - (first_tile << 32)).to(tl.int32)
        rows = tl.load(counts_ptr + expert, mask=expert < E, other=0).to(tl.int32)
        return expert, first_row + (pid_m - first_tile.to(tl.int32)) * BLOCK_M, first_row + rows

    @triton.jit
    def _tile_rows(row_ids_ptr, weight_ids_ptr, row0, end_row, GATHER: tl.constexpr, WEIGHT_IDS: tl.constexpr,
                   BLOCK_M: tl.constexpr):
        """A row tile -> (its sorted rows, their mask, the activation rows they read (GATHER: row_ids), where
        their router weights are (WEIGHT_IDS: weight_ids, routing.order))."""
        sorted_rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = sorted_rows < end_row
        x_rows = tl.load(row_ids_ptr + sorted_rows, mask=row_mask, other=0) if GATHER else sorted_rows
        weight_rows = (tl.load(weight_ids_ptr + sorted_rows, mask=row_mask, other=0) if WEIGHT_IDS
                       else sorted_rows)
        return sorted_rows, row_mask, x_rows, weight_rows

    @triton.jit
    def _expert_weight_rows(pid_n, n_out, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
        """The weight rows of N tile pid_n -> (rows, mask): BLOCK_N rows, or SWIGLU's stacked tile of
        2 BLOCK_N, the gate rows (of [0, I)) then the up rows I + the same, so that one product holds
        both halves of the SwiGLU."""
        W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
        stacked = tl.arange(0, W_ROWS)
        cols = pid_n * BLOCK_N + stacked % BLOCK_N
        return (cols + (stacked // BLOCK_N) * n_out).to(tl.int64), cols < n_out

    @triton.jit
    def _swiglu(acc, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WEIGHT_ROWS_FIRST: tl.constexpr):
        """silu(gate) * up of a stacked tile's product: (2 BLOCK_N, BLOCK_M) if WEIGHT_ROWS_FIRST (the
        Hopper kernel's) else (BLOCK_M, 2 BLOCK_N); the result keeps the order."""
        if WEIGHT_ROWS_FIRST:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        else:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _grouped_store(acc, scale, y_ptr, row_weights_ptr, weight_rows, sorted_rows, row_mask, tile, n_out,
                       stride_y, ROW_WEIGHTS: tl.constexpr, SWIGLU: tl.constexpr, OUT_BF16: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The epilogue of N tile `tile` on its (W_ROWS, BLOCK_M) product: scales, SwiGLU, router weights."""
        out = acc * scale                                                              # (W_ROWS, BLOCK_M)
        if SWIGLU:
            out = _swiglu(out, BLOCK_N, BLOCK_M, True)                                 # (BLOCK_N, BLOCK_M)
        if ROW_WEIGHTS:
            router_weight = tl.load(row_weights_ptr + weight_rows, mask=row_mask, other=0.0).to(tl.float32)
            out = out * router_weight[None, :]
        cols = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        _store_tile(y_ptr, sorted_rows, row_mask, cols, cols < n_out, stride_y, out, OUT_BF16)

    def _grouped_prune(configs, named_args, **kwargs):
        """_prune; and where K spans several chunks of ExpertWeights' layout, BLOCK_K at most one chunk (a
        power of two no larger than EXPERT_K_CHUNK divides it): a K step then lies in one chunk."""
        chunk, kept = kwargs["CHUNK"], _prune(configs, named_args)
        if chunk == named_args["K"]:
            return kept
        return [triton.Config({**c.kwargs, "BLOCK_K": min(c.kwargs["BLOCK_K"], chunk)}, num_warps=c.num_warps,
                              num_stages=c.num_stages, maxnreg=c.maxnreg) for c in kept]

    # Twin: grouped_matmul_reference.
    @triton.autotune(configs=_configs(GROUPED_CONFIGS), key=["M_BUCKET", "N", "K"],
                     prune_configs_by={"early_config_prune": _grouped_prune}, do_bench=_bench_in_graph)
    @triton.heuristics(_HEURISTICS)
    @triton.jit
    def _grouped_kernel(
        # pointers (weight_ids: where each sorted row's router weight is, routing.order)
        x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr, w_global_ptr,
        counts_ptr, y_ptr,
        # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
        N, K, E, M_BUCKET, x_plane,
        # strides: activation rows; weight (expert, row block, chunk) in bytes, scales in blocks; y rows
        stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc, stride_y,
        # meta-parameters (CHUNK: ExpertWeights' chunk)
        GATHER: tl.constexpr, ROW_WEIGHTS: tl.constexpr, WEIGHT_IDS: tl.constexpr, SWIGLU: tl.constexpr,
        OUT_BF16: tl.constexpr, GPU: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BUCKET: tl.constexpr, EVEN_K: tl.constexpr, X_FIRST: tl.constexpr, PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
        if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
            return
        sorted_rows, row_mask, x_rows, weight_rows = _tile_rows(row_ids_ptr, weight_ids_ptr, row0, end_row,
                                                                GATHER, WEIGHT_IDS, BLOCK_M)
        n_out = N // 2 if SWIGLU else N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_se
        scale = _EPILOGUE * tl.load(x_global_ptr) * tl.load(w_global_ptr + expert)
        W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
        w_rows, w_mask = _expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
        acc = _mainloop(x_ptr, row0, end_row, stride_x, x_plane, w_base, ws_base, w_rows, w_mask, stride_wb,
                        stride_sb, 0, K, 0, K, False, GPU, BLOCK_M, W_ROWS, BLOCK_K, EVEN_K, x_rows, X_FIRST,
                        CHUNK, stride_wc, stride_sc)
        _grouped_store(acc, scale, y_ptr, row_weights_ptr, weight_rows, sorted_rows, row_mask, pid_n,
                       n_out, stride_y, ROW_WEIGHTS, SWIGLU, OUT_BF16, BLOCK_M, BLOCK_N)


def grouped_matmul_triton(act, w, counts, row_ids=None, row_weights=None, swiglu=False,
                          out_dtype=torch.bfloat16, row_weight_ids=None):
    """The experts' GEMM (twin: grouped_matmul_reference) on a quantized Activation: rows
    (act's, or act's row_ids[r]) grouped by expert per counts (E,), w the ExpertWeights (E, N, K); output
    row r scaled by row_weights[r] or row_weights[row_weight_ids[r]]. No host sync. Runs the Gluon kernel
    on sm_89 / sm_90 (K a multiple of 64), tl.dot_scaled on sm_100+, else the Triton kernel."""
    _require_triton()
    _check_out_dtype(out_dtype)
    if not isinstance(w, ExpertWeights):
        raise ValueError(f"grouped_matmul_triton: w must be ExpertWeights (rac.chunk_experts of the stacked "
                         f"NVFP4Tensor), got {type(w).__name__}")
    E, N, K = w.shape
    act_rows = act.operand.shape[1] if act.operand is not None else act.x_q.shape[0]
    n_rows = row_ids.numel() if row_ids is not None else act_rows
    n_out = N // 2 if swiglu else N
    _check_row_weights(row_weights, row_weight_ids, n_rows, "grouped_matmul_triton")
    y = torch.empty((n_rows, n_out), dtype=out_dtype, device=w.device)
    if n_rows == 0:
        return y
    flags = dict(GATHER=row_ids is not None, ROW_WEIGHTS=row_weights is not None,
                 WEIGHT_IDS=row_weight_ids is not None, SWIGLU=swiglu,
                 OUT_BF16=out_dtype == torch.bfloat16, E_POW2=max(2, triton.next_power_of_2(E)))
    row_ids, row_weights, row_weight_ids = (t if t is not None else counts
                                            for t in (row_ids, row_weights, row_weight_ids))
    if act.operand is None:  # codes only: the native kernel
        return _grouped_native(act, w, counts, row_ids, row_weights, row_weight_ids, y, flags)
    if _gluon_experts(w.device) and K % 64 == 0:
        return _grouped_gluon(act, w, counts, row_ids, row_weights, row_weight_ids, y, flags)
    operand, w_scale = act.operand, w.block_scale.view(torch.uint8)

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_M): no host sync
        return triton.cdiv(n_rows, meta["BLOCK_M"]) + min(E, n_rows), triton.cdiv(n_out, meta["BLOCK_N"])

    _grouped_kernel[grid](operand, act.global_scale, row_ids, row_weights, row_weight_ids, w.data, w_scale,
                          w.global_scale, counts, _as_int16(y), N, K, E,
                          _m_bucket(triton.cdiv(n_rows, E), GROUPED_CONFIGS), operand.stride(0),
                          operand.stride(1), *w.data.stride()[:3], *w_scale.stride()[:3], y.stride(0),
                          GPU=not _INTERPRET, CHUNK=w.chunk, **_launch_options(w.device), **flags)
    return y


# ================================================================== Gluon: the experts' GEMM (sm_89, sm_90)
# Twin: grouped_matmul_reference; same numerics as _grouped_kernel (equal outputs on the H200). Gluon is
# Triton's layout-explicit dialect: here it lets the weight codes be loaded straight into the MMA's operand
# registers and decoded there, which Triton's own layout choice does not (it stages the codes in shared
# memory, and from 8-bit codes picks operand layouts that cost 140 register moves a K step). GPU only: Gluon
# does not run under the interpreter, so the CPU tests compile it for sm_90 and the GPU tests check it
# against the twin.
#   - mma.sync m16n8k16 with the weight rows on the left (M) and the tile's token rows on the right (N, in
#     steps of 8): at 4 rows an expert (64 decode tokens) an 8-row tile pads half its MMA work, a 16-row
#     one three quarters.
#   - k_width 8: a thread holds 8 consecutive K elements of a row, one NVFP4 block, so its codes are one
#     8-byte load, its block scale one byte, and the decode feeds the MMA operand with no data movement.
#   - SwiGLU: the tile's weight rows alternate 8 gate rows and their 8 up rows, so that gate and up of one
#     output sit in the same thread's accumulator registers; the epilogue splits them in registers.
#   - ExpertWeights' layout: a program's K steps read a few contiguous runs.
#   - A tile holding at most half its rows runs as a tile of half the rows, one of 32 rows or more at most
#     three quarters full as that half plus a quarter (the loop and epilogue are compiled for each size): at
#     16 rows an expert most 32-row tiles skip 8 or 16 padding rows' MMAs and activation loads.
# No shared memory and no software pipeline: programs a multiprocessor (registers allow 3-4) hide the load
# latency. A cp.async pipeline of 3-6 stages, a one-step register prefetch, and wgmma in place of mma.sync
# (the activation tile in shared memory once per warpgroup) were all no faster (README).
if gluon is not None:
    @gluon.constexpr_function
    def _gluon_mma_layout(num_warps):
        """mma.sync m16n8k16's accumulator layout, the warps stacked along the weight rows (the MMA's M)."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])

    @gluon.jit
    def _gluon_e2m1_pairs(packed):
        return gl.inline_asm_elementwise(_E2M1_PAIRS_PTX, "=r,=r,=r,=r,r", [packed],
                                         dtype=(gl.float16, gl.float16), is_pure=True, pack=4)

    @gluon.jit
    def _gluon_add(a, b):
        return a + b

    @gluon.jit
    def _gluon_expert_tile(counts_ptr, E, pid_m, BLOCK_T: gl.constexpr, E_POW2: gl.constexpr,
                           NUM_WARPS: gl.constexpr):
        """_expert_tile in Gluon: program pid_m's (expert, first sorted row, end row of the expert)."""
        experts = gl.arange(0, E_POW2, layout=gl.BlockedLayout([1], [32], [NUM_WARPS], [0]))
        counts = gl.load(counts_ptr + experts, mask=experts < E, other=0).to(gl.int64)
        packed = (((counts + BLOCK_T - 1) // BLOCK_T) << 32) + counts
        ends = gl.associative_scan(packed, 0, _gluon_add)               # (tile end << 32) + row end
        expert = gl.sum(((ends >> 32) <= pid_m).to(gl.int32), axis=0)
        start = gl.sum(gl.where(experts == expert, ends - packed, 0), axis=0)
        first_tile = start >> 32
        first_row = (start - (first_tile << 32)).to(gl.int32)
        rows = gl.sum(gl.where(experts == expert, counts, 0), axis=0).to(gl.int32)
        return expert, first_row + (pid_m - first_tile.to(gl.int32)) * BLOCK_T, first_row + rows

    @gluon.jit
    def _gluon_gate_up(t, W_ROWS: gl.constexpr, BLOCK_T: gl.constexpr):
        """A (W_ROWS, T) tile whose rows alternate 8 gate and 8 up rows -> gate, up: (W_ROWS / 2, T) each."""
        gate, up = gl.split(gl.permute(gl.reshape(t, (W_ROWS // 16, 2, 8, BLOCK_T)), (0, 2, 3, 1)))
        return gl.reshape(gate, (W_ROWS // 2, BLOCK_T)), gl.reshape(up, (W_ROWS // 2, BLOCK_T))

    @gluon.jit
    def _gluon_wait_for_previous_kernel():
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    def _gluon_prune(configs, named_args, **kwargs):
        """The call's M bucket; BLOCK_K at most one chunk of the weight's layout and a divisor of it: 64 or
        128 (an operand of k_width 8 needs 32 K elements an MMA, 64 of the even and odd halves). A divisor,
        where _grouped_prune only caps the step: this kernel has no K masks, so no step may run past K."""
        chunk = kwargs["CHUNK"]
        def step(c):
            return max(b for b in (64, 128) if b <= c.kwargs["BLOCK_K"] and chunk % b == 0)
        return [triton.Config({**c.kwargs, "BLOCK_K": step(c)}, num_warps=c.num_warps)
                for c in configs if c.kwargs["BUCKET"] == named_args["M_BUCKET"]]

    # (BLOCK_T rows, BLOCK_N output columns, BLOCK_K, warps) per bucket of rows an expert (mean). Timed on the
    # H200 at 64 and 256 decode tokens (4 and 16 rows an expert): 8-row tiles at 4, 32-row tiles at 16 (one
    # decode of the weight where 16-row tiles decode it about 1.5 times). At 8 (128 tokens) 8-row tiles would
    # decode the weight of an expert with 9 to 16 rows twice: 16-row tiles, whose half serves those with 8 or
    # fewer, are candidates beside them. Larger buckets: prefill.
    GLUON_CONFIGS = {
        4: [(8, 64, 128, 4), (8, 128, 128, 4), (8, 128, 64, 4)],
        8: [(16, 128, 128, 4), (16, 64, 128, 4), (16, 128, 64, 4), (8, 128, 128, 4), (8, 128, 64, 4)],
        16: [(32, 64, 64, 4), (32, 128, 64, 4), (16, 128, 128, 4)],
        64: [(32, 64, 64, 4), (32, 128, 64, 4), (64, 64, 64, 4)],
        4096: [(64, 64, 64, 4), (64, 128, 64, 8), (32, 128, 64, 4)],
    }

    @gluon.jit
    def _gluon_token_rows(x_ptr, row_ids_ptr, stride_x, t0, end_row, GATHER: gl.constexpr, T: gl.constexpr,
                          KC: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Sorted rows t0 .. t0 + T (those before end_row) as the MMA's right operand: pointers to their
        (KC, T) columns of the fp16 operand planes at K = 0, and their mask."""
        mma: gl.constexpr = _gluon_mma_layout(NUM_WARPS)
        x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        t_x = t0 + gl.arange(0, T, layout=gl.SliceLayout(0, x_layout))
        if GATHER:
            x_rows = gl.load(row_ids_ptr + t_x, mask=t_x < end_row, other=0)
        else:
            x_rows = t_x.to(gl.int64)
        x_base = (x_ptr + x_rows.to(gl.int64)[None, :] * stride_x
                  + gl.arange(0, KC, layout=gl.SliceLayout(1, x_layout))[:, None])
        return x_base, (t_x < end_row)[None, :]

    @gluon.jit
    def _gluon_expert_store(acc, scale, t0, end_row, pid_n, n_out, y_ptr, stride_y, row_weights_ptr,
                            weight_ids_ptr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr,
                            SWIGLU: gl.constexpr, T: gl.constexpr, BLOCK_N: gl.constexpr,
                            NUM_WARPS: gl.constexpr):
        """The epilogue of rows t0 .. t0 + T: both global scales and 2^12 (scale), SwiGLU, router weights."""
        W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
        mma: gl.constexpr = _gluon_mma_layout(NUM_WARPS)
        out = acc * scale                                                                # (W_ROWS, T)
        t_y = t0 + gl.arange(0, T, layout=gl.SliceLayout(0, mma))
        r_y = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma))
        col_y = pid_n * BLOCK_N + ((r_y // 16) * 8 + r_y % 8 if SWIGLU else r_y)
        y_ptrs = y_ptr + t_y.to(gl.int64)[None, :] * stride_y + col_y[:, None]
        y_mask = (t_y < end_row)[None, :] & (col_y < n_out)[:, None]
        if ROW_WEIGHTS:
            ids = gl.load(weight_ids_ptr + t_y, mask=t_y < end_row, other=0) if WEIGHT_IDS else t_y
            router = gl.load(row_weights_ptr + ids, mask=t_y < end_row, other=0.0).to(gl.float32)
            router = gl.zeros_like(out) + router[None, :]
        if SWIGLU:
            gate, up = _gluon_gate_up(out, W_ROWS, T)
            out = gate / (1.0 + gl.exp(-gate)) * up                                      # (BLOCK_N, T)
            y_ptrs, _ = _gluon_gate_up(y_ptrs, W_ROWS, T)
            y_mask, _ = _gluon_gate_up(y_mask, W_ROWS, T)
            if ROW_WEIGHTS:
                router, _ = _gluon_gate_up(router, W_ROWS, T)
        if ROW_WEIGHTS:
            out = out * router
        gl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)  # bf16: round to nearest even

    @gluon.jit
    def _gluon_expert_rows(args, tile, GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr,
                           WEIGHT_IDS: gl.constexpr, SWIGLU: gl.constexpr, CHUNK: gl.constexpr,
                           BLOCK_T: gl.constexpr, EXTRA: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr):
        """tile = (expert, row0, end_row, pid_n): sorted rows row0 .. min(row0 + BLOCK_T + EXTRA, end_row) of
        `expert` times its weight rows of output tile pid_n, into y: BLOCK_T rows, and EXTRA more (0, or a
        quarter of the autotuned tile) in a second accumulator on the same decoded weight. args:
        _grouped_gluon_kernel's pointers, sizes and strides."""
        (x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr, w_global_ptr,
         y_ptr, N, K, x_plane, stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc,
         stride_y) = args
        expert, row0, end_row, pid_n = tile
        W_ROWS: gl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
        KC: gl.constexpr = BLOCK_K // 2                                   # bytes of a row a K step
        mma: gl.constexpr = _gluon_mma_layout(NUM_WARPS)
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        n_out = N // 2 if SWIGLU else N
        # the right operand: the tile's activation rows, as (K, T) columns of the fp16 operand planes
        x_base, x_mask = _gluon_token_rows(x_ptr, row_ids_ptr, stride_x, row0, end_row, GATHER, BLOCK_T, KC,
                                           NUM_WARPS)
        if EXTRA:
            x2_base, x2_mask = _gluon_token_rows(x_ptr, row_ids_ptr, stride_x, row0 + BLOCK_T, end_row,
                                                 GATHER, EXTRA, KC, NUM_WARPS)
        # the left operand: W_ROWS weight rows (SwiGLU: 8 gate rows, their 8 up rows, the next 8 gate rows...)
        r = gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, w_layout))
        if SWIGLU:
            col = pid_n * BLOCK_N + (r // 16) * 8 + r % 8
            w_rows = col + ((r // 8) % 2) * n_out
        else:
            col = pid_n * BLOCK_N + r
            w_rows = col
        w_mask = (col < n_out)[:, None]
        block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS
        k = gl.arange(0, KC, layout=gl.SliceLayout(0, w_layout))
        w_base = (w_ptr + expert.to(gl.int64) * stride_we
                  + gl.multiple_of(block * stride_wb + row * (CHUNK // 2), 16)[:, None] + k[None, :])
        s_base = (w_scale_ptr + expert.to(gl.int64) * stride_se
                  + (block * stride_sb + row * (CHUNK // 16))[:, None] + (k // 8)[None, :])
        acc = gl.zeros((W_ROWS, BLOCK_T), gl.float32, layout=mma)
        if EXTRA:
            acc2 = gl.zeros((W_ROWS, EXTRA), gl.float32, layout=mma)
        for k0 in range(0, K, BLOCK_K):
            chunk, within = k0 // CHUNK, k0 % CHUNK
            step = gl.multiple_of(chunk * stride_wc + within // 2, 16)
            codes = gl.load(w_base + step, mask=w_mask, other=0)
            scale = gl.load(s_base + chunk * stride_sc + within // 16, mask=w_mask, other=0)
            scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float16)           # exact
            x_even = gl.load(x_base + k0 // 2, mask=x_mask, other=0.0)
            x_odd = gl.load(x_base + x_plane + k0 // 2, mask=x_mask, other=0.0)
            w_even, w_odd = _gluon_e2m1_pairs(codes)
            w_even, w_odd = w_even * scale, w_odd * scale
            acc = gl.nvidia.ampere.mma_v2(w_even, x_even, acc)
            acc = gl.nvidia.ampere.mma_v2(w_odd, x_odd, acc)
            if EXTRA:
                x2_even = gl.load(x2_base + k0 // 2, mask=x2_mask, other=0.0)
                x2_odd = gl.load(x2_base + x_plane + k0 // 2, mask=x2_mask, other=0.0)
                acc2 = gl.nvidia.ampere.mma_v2(w_even, x2_even, acc2)
                acc2 = gl.nvidia.ampere.mma_v2(w_odd, x2_odd, acc2)
        scale = _EPILOGUE * gl.load(x_global_ptr) * gl.load(w_global_ptr + expert)
        _gluon_expert_store(acc, scale, row0, end_row, pid_n, n_out, y_ptr, stride_y, row_weights_ptr,
                            weight_ids_ptr, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, BLOCK_T, BLOCK_N, NUM_WARPS)
        if EXTRA:
            _gluon_expert_store(acc2, scale, row0 + BLOCK_T, end_row, pid_n, n_out, y_ptr, stride_y,
                                row_weights_ptr, weight_ids_ptr, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, EXTRA,
                                BLOCK_N, NUM_WARPS)

    @triton.autotune(configs=[triton.Config({"BLOCK_T": t, "BLOCK_N": n, "BLOCK_K": k, "NUM_WARPS": w,
                                             "BUCKET": bucket}, num_warps=w)
                              for bucket, rows in GLUON_CONFIGS.items() for t, n, k, w in rows],
                     key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _gluon_prune},
                     do_bench=_bench_in_graph)
    @gluon.jit
    def _grouped_gluon_kernel(
        # pointers, as _grouped_kernel's; the weight in ExpertWeights' layout
        x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr, w_global_ptr,
        counts_ptr, y_ptr,
        # sizes: N is the weight's rows (2I for SwiGLU, whose output has N/2 columns)
        N, K, E, M_BUCKET, x_plane,
        # strides: activation rows; weight (expert, row block, chunk) in bytes, scales in blocks; y rows
        stride_x, stride_we, stride_wb, stride_wc, stride_se, stride_sb, stride_sc, stride_y,
        # meta-parameters
        GATHER: gl.constexpr, ROW_WEIGHTS: gl.constexpr, WEIGHT_IDS: gl.constexpr, SWIGLU: gl.constexpr,
        E_POW2: gl.constexpr, CHUNK: gl.constexpr, PDL: gl.constexpr, BUCKET: gl.constexpr,
        BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        if PDL:
            _gluon_wait_for_previous_kernel()
        pid_m, pid_n = gl.program_id(0), gl.program_id(1)
        expert, row0, end_row = _gluon_expert_tile(counts_ptr, E, pid_m, BLOCK_T, E_POW2, NUM_WARPS)
        if expert >= E:  # the grid is an upper bound on the tile count: surplus programs exit
            return
        args = (x_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr, w_ptr, w_scale_ptr,
                w_global_ptr, y_ptr, N, K, x_plane, stride_x, stride_we, stride_wb, stride_wc, stride_se,
                stride_sb, stride_sc, stride_y)
        tile = (expert, row0, end_row, pid_n)
        # a tile holding at most half its rows (most often an expert's last) runs as a tile of half the rows,
        # one of at most three quarters as that half plus a quarter: the padding rows' MMAs and loads skipped
        # (at 16 rows an expert about half of the 32-row tiles run as 16 rows, and most others as 16 + 8)
        rows = end_row - row0
        if BLOCK_T >= 16 and rows <= BLOCK_T // 2:
            _gluon_expert_rows(args, tile, GATHER, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, CHUNK, BLOCK_T // 2, 0,
                               BLOCK_N, BLOCK_K, NUM_WARPS)
        elif BLOCK_T >= 32 and rows <= BLOCK_T // 2 + BLOCK_T // 4:
            _gluon_expert_rows(args, tile, GATHER, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, CHUNK, BLOCK_T // 2,
                               BLOCK_T // 4, BLOCK_N, BLOCK_K, NUM_WARPS)
        else:
            _gluon_expert_rows(args, tile, GATHER, ROW_WEIGHTS, WEIGHT_IDS, SWIGLU, CHUNK, BLOCK_T, 0,
                               BLOCK_N, BLOCK_K, NUM_WARPS)


def _gluon_experts(device):
    """Whether the experts' GEMM takes the Gluon kernel on `device`: CUDA, compute capability 8.9 to 9.x
    (cvt.e4m3x2 needs 8.9; sm_100+ takes tl.dot_scaled), Gluon importable, not the interpreter."""
    if gluon is None or _INTERPRET or device.type != "cuda":
        return False
    return KERNEL_CAPABILITY <= _capability(device) < (10, 0)


def _grouped_gluon(act, w, counts, row_ids, row_weights, row_weight_ids, y, flags):
    """grouped_matmul_triton's launch of the Gluon kernel: act's fp16 operand, y allocated by it."""
    E, N, K = w.shape
    operand, (n_rows, n_out) = act.operand, y.shape

    def grid(meta):  # an upper bound on sum_e cdiv(counts[e], BLOCK_T): no host sync
        return triton.cdiv(n_rows, meta["BLOCK_T"]) + min(E, n_rows), triton.cdiv(n_out, meta["BLOCK_N"])

    # flags less OUT_BF16: the Gluon kernel stores in y's dtype (it never runs under the interpreter)
    _grouped_gluon_kernel[grid](
        operand, act.global_scale, row_ids, row_weights, row_weight_ids, w.data,
        w.block_scale.view(torch.uint8), w.global_scale, counts, y, N, K, E,
        _m_bucket(triton.cdiv(n_rows, E), GLUON_CONFIGS), operand.stride(0), operand.stride(1),
        *w.data.stride()[:3], *w.block_scale.stride()[:3], y.stride(0), CHUNK=w.chunk,
        **{k: v for k, v in flags.items() if k != "OUT_BF16"}, **_launch_options(w.device))
    return y


# ======================================================================== Blackwell: native FP4 kernels
if triton is not None:
    # sm_100+; compiled for sm_100 by a CPU test, numerics untested (no such GPU here). One tl.dot_scaled per
    # loop body: with two (x and its residual, or gate and up) Triton 3.6's automatic warp specialization
    # fails to compile for sm_100. So the residual is a second pass over K (the weight tiles read again,
    # mostly from L2), and SwiGLU's gate and up rows are one stacked tile, as in the Hopper kernel.
    @triton.jit
    def _native_k_loop(acc, x_ptr, xs_ptr, rows, row_mask, stride_x, stride_xs, w_rows_ptr, ws_rows_ptr,
                       col_mask, w_step, ws_step, K, BLOCK_K: tl.constexpr):
        """acc (BLOCK_M, cols) += X[rows] @ W[cols].T over all of K on FP4 tensor cores. W's rows start at
        w_rows_ptr (codes) and ws_rows_ptr (scales); each BLOCK_K step lies w_step bytes and ws_step scales
        further on (BLOCK_K / 2 and / 16 in row-major codes; the chunk stride in ExpertWeights of
        BLOCK_K-element chunks)."""
        byte_idx, block_idx = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 16)
        for k0 in range(0, K, BLOCK_K):
            step = k0 // BLOCK_K
            byte_ok, block_ok = k0 // 2 + byte_idx < K // 2, k0 // 16 + block_idx < K // 16
            x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 // 2 + byte_idx)[None, :],
                        mask=row_mask[:, None] & byte_ok[None, :], other=0)
            xs = tl.load(xs_ptr + rows[:, None] * stride_xs + (k0 // 16 + block_idx)[None, :],
                         mask=row_mask[:, None] & block_ok[None, :], other=0.0)
            w = tl.load(w_rows_ptr[:, None] + step * w_step + byte_idx[None, :],
                        mask=col_mask[:, None] & byte_ok[None, :], other=0)
            ws = tl.load(ws_rows_ptr[:, None] + step * ws_step + block_idx[None, :],
                         mask=col_mask[:, None] & block_ok[None, :], other=0.0)
            acc = tl.dot_scaled(x, xs, "e2m1", tl.trans(w), ws, "e2m1", acc)
        return acc

    @triton.jit
    def _dense_native_kernel(
        x_ptr, x_scale_ptr, r_ptr, r_scale_ptr, x_global_ptr, w_ptr, w_scale_ptr, w_global_ptr, y_ptr,
        M, N, K, N1, N2, stride_x, stride_xs, stride_w, stride_ws,
        HAS_RESIDUAL: tl.constexpr, OUT_BF16: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y = (x + r) @ W.T: packed codes and E4M3 scales go to tl.dot_scaled as they are."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_rows, ws_rows = w_ptr + cols.to(tl.int64) * stride_w, w_scale_ptr + cols.to(tl.int64) * stride_ws
        acc = _native_k_loop(acc, x_ptr, x_scale_ptr, rows, row_mask, stride_x, stride_xs, w_rows, ws_rows,
                             col_mask, BLOCK_K // 2, BLOCK_K // 16, K, BLOCK_K)
        if HAS_RESIDUAL:  # the same weights, the residual's codes
            acc = _native_k_loop(acc, r_ptr, r_scale_ptr, rows, row_mask, stride_x, stride_xs, w_rows,
                                 ws_rows, col_mask, BLOCK_K // 2, BLOCK_K // 16, K, BLOCK_K)
        which, col_base, col_stride = _split_columns(cols, M, N, N1, N2)
        scale = tl.load(x_global_ptr) * tl.load(w_global_ptr + which, mask=col_mask, other=0.0)[None, :]
        _store_split(y_ptr, rows, row_mask, col_base, col_stride, col_mask, tl.trans(acc * scale), OUT_BF16)

    @triton.jit
    def _grouped_native_kernel(
        x_ptr, x_scale_ptr, r_ptr, r_scale_ptr, x_global_ptr, row_ids_ptr, row_weights_ptr, weight_ids_ptr,
        w_ptr, w_scale_ptr, w_global_ptr, counts_ptr, y_ptr,
        N, K, E, stride_x, stride_xs, stride_we, stride_wb, stride_wr, w_step, stride_se, stride_sb,
        stride_sr, s_step, stride_y,
        GATHER: tl.constexpr, ROW_WEIGHTS: tl.constexpr, WEIGHT_IDS: tl.constexpr, SWIGLU: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, OUT_BF16: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """The grouped kernel on FP4 tensor cores (SWIGLU: the gate and up rows as one stacked tile)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert, row0, end_row = _expert_tile(counts_ptr, E, pid_m, BLOCK_M, E_POW2)
        if expert >= E:
            return
        sorted_rows, row_mask, x_rows, weight_rows = _tile_rows(row_ids_ptr, weight_ids_ptr, row0, end_row,
                                                                GATHER, WEIGHT_IDS, BLOCK_M)
        n_out = N // 2 if SWIGLU else N
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_out
        W_ROWS: tl.constexpr = 2 * BLOCK_N if SWIGLU else BLOCK_N
        w_rows, w_mask = _expert_weight_rows(pid_n, n_out, BLOCK_N, SWIGLU)
        block, row = w_rows // EXPERT_ROWS, w_rows % EXPERT_ROWS  # ExpertWeights' layout
        w_base = w_ptr + expert.to(tl.int64) * stride_we + block * stride_wb + row * stride_wr
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_se + block * stride_sb + row * stride_sr
        acc = tl.zeros((BLOCK_M, W_ROWS), dtype=tl.float32)
        acc = _native_k_loop(acc, x_ptr, x_scale_ptr, x_rows, row_mask, stride_x, stride_xs, w_base, ws_base,
                             w_mask, w_step, s_step, K, BLOCK_K)
        if HAS_RESIDUAL:
            acc = _native_k_loop(acc, r_ptr, r_scale_ptr, x_rows, row_mask, stride_x, stride_xs, w_base,
                                 ws_base, w_mask, w_step, s_step, K, BLOCK_K)
        out = acc * (tl.load(x_global_ptr) * tl.load(w_global_ptr + expert))
        if SWIGLU:
            out = _swiglu(out, BLOCK_N, BLOCK_M, False)                                  # (BLOCK_M, BLOCK_N)
        if ROW_WEIGHTS:
            router_weight = tl.load(row_weights_ptr + weight_rows, mask=row_mask, other=0.0).to(tl.float32)
            out = out * router_weight[:, None]
        _store_tile(y_ptr, sorted_rows, row_mask, cols, col_mask, stride_y, tl.trans(out), OUT_BF16)


def _dense_native(x_q, residual, w_q, out_dtype, splits=None):
    M, K = x_q.shape
    N = w_q.shape[0]
    y = torch.empty(M * N, dtype=out_dtype, device=x_q.device)
    r = residual if residual is not None else x_q
    block_m, block_n, block_k = 128, 128, 128
    _dense_native_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x_q.data, x_q.block_scale, r.data, r.block_scale, x_q.global_scale, w_q.data, w_q.block_scale,
        w_q.global_scale, _as_int16(y), M, N, K, *_column_splits(w_q, splits), x_q.data.stride(0),
        x_q.block_scale.stride(0), w_q.data.stride(0), w_q.block_scale.stride(0),
        HAS_RESIDUAL=residual is not None,
        OUT_BF16=out_dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return _split_output(y, M, N, splits)


def _grouped_native(act, w, counts, row_ids, row_weights, row_weight_ids, y, flags):
    """grouped_matmul_triton's launch on Blackwell: act's codes, y (rows, N or N/2) allocated by it."""
    E, N, K = w.shape
    r = act.residual if act.residual is not None else act.x_q
    (rows, n_out), block_m, block_n, block_k = y.shape, 128, 128, EXPERT_K_CHUNK
    # a K step is one chunk, or (K one chunk) block_k / 2 bytes further along the row
    pairs = ((w.data, 2), (w.block_scale, BLOCK_SIZE))
    steps = [t.stride(2) if w.chunk == block_k else block_k // per for t, per in pairs]
    _grouped_native_kernel[(triton.cdiv(rows, block_m) + min(E, rows), triton.cdiv(n_out, block_n))](
        act.x_q.data, act.x_q.block_scale, r.data, r.block_scale, act.global_scale, row_ids, row_weights,
        row_weight_ids, w.data, w.block_scale, w.global_scale, counts, _as_int16(y), N, K, E,
        act.x_q.data.stride(0), act.x_q.block_scale.stride(0), w.data.stride(0), w.data.stride(1),
        w.data.stride(3), steps[0], w.block_scale.stride(0), w.block_scale.stride(1), w.block_scale.stride(3),
        steps[1], y.stride(0),
        HAS_RESIDUAL=act.residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, **flags)
    return y


# ======================================================================== the one place a path is chosen
_BACKENDS = {}


def _native_agrees(device):
    """Run the native kernels once on a check problem and compare them with the Hopper kernels.
    Any disagreement or error: warn once, in one line, and return False (use the portable kernels)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(48, 256, generator=generator).to(device, torch.bfloat16)
    w_q = nvfp4.quantize_weight(torch.randn(80, 256, generator=generator).to(device, torch.bfloat16))
    stacked = torch.randn(3, 80, 256, generator=generator).to(device, torch.bfloat16)
    stacked = chunk_experts(nvfp4.quantize_weight(stacked))
    counts = torch.tensor([20, 0, 28], device=device)
    mask = torch.arange(16, device=device) % 2 == 0
    act = quantize_activation_triton(x, mask, codes=True, operand=True)
    codes = act._replace(operand=None)  # what the native kernels take
    checks = (("dense", lambda: _dense_native(act.x_q, act.residual, w_q, torch.float32),
               lambda: _dense_portable(w_q, torch.float32, act=act)),
              ("grouped", lambda: grouped_matmul_triton(codes, stacked, counts, out_dtype=torch.float32),
               lambda: grouped_matmul_triton(act, stacked, counts, out_dtype=torch.float32)))
    for name, native, portable in checks:
        reference = portable()
        try:
            result = native()
        except Exception as error:  # a compiler or launch failure: report it and keep the portable path
            warnings.warn(f"rac.py: the native FP4 {name} GEMM failed on {device} ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); using the portable kernels")
            return False
        error = ((result - reference).norm() / reference.norm()).item()
        if not error < 1e-3:
            warnings.warn(f"rac.py: the native FP4 {name} GEMM disagrees with the portable kernel on "
                          f"{device} (relative error {error:.2e}); using the portable kernels")
            return False
    return True


def gemm_backend(device):
    """'native' (tl.dot_scaled on sm_100+, if it passed its first-use check) or 'portable'."""
    if device.type != "cuda":
        return "portable"
    index = _cuda_index(device)
    if index not in _BACKENDS:
        blackwell = _capability(device) >= (10, 0)
        _BACKENDS[index] = ("native" if blackwell and _native_agrees(torch.device("cuda", index))
                            else "portable")
    return _BACKENDS[index]
