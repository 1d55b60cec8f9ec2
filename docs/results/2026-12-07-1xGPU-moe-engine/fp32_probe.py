"""Where the fp32 engine on a GPU departs from the CPU (test_a_mixture_of_experts_on_one_gpu_in_fp32 failed, 2026-12-07):
the experts' MLP (few rows and many), the attention backend chosen for fp32, a dense model's logits."""
import torch
from burstserve.engine.model.moe import ExpertWeights, experts_mlp
from burstserve.kernels.attention import select_backend, reference_attention

torch.manual_seed(0)
E, k, hid, inter = 16, 4, 1024, 256
w = ExpertWeights(router=torch.randn(E, hid) * 0.5, gate_up=torch.randn(E, 2 * inter, hid) * 0.03,
                  down=torch.randn(E, hid, inter) * 0.06, top_k=k, renormalize=True, weights_fp32=False)
wc = ExpertWeights(**{**vars(w), **{n: getattr(w, n).cuda() for n in ("router", "gate_up", "down")}})
for rows in (1, 3, 64, 65, 500):
    x = torch.randn(rows, hid)
    a, b = experts_mlp(x, w), experts_mlp(x.cuda(), wc).cpu()
    print(f"experts fp32 {rows} rows: max |cuda - cpu| {(a - b).abs().max():.2e} of {a.abs().max():.2e}")
for h, hkv, d in ((8, 2, 128),):
    be = select_backend(torch.device("cuda"), torch.float32, h, hkv, d)
    for n in (3, 1000):
        q, kk, v = (torch.randn(n, hh, d, device="cuda") for hh in (h, hkv, hkv))
        o, lse = be(q, kk, v, True, d ** -0.5)
        ro, rl = reference_attention(q.cpu(), kk.cpu(), v.cpu(), True, d ** -0.5)
        print(f"attention fp32 backend {be.name}, {n} tokens: max |out - ref| {(o.cpu() - ro).abs().max():.2e}, "
              f"lse {(lse.cpu() - rl).abs().max():.2e}")
print("tf32 matmul:", torch.backends.cuda.matmul.allow_tf32, "cudnn tf32:", torch.backends.cudnn.allow_tf32)
