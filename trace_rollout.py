"""TRACE's rollout side: the codes, block scales and global scales the rollout's quantizers used for the
completion tokens, recorded while it decodes, for qat.py's rollout-guided rounding (the trainer side).

At each decode step every quantized layer input x is re-quantized with nvfp4.quantize (the rollout's own
rule, so the same codes); after the rollout only the completion tokens (the ones trained on) are kept,
keyed by the trainer's position b * W + w, and the experts' down input by (position) * E + expert: that
input exists only for the experts the rollout chose. Prompt tokens come from the prefill and are not
recorded (the trainer rounds them itself). Memory per completion token and layer input of width K:
K/2 bytes of codes + K/16 of block scales + 4 (fp32 global scale) + 8 (int64 key); the down input has A
rows per token, and q, k and v share one record: 1.5 KB per token and layer on the small preset. During
the rollout every decode step is kept for all N rows until the completion tokens are picked out (small
preset, 256 rows x 128 tokens: 400 MB); everything is freed after the optimizer step.

The rollout's layers take their input alone (`layer(x)`), so the recorder is fed by forward hooks on them
(`attach`): hooks do not run when a CUDA graph replays, so a `trace` rollout decodes eagerly.
"""
import torch

import moe
import nvfp4
import qat
import rac


class RolloutRecorder:
    """Collects what the rollout's quantizers used at each decode step, for `trace` (module docstring).

    Fed from the rollout model (`attach`): `begin_forward(decoding)` at every model forward, `route(path,
    expert_ids, n_experts)` at every experts layer, `record(path, index, x)` at every quantized input (x as
    the quantizer sees it; index 0 for a linear layer and the experts' gate/up input, 1 for their down
    input, rows sorted by expert as moe.route_tokens sorts them); only between `start()` and `stop()`, and
    never during prefills. `codes(...)` then gives each layer path its tuple of RolloutCodes."""

    def __init__(self):
        self.start()
        self.stop()

    def start(self):
        self.steps, self.experts, self.order, self.n_experts, self._memo = {}, {}, {}, {}, {}
        self.active = True

    def stop(self):
        self.active = self.decoding = False
        self._memo = {}

    def begin_forward(self, decoding):
        self.decoding = bool(decoding)
        self._memo = {}

    @torch.no_grad()
    def route(self, path, expert_ids, n_experts):
        """An experts layer's routes (T, A) at this step, which fix the order of its down input's rows."""
        if self.active and self.decoding:
            self.order[path] = moe.route_tokens(expert_ids, n_experts).order
            self.experts.setdefault(path, []).append(expert_ids)
            self.n_experts[path] = n_experts

    @torch.no_grad()
    def record(self, path, index, x):
        """x (M, K): input `index` of the layer at `path`, at this decode step."""
        if not (self.active and self.decoding):
            return
        # q, k and v quantize one tensor: record it once. The memo holds x, so that no other tensor can
        # take its address before the next forward.
        memo_key = (x.data_ptr(), tuple(x.shape), x.dtype, index)
        if memo_key not in self._memo:
            q = nvfp4.quantize(x)
            data, block_scale = q.data, q.block_scale.view(torch.uint8)
            if index == 1:  # rows sorted by expert -> assignment order t * A + a
                order = self.order[path]
                data = data.index_copy(0, order, data)
                block_scale = block_scale.index_copy(0, order, block_scale)
            self._memo[memo_key] = (x, (data, block_scale, q.global_scale.reshape(()).float()))
        self.steps.setdefault((path, index), []).append(self._memo[memo_key][1])

    @torch.no_grad()
    def codes(self, completion_mask, prompt_lengths, width):
        """{layer path: (RolloutCodes, ...)} for the completion tokens only, keyed by trainer position
        b * W + w, where completion token t of row b sits at column prompt_lengths[b] + t (right-padded
        rows of width W); the experts' down inputs by (b * W + w) * E + expert. completion_mask (B, T)."""
        B, T = completion_mask.shape
        b, t = completion_mask.nonzero(as_tuple=True)                                   # (n,) each, ascending
        position = b * width + prompt_lengths[b] + t                                    # (n,) trainer rows
        stacked, by_path = {}, {}

        def stack(records, i):  # T steps of (B[*A], ...) -> (B[*A], T, ...), once per recorded tensor
            key = (id(records[0][i]), i)
            if key not in stacked:
                stacked[key] = torch.stack([r[i] for r in records[:T]], dim=1)
            return stacked[key]

        shared = {}  # sites that recorded one tensor (q, k, v) get one RolloutCodes object
        for (path, index), records in self.steps.items():
            if (id(records[0]), index) in shared:
                by_path.setdefault(path, {})[index] = shared[(id(records[0]), index)]
                continue
            if len(records) < T:
                raise ValueError(f"RolloutRecorder: {path!r} saw {len(records)} decode steps, "
                                 f"the rollout has {T} tokens")
            data, block_scale = stack(records, 0), stack(records, 1)
            global_scale = torch.stack([r[2] for r in records[:T]])                     # (T,)
            if index == 1:
                experts = torch.stack(self.experts[path][:T], dim=1)                   # (B, T, A)
                A = experts.shape[-1]
                data = data.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)      # (n * A, K/2)
                block_scale = block_scale.view(B, A, T, -1).transpose(1, 2)[b, t].flatten(0, 1)
                keys = (position[:, None] * self.n_experts[path] + experts[b, t]).flatten()  # (n * A,)
                order = keys.argsort()
                codes = qat.RolloutCodes(keys[order], data[order],
                                         block_scale[order].view(torch.float8_e4m3fn),
                                         global_scale[t].repeat_interleave(A)[order], self.n_experts[path])
            else:
                codes = qat.RolloutCodes(position, data[b, t], block_scale[b, t].view(torch.float8_e4m3fn),
                                         global_scale[t])
            by_path.setdefault(path, {})[index] = shared[(id(records[0]), index)] = codes
        return {path: tuple(sites.get(i) for i in range(max(sites) + 1)) for path, sites in by_path.items()}


def attach(rollout_model):
    """A RolloutRecorder fed by hooks on the rollout's quantizers (their RACSelectors see each input
    exactly as it is quantized); it keeps nothing outside recorder.start() ... recorder.stop()."""
    recorder = RolloutRecorder()
    # a decode step is a forward with a KV cache that is not prefilling (rollout.KVCache)
    rollout_model.register_forward_pre_hook(lambda m, args, kwargs: recorder.begin_forward(
        getattr(kwargs.get("kv_cache"), "prefill_rows", 0) is None), with_kwargs=True)
    for path, module in rollout_model.named_modules():
        if isinstance(module, rac.NVFP4Linear):
            module.rac.register_forward_pre_hook(lambda m, args, p=path: recorder.record(p, 0, args[0]))
        elif isinstance(module, rac.NVFP4Experts):
            module.register_forward_pre_hook(lambda m, args, p=path: recorder.route(p, args[1], m.n_experts))
            for index, selector in enumerate((module.rac_gate_up, module.rac_down)):  # gate/up, down inputs
                selector.register_forward_pre_hook(
                    lambda m, args, p=path, i=index: recorder.record(p, i, args[0]))
    return recorder


def codes(recorder, out):
    """After a trace rollout: its recorded codes, keyed by the trainer's (row, column)."""
    recorder.stop()
    width = int((out.prompt_lengths + out.completion_lengths).max())  # = out.sequences().tokens.shape[1]
    return recorder.codes(out.completion_mask, out.prompt_lengths, width)
