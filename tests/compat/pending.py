# ruff: noqa: E501  (one entry a line, so that pruning is deleting lines)
"""EXPECTED FAILURES, pending work: the one list for the lead to prune after each merge.

Checks of Accelerate's shipped test scripts that pass under Accelerate and do not pass on
kwplug today because the feature they need is being built (issue 17, items 1-3). Keys are
``<script>::<check>`` as tests/compat prints them. Today every script stops at a kwplug
module or name it imports (the comment above each group); the value is "import" and, after
"then", what the check meets next with the names supplied (``python
tests/compat/compat_harness.py --lenient``, the diagnostic rename; "import" alone: the check
passes once the import works).
A listed check that passes on kwplug fails the test ("prune it"), so the list cannot go stale.
Permanent, deliberate differences do not belong here: they are rows of the "Accelerate's
shipped test scripts" table in docs/migrating-from-accelerate.md, with their reason.
"""

from __future__ import annotations

PENDING: dict[str, str] = {
    # --- test_ops.py: import: `from kwplug import PartialState` (kwplug.PartialState, issue 17 item 2; kwplug.utils.operations also lacks copy_tensor_to_devices)
    "test_ops.py::test_gather": "import; then PartialState() itself",
    "test_ops.py::test_gather_object": "import; then PartialState() itself",
    "test_ops.py::test_gather_non_contiguous": "import; then PartialState() itself",
    "test_ops.py::test_broadcast": "import; then PartialState() itself",
    "test_ops.py::test_pad_across_processes": "import; then PartialState() itself",
    "test_ops.py::test_reduce_sum": "import; then PartialState() itself",
    "test_ops.py::test_reduce_mean": "import; then PartialState() itself",
    "test_ops.py::test_reduce_max": "import; then PartialState() itself",
    "test_ops.py::test_op_checker": "import; then PartialState() itself",
    "test_ops.py::test_copy_tensor_to_devices": "import; then PartialState() itself",
    "test_ops.py::<main>": "import; then PartialState() itself",
    # --- test_sync.py: import: `from kwplug.accelerator import DataLoaderConfiguration, GradientAccumulationPlugin` and `from kwplug.state import GradientState` (kwplug.state, issue 17 item 2)
    "test_sync.py::test_dataloader_break": "import; then gradient_state.active_dataloader",
    "test_sync.py::test_distributed_sync": "import",
    "test_sync.py::test_distributed_sync_multiple_fwd": "import",
    "test_sync.py::test_gradient_accumulation_with_opt_and_scheduler": "import; then kwplug.state.GradientState",
    "test_sync.py::<main>": "import; then AcceleratorState.destroy_process_group",
    # --- test_script.py: import: `kwplug.data_loader` and `kwplug.state` modules (issue 17 item 2; kwplug.utils also lacks synchronize_rng_states)
    "test_script.py::init_state_check": "import; then kwplug.state.AcceleratorState",
    "test_script.py::process_execution_check": "import",
    "test_script.py::test_split_between_processes_list": "import; then AcceleratorState",
    "test_script.py::test_split_between_processes_nested_dict": "import; then AcceleratorState",
    "test_script.py::test_split_between_processes_tensor": "import; then AcceleratorState",
    "test_script.py::test_split_between_processes_evenly": "import; then AcceleratorState",
    "test_script.py::rng_sync_check": "import; then AcceleratorState, synchronize_rng_states",
    "test_script.py::dl_preparation_check": "import; then AcceleratorState, prepare_data_loader",
    "test_script.py::central_dl_preparation_check": "import; then AcceleratorState, prepare_data_loader(dispatch_batches=True)",
    "test_script.py::custom_sampler_check": "import; then AcceleratorState, set_epoch reaching a custom batch sampler",
    "test_script.py::check_seedable_sampler": "import; then: 'Did not obtain the same items with the same seed and epoch' (use_seedable_sampler + set_seed + set_epoch(0) replay)",
    "test_script.py::check_seedable_sampler_with_data_seed": "import",
    "test_script.py::check_seedable_sampler_in_batch_sampler_shard": "import; then kwplug.data_loader.prepare_data_loader",
    "test_script.py::training_check(use_seedable_sampler=False)": "import; then AcceleratorState, dispatch_batches",
    "test_script.py::training_check(use_seedable_sampler=True)": "import; then AcceleratorState, dispatch_batches",
    "test_script.py::test_trigger": "import",
    "test_script.py::test_reinstantiated_state": "import; then kwplug.utils.is_pytest_available, AcceleratorState",
    "test_script.py::<main>": "import; then accelerator.state.wait_for_everyone / destroy_process_group",
    # --- test_distributed_data_loop.py: imports; what each check meets (kwplug.accelerator serves DataLoaderConfiguration since this stop)
    "test_distributed_data_loop.py::test_join_raises_warning_for_non_ddp_distributed": "import; then accelerator.state.distributed_type cannot be assigned (kwplug's state is frozen), so join sees MULTI_CPU and warns nothing",
    "test_distributed_data_loop.py::test_pickle_accelerator": "import; then pickle.dumps(accelerator): TypeError: cannot pickle 'module' object",
    "test_distributed_data_loop.py::<main>": "import; then assigning accelerator.state.distributed_type (frozen state)",
    # --- test_metrics.py: import: `from kwplug.data_loader import DataLoaderDispatcher` (kwplug.data_loader, issue 17 item 2)
    "test_metrics.py::test_torch_metrics(99)": "import; then DataLoaderConfiguration(dispatch_batches=True) is a ValueError (it ends main's loop, so the 4 split/dispatch runs do not run)",
    "test_metrics.py::test_torch_metrics(99)#2": "import; then dispatch_batches=True (the loop ends at its first run)",
    "test_metrics.py::test_torch_metrics(99)#3": "import; then dispatch_batches=True (the loop ends at its first run)",
    "test_metrics.py::test_torch_metrics(99)#4": "import; then dispatch_batches=True (the loop ends at its first run)",
    "test_metrics.py::test_torch_metrics(512)": "import",
    "test_metrics.py::test_gather_for_metrics_drop_last": "import",
    "test_metrics.py::<main>": "import; then dispatch_batches=True and accelerator.state._reset_state()",
}
