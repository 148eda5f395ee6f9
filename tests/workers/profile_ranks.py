"""torchrun worker: every rank profiles a few matmuls into the same directory (argv[1])."""

from __future__ import annotations

import sys

import torch

import kwplug
from kwplug import ProfileKwargs


def main() -> None:
    out_dir = sys.argv[1]
    accelerator = kwplug.Accelerator(cpu=True)
    assert accelerator.num_processes == 2, accelerator
    handler = ProfileKwargs(output_trace_dir=out_dir, record_shapes=True)
    with accelerator.profile(handler) as prof:
        a = torch.randn(16, 16)
        for _ in range(3):
            a = a @ a / 16
    keys = {event.key for event in prof.key_averages()}
    assert "aten::mm" in keys, sorted(keys)
    # build() without a rank takes it from the initialised process group.
    with ProfileKwargs(output_trace_dir=f"{out_dir}/auto").build():
        torch.ones(4).sum()
    # Both ranks must have written before the test looks at the directory.
    accelerator.wait_for_everyone()
    print(f"rank {accelerator.process_index} done", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
