"""Every launch ``test_mlp_block_gpu.py`` makes, in a process of its own, so that a block that
hangs (a wait no signal meets) fails that module's tests instead of stalling the GPU tier: the
module's first fixture runs this under a timeout and kills it past that. Prints ``ok``."""

from __future__ import annotations

import os
import sys

import torch

from stepgraph.kernels import mlp_block as mb
from stepgraph.kernels.mlp_block_plan import NextQkv

H, INTER = 2048, 8192


def main() -> None:
    g = torch.Generator("cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).bfloat16()

    w = [rnd(H, H), 1 + rnd(H), rnd(2 * INTER, H), 1e-5, rnd(H, INTER)]
    for schedule in ("queue", "stride"):
        os.environ[mb.SCHEDULE_ENV] = schedule
        for m in (2, 8, 16, 17, 32, 64):
            x = rnd(m, H)
            mb.mlp_block(x, x, *w, 1 + rnd(H))
            torch.cuda.synchronize()
            print(schedule, m, flush=True)
        for m in (8, 13, 16):  # with the next layer's qkv (as the test module builds it)
            x = rnd(m, H)
            caches = [torch.randn(12, 64, 8, 64, generator=g, device="cuda").bfloat16()
                      for _ in range(2)]  # fmt: skip
            trig = torch.rand(640, 64, generator=g, device="cuda").bfloat16()
            nq = NextQkv(rnd(3072, H), None, 1e-5, torch.arange(m, device="cuda"), trig, trig,
                         *caches, torch.arange(m, device="cuda"), 32)  # fmt: skip
            mb.mlp_block(x, x, *w, 1 + rnd(H), qkv=nq)
            torch.cuda.synchronize()
            print(schedule, "qkv", m, flush=True)
    os.environ[mb.SCHEDULE_ENV] = "queue"
    for programs in (1, 7, 528):
        x = rnd(8, H)
        mb.mlp_block(x, x, *w, programs=programs)
        torch.cuda.synchronize()
        print("programs", programs, flush=True)
    print("ok")


if __name__ == "__main__":
    main()
    sys.exit(0)
