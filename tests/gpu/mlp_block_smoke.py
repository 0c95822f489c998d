"""Every launch ``test_mlp_block_gpu.py`` makes, in a process of its own, so that a block that
hangs (a wait no signal meets) fails that module's tests instead of stalling the GPU tier: the
module's first fixture runs this under a timeout and kills it past that. Prints ``ok``."""

from __future__ import annotations

import os
import sys

import torch

from stepgraph.kernels import mlp_block as mb

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
