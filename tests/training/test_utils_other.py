"""``kwplug.utils``' remaining Accelerate helpers: ``wait_for_everyone``,
``extract_model_from_parallel``, ``tqdm`` and the ``is_*_available`` checks of
``kwplug.utils.availability`` (compared with Accelerate's answers on this machine)."""

from __future__ import annotations

import pytest
import torch

import kwplug
import kwplug.utils as ku

AVAILABILITY = [
    "is_aim_available",
    "is_amdsmi_available",
    "is_habana_gaudi1",
    "is_import_timer_available",
    "is_lomo_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_rocm_available",
    "is_triton_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_sagemaker_available",
]


@pytest.mark.parametrize("name", AVAILABILITY)
def test_availability_answers_as_accelerate(name: str) -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    if not hasattr(accelerate_utils, name):  # dropped in Accelerate 1.16; kwplug keeps it
        pytest.skip(f"this Accelerate has no {name}")
    assert getattr(ku, name)() is bool(getattr(accelerate_utils, name)())


def test_extract_model_from_parallel_is_unwrap_model() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    module = torch.nn.Linear(2, 2)
    own_forward = module.forward
    prepared = accelerator.prepare(module)
    kept = ku.extract_model_from_parallel(prepared)
    assert kept is module and kept(torch.ones(1, 2)).dtype == torch.float32  # fp32 outputs
    assert kept is accelerator.unwrap_model(prepared)
    bare = ku.extract_model_from_parallel(prepared, keep_fp32_wrapper=False)
    assert bare.forward == own_forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bare(torch.ones(1, 2)).dtype == torch.bfloat16  # the patch is gone
    assert not ku.is_peft_model(prepared)
    with pytest.raises(ValueError, match="recursive=True"):
        ku.extract_model_from_parallel(prepared, recursive=True)
    with pytest.raises(TypeError, match="keep_fp32_wrapper must be a bool"):
        ku.extract_model_from_parallel(prepared, keep_fp32_wrapper=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        ku.extract_model_from_parallel("model")  # type: ignore[arg-type]
    ku.wait_for_everyone()  # one process: nothing to wait for


def test_tqdm_shows_on_local_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    assert not ku.tqdm(range(3)).disable
    assert ku.tqdm(range(3), disable=True).disable
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ku.tqdm(range(3)).disable
    assert not ku.tqdm(range(3), main_process_only=False).disable
    with pytest.raises(ValueError, match="main_process_only="):
        ku.tqdm(True, range(3))
