"""Small shapes through every flce CUDA kernel, for compute-sanitizer (memcheck, racecheck).

Covers bf16/fp16/fp32 (exact and TF32), tails in N, V and D (D % 8 != 0: the padded-copy path), bias, softcap,
ignored rows, master weights, vocab-parallel partials + combine, the backward masks and the
single pass (training's path)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import flce  # noqa: E402


def case(n, v, d, dtype, wdtype=None, softcap=None):
    g = torch.Generator(device="cpu").manual_seed(n + v + d)
    x = torch.randn(n, d, generator=g).to("cuda", dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to("cuda", wdtype or dtype).requires_grad_()
    b = torch.randn(v, generator=g).to("cuda", wdtype or dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to("cuda")
    t[::5] = -100
    loss, lse = flce.linear_cross_entropy(x, w, t, bias=b, softcap=softcap, label_smoothing=0.1,
                                          return_lse=True)
    (loss + lse.sum() * 1e-3).backward()
    # The single pass (training's path: mean, no lse): its row kernels and dW pieces.
    for a in (x, w, b):
        a.grad = None
    flce.linear_cross_entropy(x, w, t, bias=b, softcap=softcap, label_smoothing=0.1).backward()
    p = torch.ops.flce.partial_stats(x.detach(), w.detach()[: v // 2], t, b.detach()[: v // 2],
                                     0, -100, 0.0)
    q = torch.ops.flce.partial_stats(x.detach(), w.detach()[v // 2:], t, b.detach()[v // 2:],
                                     v // 2, -100, 0.0)
    torch.ops.flce.combine(torch.stack([p, q]), t, v, -100, 0.0, 0.0)


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    case(3, 7, 8, dtype)
    case(130, 260, 40, dtype, softcap=20.0)
    case(129, 300, 13, dtype)
case(67, 200, 24, torch.bfloat16, wdtype=torch.float32)
case(67, 200, 24, torch.float16, wdtype=torch.float32)
torch.set_float32_matmul_precision("high")  # fp32 GEMMs on TF32 tensor cores
case(130, 260, 40, torch.float32)
case(129, 300, 13, torch.float32)
torch.set_float32_matmul_precision("highest")
torch.cuda.synchronize()
print("sanitize cases done")
