"""Session probe (issue 53): where the cast kernel's bytes differ from the torch path's on e4m3 ties (the GPU test
test_fa3_fp8_cast_kernels_divide_exactly_on_ties_and_signed_zeros): the kernel now, the kernel with div.rn, and
torch's own fp32 -> e4m3 conversion of the exact quotients against the kernel's (cvt.rn.satfinite)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import fa3_fp8  # noqa: E402
import probe_casts  # noqa: E402

DEV = "cuda"
e4m3 = torch.float8_e4m3fn
s, hx, hkv = 4096, 8, 4
gen = torch.Generator(device=DEV).manual_seed(3)
grid = torch.arange(256, device=DEV, dtype=torch.uint8).view(e4m3).float()
grid = grid[grid.isfinite() & (grid.abs() <= 448)]
mids = (grid[None] + grid[:, None]).flatten() / 2
t = mids[torch.randint(0, mids.numel(), (s, hx, 128), device=DEV, generator=gen)]
t = t * 2.0 ** torch.randint(-12, 1, (s, hx, 1), device=DEV, generator=gen).float()
scale = torch.tensor([1.3, 0.7, 3.1e-20, 5.0e18], device=DEV).to(torch.bfloat16).float()
t[0, :, 0] = 448.0
t[1, :, :8], t[2, :, :8] = -0.0, 0.0
x = (t.view(s, hkv, -1) * scale[None, :, None]).view(s, hx, 128)
want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
quot = (x.view(s, hkv, -1) / scale[None, :, None]).view(s, hx, 128)
print("torch quotient == t exactly (fp32, signs too):", torch.equal(quot.view(torch.int32), t.view(torch.int32)))
hw = fa3_fp8._to_e4m3_triton(fa3_fp8._triton.kernels(torch.device(DEV)), t.contiguous(), hkv)   # t / 1: the conversion
wt = fa3_fp8._to_e4m3_torch(t.contiguous(), hkv)
bad_t = hw[0].view(torch.uint8) != wt[0].view(torch.uint8)
print("t itself (descale", hw[1].tolist(), "): kernel's cvt against torch's conversion, bytes differ", bad_t.sum().item())
for a, b, c in bad_t.nonzero()[:8].tolist():
    print(f"   t {t[a, b, c].item()!r} kernel {hw[0].view(torch.uint8)[a, b, c].item():#04x} torch "
          f"{wt[0].view(torch.uint8)[a, b, c].item():#04x}")
vs = probe_casts.variants()
for name in ("head", "div_rn", "mul"):
    got8, got_scale = probe_casts.cast(vs[name], x, None, hkv=hkv)
    g, w = got8.view(torch.uint8), want8.view(torch.uint8)
    bad = (g != w)
    print(f"{name}: scale equal {torch.equal(got_scale, want_scale)}; bytes differ {bad.sum().item()} of {bad.numel()}")
    for i in bad.nonzero()[:8].tolist():
        a, b, c = i
        print(f"   x {x[a, b, c].item()!r} quotient {quot[a, b, c].item()!r} got {g[a, b, c].item():#04x} "
              f"({got8[a, b, c].float().item()!r}) want {w[a, b, c].item():#04x} ({want8[a, b, c].float().item()!r})")
