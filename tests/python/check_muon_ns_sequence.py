"""shardopt's Newton-Schulz op sequence (src/engine/muon_update.cpp: newton_schulz, the same ATen ops
in Python) against torch.optim._muon._zeropower_via_newtonschulz, bitwise, on the pip platform's torch:
  python tests/python/check_muon_ns_sequence.py"""
import math, torch
import torch.optim._muon as m
def mine(u, a=3.4445, b=-4.775, c=2.0315, steps=5, eps=1e-7):
    x = u.to(torch.bfloat16, copy=True)
    tall = x.size(0) > x.size(1)
    if tall: x = x.T
    x.div_(torch.linalg.vector_norm(x, 2).clamp(min=eps))
    for _ in range(steps):
        g = torch.matmul(x, x.T)
        gu = torch.addmm(g, g, g, beta=b, alpha=c)
        x = torch.addmm(x, gu, x, beta=a)
    return x.T if tall else x
ok = True
for i, shape in enumerate([(5, 8), (8, 5), (6, 6), (1, 7), (16, 4), (64, 200), (300, 96)]):
    n = math.prod(shape); k = torch.arange(n, dtype=torch.float64)
    u = (torch.sin(0.37 * k + i) * (1 + 0.05 * k) + 0.3 * torch.cos(1.7 * k)).reshape(shape).float()
    same = torch.equal(mine(u), m._zeropower_via_newtonschulz(u, (3.4445, -4.775, 2.0315), 5, 1e-7))
    ok &= same
    print(shape, "bitwise" if same else "DIFFERENT")
print(torch.__version__, "all bitwise" if ok else "differences")
