"""Group prof_decode.py's kernel times into the stages of a decode step (us per step, 4 layers)."""
import re, sys
STAGES = [("experts' grouped GEMMs", r"_grouped_kernel|cutlass.*Group|prepare_grouped"),
          ("dense GEMMs (q/k/v, o)", r"_dense_kernel|nvjet_sm90_tst_(64x8_64x16_2x4_h|64x24|512x8|64x64|128x64|48x64|128x8|64x8_64x16_2x4_h_bz_TNT)|splitKreduce"),
          ("activation quantizers", r"_quantize_activation_kernel|_partial_amax_kernel"),
          ("attention (SDPA)", r"sdpa|flash"),
          ("norms and RoPE", r"_rms_norm_kernel|_norm_rope_kernel|CatArrayBatchedCopy<|neg_kernel|BinaryFunctor<c10::BFloat16"),
          ("routing (top-k, sort, gather, combine)", r"sbtopk|bitonicSort|radixSort|searchsorted|_route_|softmax_warp|scatter_gather|div_floor|vectorized_gather|index_kernel|reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16|ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum"),
          ("sampler", r"_noise_kernel|_sample_|SoftMaxForward|ArgMax|exp_kernel|DivFunctor|MulFunctor"),
          ("LM head", r"nvjet_sm90_tst_256x"),]
def parse(path):
    runs, cur = {}, None
    for line in open(path):
        m = re.match(r"## (.*), batch (\d+): wall ([\d.]+) ms/step, kernel time ([\d.]+) ms/step, (\d+) kernels", line)
        if m:
            cur = (m[1], int(m[2])); runs[cur] = {"wall": float(m[3]) * 1e3, "kernels": int(m[5]), "stages": {}}
            continue
        m = re.match(r"\s+([\d.]+) us\s+([\d.]+)x\s+(.*)", line)
        if m and cur:
            stage = next((s for s, p in STAGES if re.search(p, m[3])), "other")
            st = runs[cur]["stages"]; st[stage] = st.get(stage, 0.0) + float(m[1])
    return runs
before, after = parse(sys.argv[1]), parse(sys.argv[2])
for key in before:
    b, a = before[key], after[key]
    print(f"\n{key[0]}, batch {key[1]}: wall {b['wall']:.0f} -> {a['wall']:.0f} us/step, kernels {b['kernels']} -> {a['kernels']}")
    for s in [s for s, _ in STAGES] + ["other"]:
        print(f"| {s} | {b['stages'].get(s, 0):.0f} | {a['stages'].get(s, 0):.0f} |")
