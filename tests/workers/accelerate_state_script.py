"""A script written for Accelerate's ``accelerate.logging`` and ``accelerate.state``; the tests
run it as is under Accelerate and, with only its import lines renamed, under kwplug (2
torchrun processes) and compare what each rank printed (tests/training/test_state_logging.py)."""

import logging
import sys

from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
logger = get_logger(__name__)

state = PartialState(cpu=True)  # on a machine without GPUs Accelerate needs cpu=True
rank = state.process_index


def say(*args):
    # One write per line, so that the two ranks' lines never interleave.
    sys.stdout.write(" ".join(map(str, args)) + "\n")
    sys.stdout.flush()


logger.info("main only")
logger.info("every rank", main_process_only=False)
logger.warning("in order %d", rank, in_order=True)
logger.debug("not shown")
say(
    f"rank {rank}: num_processes={state.num_processes} local={state.local_process_index}",
    f"main={state.is_main_process} local_main={state.is_local_main_process}",
    f"last={state.is_last_process} distributed={state.use_distributed}",
    f"type={state.distributed_type} device={state.device.type}",
)
state.print(f"state.print from {rank}")
with state.main_process_first():
    say(f"rank {rank}: in main_process_first")
with state.local_main_process_first():
    say(f"rank {rank}: in local_main_process_first")
with state.split_between_processes([1, 2, 3], apply_padding=True) as part:
    say(f"rank {rank}: part {part}")


@state.on_main_process
def on_main():
    say(f"rank {rank}: on_main_process")


on_main()
state.wait_for_everyone()

accelerator = Accelerator(cpu=True, mixed_precision="bf16")
full = AcceleratorState()
say(
    f"rank {rank}: AcceleratorState num_processes={full.num_processes}",
    f"process_index={full.process_index} mixed_precision={full.mixed_precision}",
    f"type={full.distributed_type} main={full.is_main_process}",
)
logger.info("after the Accelerator", main_process_only=False)
accelerator.wait_for_everyone()
state.destroy_process_group()
