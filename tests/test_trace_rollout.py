"""trace_rollout.py: the rollout records its codes only between start() and stop(), only at decode steps,
one record per completion token (and per (token, expert) for the experts' down input), and the trainer's
trace layers get them as an argument of one call. (That the recorded codes are the rollout kernel's, bit
for bit, and what the trainer makes of them: test_qat.py.)"""
import copy

import torch

import moe
import qat
import rac
import rollout
import trace_rollout


def test_the_rollout_records_only_when_asked_and_the_trainer_takes_the_codes_for_one_call():
    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MoEConfig.from_preset("tiny"))
    model.init_weights(std=0.2)
    trace_trainer = qat.convert_for_training(copy.deepcopy(model), "trace")
    rollout_model = rac.convert_for_rollout(copy.deepcopy(model), "nvfp4")
    recorder = trace_rollout.attach(rollout_model)
    generate = dict(num_samples=2, max_new_tokens=4, eos_id=None, pad_id=0, seed=0)
    rollout.generate(rollout_model, [[1, 2, 3]], **generate)  # an evaluation: not recorded
    assert recorder.steps == {}
    recorder.start()
    out = rollout.generate(rollout_model, [[1, 2, 3]], **generate)
    shared = qat.SharedState(codes=trace_rollout.codes(recorder, out))
    assert shared.codes["layers.0.attn.o_proj"][0].keys.numel() == 2 * 4  # 2 samples x 4 decode steps
    assert shared.codes["layers.1.mlp.experts"][1].keys.numel() == 2 * 4 * 2           # A = 2
    with qat.sharing(trace_trainer, shared):  # the codes reach the layers for this call only
        assert trace_trainer.layers[0].attn.o_proj.rollout_codes is shared.codes["layers.0.attn.o_proj"]
    assert all(m.rollout_codes is None for m in trace_trainer.modules() if isinstance(m, qat.QATLinear))
