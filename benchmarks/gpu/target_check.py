"""A bad target on the CUDA backend, step by step (for a debugger or a crash report): the first
call (the device raises its flag; the host does not wait), a sync, the next call (the
IndexError). Prints each stage with flush, so a crash shows where it happened. Exit status 1
when a checking mode (FLCE_CHECK_TARGETS=1, the default, or sync) let the bad target through
both calls; FLCE_CHECK_TARGETS=0 (off) only has to not crash.

    python benchmarks/gpu/target_check.py [none|mean]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import flce  # noqa: E402


def say(msg):
    print(msg, flush=True)


reduction = sys.argv[1] if len(sys.argv) > 1 else "none"
say(f"FLCE_CHECK_TARGETS={os.environ.get('FLCE_CHECK_TARGETS', '')!r} reduction={reduction}")
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 32, generator=g).to("cuda", torch.bfloat16).requires_grad_()
w = (torch.randn(100, 32, generator=g) / 32 ** 0.5).to("cuda", torch.bfloat16)
t = torch.randint(0, 100, (64,), generator=g).to("cuda")
flce.linear_cross_entropy(x, w, t, reduction=reduction)
torch.cuda.synchronize()
say("good targets: ok")
t[5] = 100
raised = False
for call in (1, 2):
    try:
        say(f"bad target, call {call}: start")
        flce.linear_cross_entropy(x, w, t, reduction=reduction)
        say(f"bad target, call {call}: returned")
    except IndexError as e:
        say(f"bad target, call {call}: IndexError: {e}")
        raised = True
        break
    torch.cuda.synchronize()
    say("synchronized")
checking = os.environ.get("FLCE_CHECK_TARGETS", "1") != "0"
say("done" if raised or not checking else "FAILED: no IndexError for the bad target")
sys.exit(1 if checking and not raised else 0)
