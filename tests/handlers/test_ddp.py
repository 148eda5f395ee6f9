"""DistributedDataParallelKwargs and kwplug's DDP communication hooks, in one process.

The 2-process behaviour (DDP options reaching the module, hooks training in sync) is in
tests/handlers/test_ddp_torchrun.py. Here: the handler's API and validation, the
world_size == 1 path, hook resolution errors, and the hooks' arithmetic on a 1-process gloo group.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

import kwplug
from kwplug import DDPCommunicationHookType, DistributedDataParallelKwargs
from kwplug.comm_hooks import CommHook
from kwplug.handler import TO_KWARGS
from kwplug.plugins import ddp_comm_hooks as hooks
from kwplug.plugins.ddp_comm_hooks._power_sgd import _orthonormalize_columns
from kwplug.testing import PluginSandbox

H = DDPCommunicationHookType
DDPK = DistributedDataParallelKwargs


def noop_hook(state: Any, bucket: dist.GradBucket) -> Any:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 1))


# -- public API ------------------------------------------------------------------------------


def test_enum_members() -> None:
    assert issubclass(H, str)
    assert [(m.name, m.value) for m in H] == [
        ("NO", "no"),
        ("FP16", "fp16"),
        ("BF16", "bf16"),
        ("POWER_SGD", "power_sgd"),
        ("BATCHED_POWER_SGD", "batched_power_sgd"),
        ("POWER_SGD_INPLACE", "power_sgd_inplace"),
    ]
    assert H.FP16 == "fp16"
    assert kwplug.DDPCommunicationHookType is H


def test_signature_and_defaults() -> None:
    params = inspect.signature(DDPK).parameters
    assert [(name, p.default) for name, p in params.items()] == [
        ("dim", 0),
        ("broadcast_buffers", True),
        ("bucket_cap_mb", 25),
        ("find_unused_parameters", False),
        ("check_reduction", False),
        ("gradient_as_bucket_view", False),
        ("static_graph", False),
        ("comm_hook", H.NO),
        ("comm_wrapper", H.NO),
        ("comm_state_option", params["comm_state_option"].default),
    ]
    fields = attrs.fields(DDPK)
    assert isinstance(fields.comm_state_option.default, attrs.Factory)  # type: ignore[arg-type]
    handler = DDPK()
    assert handler.comm_state_option == {}
    assert handler.comm_state_option is not DDPK().comm_state_option  # not shared
    assert handler.comm_hook is H.NO and handler.comm_wrapper is H.NO
    assert issubclass(DDPK, kwplug.KwargsHandler)
    assert [f.name for f in fields if not f.metadata.get(TO_KWARGS, True)] == [
        "comm_hook",
        "comm_wrapper",
        "comm_state_option",
    ]


def test_to_kwargs_is_the_ddp_constructor_diff() -> None:
    assert DDPK().to_kwargs() == {}
    handler = DDPK(
        dim=1,
        broadcast_buffers=False,
        bucket_cap_mb=50,
        find_unused_parameters=True,
        check_reduction=True,
        gradient_as_bucket_view=True,
        static_graph=True,
        comm_hook="power_sgd",
        comm_wrapper="fp16",
        comm_state_option={"matrix_approximation_rank": 2},
    )
    kwargs = handler.to_kwargs()
    assert kwargs == {
        "dim": 1,
        "broadcast_buffers": False,
        "bucket_cap_mb": 50,
        "find_unused_parameters": True,
        "check_reduction": True,
        "gradient_as_bucket_view": True,
        "static_graph": True,
    }
    ddp_params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    assert set(kwargs) <= set(ddp_params)
    assert DDPK(bucket_cap_mb=25.0, comm_hook=noop_hook).to_kwargs() == {}


def test_to_dict_has_every_field() -> None:
    assert list(DDPK().to_dict()) == [f.name for f in attrs.fields(DDPK)]


# -- validation ------------------------------------------------------------------------------

BAD_VALUES: list[tuple[str, Any, type[Exception], str]] = [
    ("dim", True, TypeError, "an int"),
    ("dim", 1.0, TypeError, "an int"),
    ("dim", "0", TypeError, "an int"),
    ("dim", None, TypeError, "an int"),
    ("broadcast_buffers", 1, TypeError, "True or False"),
    ("broadcast_buffers", "yes", TypeError, "True or False"),
    ("broadcast_buffers", None, TypeError, "True or False"),
    ("bucket_cap_mb", True, TypeError, "a number"),
    ("bucket_cap_mb", "25", TypeError, "a number"),
    ("bucket_cap_mb", None, TypeError, "a number"),
    ("bucket_cap_mb", 0, ValueError, "> 0"),
    ("bucket_cap_mb", -1.5, ValueError, "> 0"),
    ("bucket_cap_mb", math.nan, ValueError, "finite"),
    ("bucket_cap_mb", math.inf, ValueError, "finite"),
    ("find_unused_parameters", 0, TypeError, "True or False"),
    ("check_reduction", "False", TypeError, "True or False"),
    ("gradient_as_bucket_view", 1, TypeError, "True or False"),
    ("static_graph", None, TypeError, "True or False"),
    ("comm_hook", 3, TypeError, "'power_sgd'"),
    ("comm_hook", 2.5, TypeError, "callable"),  # None is NO, as in Accelerate
    ("comm_hook", H, TypeError, "registered"),  # a class is not a hook
    ("comm_hook", "", ValueError, "'batched_power_sgd'"),
    ("comm_hook", "   ", ValueError, "must not be empty"),
    ("comm_wrapper", "power_sgd", ValueError, "'no', 'fp16', 'bf16'"),
    ("comm_wrapper", H.BATCHED_POWER_SGD, ValueError, "'no', 'fp16', 'bf16'"),
    ("comm_wrapper", "fp32", ValueError, "'no', 'fp16', 'bf16'"),
    ("comm_wrapper", 16, TypeError, "'no', 'fp16', 'bf16'"),
    ("comm_wrapper", noop_hook, TypeError, "'no', 'fp16', 'bf16'"),
    ("comm_wrapper", b"fp16", TypeError, "'no', 'fp16', 'bf16'"),  # None is NO
    ("comm_state_option", "a=1", TypeError, "dict"),  # None is {}
    ("comm_state_option", [("a", 1)], TypeError, "dict"),
    ("comm_state_option", {1: 2}, TypeError, "keys must be str"),
]


@pytest.mark.parametrize(("field", "value", "error", "message"), BAD_VALUES)
def test_bad_value_at_construction(field: str, value: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=f"'{field}'") as info:
        DDPK(**{field: value})
    assert message in str(info.value)


@pytest.mark.parametrize(("field", "value", "error", "message"), BAD_VALUES)
def test_bad_value_on_assignment(field: str, value: Any, error: type, message: str) -> None:
    handler = DDPK()
    before = getattr(handler, field)
    with pytest.raises(error, match=f"'{field}'") as info:
        setattr(handler, field, value)
    assert message in str(info.value)
    assert getattr(handler, field) == before  # unchanged


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dim", -1),
        ("dim", 2),
        ("broadcast_buffers", False),
        ("bucket_cap_mb", 1),
        ("bucket_cap_mb", 0.25),
        ("find_unused_parameters", True),
        ("check_reduction", True),
        ("gradient_as_bucket_view", True),
        ("static_graph", True),
        ("comm_state_option", {}),
    ],
)
def test_good_values(field: str, value: Any) -> None:
    assert getattr(DDPK(**{field: value}), field) == value
    handler = DDPK()
    setattr(handler, field, value)
    assert getattr(handler, field) == value


@pytest.mark.parametrize("member", list(H))
def test_comm_hook_string_converted_to_enum(member: DDPCommunicationHookType) -> None:
    handler = DDPK(comm_hook=member.value)
    assert handler.comm_hook is member
    handler = DDPK()
    handler.comm_hook = member.value
    assert handler.comm_hook is member
    assert DDPK(comm_hook=member).comm_hook is member


@pytest.mark.parametrize("member", [H.NO, H.FP16, H.BF16])
def test_comm_wrapper_string_converted_to_enum(member: DDPCommunicationHookType) -> None:
    assert DDPK(comm_wrapper=member.value).comm_wrapper is member
    handler = DDPK()
    handler.comm_wrapper = member.value
    assert handler.comm_wrapper is member


def test_comm_hook_custom_names_and_callables_kept() -> None:
    assert DDPK(comm_hook="my_hook").comm_hook == "my_hook"
    assert DDPK(comm_hook="FP16").comm_hook == "FP16"  # values are exact: a custom name
    assert not isinstance(DDPK(comm_hook="FP16").comm_hook, H)
    assert DDPK(comm_hook=noop_hook).comm_hook is noop_hook
    partial = functools.partial(noop_hook)
    handler = DDPK()
    handler.comm_hook = partial
    assert handler.comm_hook is partial


def test_a_hook_that_cannot_take_state_and_bucket_is_refused_at_construction() -> None:
    # DDP would call it only at the first backward, deep in the reducer.
    for bad, shown in ((lambda: None, "()"), (lambda bucket: None, "(bucket)")):
        with pytest.raises(TypeError, match=r"'comm_hook' must accept two positional") as info:
            DDPK(comm_hook=bad)
        assert shown in str(info.value)
        handler = DDPK()
        with pytest.raises(TypeError, match="'comm_hook'"):
            handler.comm_hook = bad
        assert handler.comm_hook == H.NO
        with pytest.raises(TypeError, match="'hook' must accept two positional"):
            kwplug.register_comm_hook("kwplug-test-arity", bad)
    with pytest.raises(TypeError, match=r"\(state, bucket, extra\)"):
        DDPK(comm_hook=lambda state, bucket, extra: None)
    # Everything torch itself could call as hook(state, bucket) is accepted.
    for good in (
        default_hooks.allreduce_hook,
        lambda *args: None,
        lambda state, bucket, extra=1: None,
        functools.partial(lambda tag, state, bucket: None, "tag"),
    ):
        assert DDPK(comm_hook=good).comm_hook is good


def test_power_sgd_options_checked_at_construction() -> None:
    DDPK(comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 4})
    for name in ("power_sgd", H.BATCHED_POWER_SGD):
        with pytest.raises(ValueError, match="'rank'") as info:
            DDPK(comm_hook=name, comm_state_option={"rank": 4})
        assert "matrix_approximation_rank" in str(info.value)
        assert "start_powerSGD_iter" in str(info.value)


@pytest.mark.parametrize("hook", ["no", "fp16", "bf16", noop_hook])
def test_options_without_state_rejected_at_construction(hook: Any) -> None:
    with pytest.raises(ValueError, match="comm_state_option"):
        DDPK(comm_hook=hook, comm_state_option={"x": 1})


def test_options_for_custom_name_accepted_until_wrap() -> None:
    handler = DDPK(comm_hook="anything", comm_state_option={"x": 1})
    assert handler.comm_state_option == {"x": 1}


# -- wrap_model ------------------------------------------------------------------------------


def test_wrap_model_single_process_returns_none() -> None:
    model = small_model()
    handler = DDPK(comm_hook="power_sgd", bucket_cap_mb=1)
    got = handler.wrap_model(
        model=model, device=torch.device("cpu"), world_size=1, comm_hooks=hooks.comm_hooks()
    )
    assert got is None


def test_accelerator_single_process_returns_plain_module() -> None:
    model = small_model()
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[DDPK(comm_hook="bf16")])
    assert accelerator.num_processes == 1
    assert accelerator.prepare(model) is model
    assert kwplug.Accelerator(cpu=True).prepare(model) is model


def test_comm_hooks_contributed_once_by_the_plugin_module(kwplug_plugins: PluginSandbox) -> None:
    # The handler is both a default instance and (here) the user's: the hooks must still be
    # contributed once, by the ddp_comm_hooks module (entry point "ddp_comm_hooks").
    for handlers in ([], [DDPK()], [DDPK(comm_hook="fp16")]):
        accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=handlers)
        assert {name: rec.source for name, rec in accelerator.comm_hooks.items()} == {
            "fp16": "kwplug",
            "bf16": "kwplug",
            "power_sgd": "kwplug",
            "batched_power_sgd": "kwplug",
            "power_sgd_inplace": "kwplug",
        }
    assert not hasattr(DDPK, "comm_hooks")
    names = [r.name for r in kwplug.discover() if r.loaded]
    assert "ddp_comm_hooks" in names


def test_builtin_hook_names_match_the_enum() -> None:
    records = hooks.comm_hooks()
    assert tuple(records) == hooks.BUILTIN_HOOK_NAMES
    assert set(records) == {m.value for m in H} - {"no"}
    for name, record in records.items():
        assert isinstance(record, CommHook)
        assert record.name == name and record.source == "kwplug"
    assert records["power_sgd"].hook is torch_psgd.powerSGD_hook
    assert records["batched_power_sgd"].hook is hooks.batched_power_sgd_hook


def _wrap(handler: DDPK, comm_hooks: dict[str, CommHook] | None = None) -> Any:
    # world_size=2 takes the distributed path; hook resolution happens before DDP is built,
    # so these errors need no process group.
    return handler.wrap_model(
        model=small_model(),
        device=torch.device("cpu"),
        world_size=2,
        comm_hooks=hooks.comm_hooks() if comm_hooks is None else comm_hooks,
    )


def test_unknown_hook_name_lists_known_names() -> None:
    custom = CommHook("mine", noop_hook, source="test")
    with pytest.raises(ValueError, match="unknown communication hook 'nope'") as info:
        _wrap(DDPK(comm_hook="nope"), {**hooks.comm_hooks(), "mine": custom})
    for name in ("'mine'", "'fp16'", "'bf16'", "'power_sgd'", "'batched_power_sgd'"):
        assert name in str(info.value)
    assert "register_comm_hook" in str(info.value)


def test_callable_with_options_rejected_at_wrap() -> None:
    handler = DDPK(comm_hook=noop_hook)
    handler.comm_state_option = {"x": 1}  # the cross-field check waits for wrap time
    with pytest.raises(ValueError, match="takes no state options"):
        _wrap(handler)


def test_bad_power_sgd_option_rejected_at_wrap() -> None:
    handler = DDPK()
    handler.comm_state_option = {"matrix_rank": 1}  # assignment skips the cross-field check
    with pytest.raises(ValueError, match="comm_state_option"):
        _wrap(handler)
    handler.comm_hook = "batched_power_sgd"
    with pytest.raises(ValueError, match="'matrix_rank'") as info:
        _wrap(handler)
    assert "matrix_approximation_rank" in str(info.value)


def test_start_power_sgd_iter_must_exceed_one() -> None:
    # Refused at construction now (tests/test_compat_points.py), not inside prepare().
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        DDPK(comm_hook="power_sgd", comm_state_option={"start_powerSGD_iter": 1})


def test_registered_hook_options_reach_make_state() -> None:
    seen: list[Any] = []

    def make_state(process_group: Any, options: Any) -> str:
        seen.append((process_group, dict(options)))
        raise RuntimeError("stop before DDP")

    record = CommHook("stateful", noop_hook, make_state, source="test")
    with pytest.raises(RuntimeError, match="stop before DDP"):
        _wrap(DDPK(comm_hook="stateful", comm_state_option={"k": 1}), {"stateful": record})
    assert seen == [(None, {"k": 1})]


def test_registered_hook_without_state_rejects_options() -> None:
    record = CommHook("stateless", noop_hook, source="test")
    with pytest.raises(ValueError, match="takes no state options"):
        _wrap(DDPK(comm_hook="stateless", comm_state_option={"k": 1}), {"stateless": record})


# -- the hooks, on a 1-process gloo group ----------------------------------------------------


class FakeBucket:
    """Duck-typed ``torch.distributed.GradBucket`` (which Python cannot construct)."""

    def __init__(self, tensor: torch.Tensor, index: int = 0) -> None:
        self._buffer = tensor
        self._index = index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


def _run(hook: Any, state: Any, tensor: torch.Tensor) -> torch.Tensor:
    return hook(state, FakeBucket(tensor)).wait()  # type: ignore[no-any-return]


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    ("hook", "dtype"),
    [
        (hooks.fp16_compress_allreduce_hook, torch.float16),
        (hooks.bf16_compress_allreduce_hook, torch.bfloat16),
    ],
)
def test_low_precision_hooks_round_in_place(hook: Any, dtype: torch.dtype) -> None:
    grads = torch.randn(1000, dtype=torch.float32)
    buffer = grads.clone()
    out = _run(hook, None, buffer)
    assert out is buffer and out.dtype == torch.float32
    assert torch.equal(out, grads.to(dtype).float())


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    ("wrapper", "dtype"),
    [(hooks.fp16_compress_wrapper, torch.float16), (hooks.bf16_compress_wrapper, torch.bfloat16)],
)
def test_wrappers_run_inner_hook_in_low_precision(wrapper: Any, dtype: torch.dtype) -> None:
    seen: list[torch.dtype] = []

    def inner(state: Any, bucket: Any) -> Any:
        seen.append(bucket.buffer().dtype)
        assert state == "the state"
        return hooks.mean_allreduce_hook(None, bucket)

    grads = torch.randn(300)
    buffer = grads.clone()
    wrapped = wrapper(inner)
    assert wrapped.__name__ != "bf16_compress_wrapper_hook"  # DDP's CPU check is by name
    out = _run(wrapped, "the state", buffer)
    assert seen == [dtype]
    assert out is buffer and out.dtype == torch.float32
    assert torch.equal(out, grads.to(dtype).float())
    with pytest.raises(TypeError, match="callable"):
        wrapper("not a hook")


def test_torch_bf16_hooks_are_refused_by_ddp_on_cpu_but_kwplug_hooks_are_not(
    one_process_group: None,
) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(small_model())
    with pytest.raises(TypeError, match="BF16"):
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    # kwplug's own bf16 hook and wrapper are accepted (one hook per DDP module).
    ddp.register_comm_hook(None, hooks.bf16_compress_allreduce_hook)
    ddp2 = torch.nn.parallel.DistributedDataParallel(small_model())
    ddp2.register_comm_hook(None, hooks.bf16_compress_wrapper(hooks.mean_allreduce_hook))
    # ... and train.
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    for module in (ddp, ddp2):
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        for p in module.parameters():
            assert p.grad is not None
            assert torch.equal(p.grad, p.grad.to(torch.bfloat16).float())


def test_wrap_model_registers_hook_on_ddp(one_process_group: None) -> None:
    # world_size=2 forces the distributed path; DDP itself runs on the 1-process group.
    handler = DDPK(comm_hook="bf16", bucket_cap_mb=2, gradient_as_bucket_view=True)
    ddp = _wrap(handler)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    assert ddp.bucket_bytes_cap == 2 * 1024 * 1024
    assert ddp.gradient_as_bucket_view is True
    assert ddp.device_ids is None
    assert ddp._get_ddp_logging_data()["comm_hook"] == "bf16_compress_allreduce_hook"
    # Resolution falls back to the built-ins when the mapping lacks them.
    ddp = _wrap(DDPK(comm_hook=H.POWER_SGD), comm_hooks={})
    assert ddp._get_ddp_logging_data()["comm_hook"] == "powerSGD_hook"
    assert _wrap(DDPK())._get_ddp_logging_data().get("comm_hook", "") == ""


@pytest.mark.usefixtures("one_process_group")
def test_batched_power_sgd_before_start_is_plain_allreduce() -> None:
    state = hooks.make_power_sgd_state(None, {"start_powerSGD_iter": 3})
    grads = torch.randn(50)
    for step in range(3):
        out = _run(hooks.batched_power_sgd_hook, state, grads.clone())
        assert torch.equal(out, grads)
        assert state.iter == step + 1
    assert state.total_numel_after_compression == 0


@pytest.mark.usefixtures("one_process_group")
def test_batched_power_sgd_exact_on_low_rank_bucket() -> None:
    state = hooks.make_power_sgd_state(
        None, {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}
    )
    u, v = torch.randn(20, 2), torch.randn(20, 2)
    grads = (u @ v.T).reshape(-1)  # a 20x20 matrix of rank 2
    state.iter = 2
    out = _run(hooks.batched_power_sgd_hook, state, grads.clone())
    torch.testing.assert_close(out, grads, rtol=1e-4, atol=1e-4)
    assert state.total_numel_before_compression == 400
    assert state.total_numel_after_compression == 2 * 20 * 2
    assert state.iter == 3
    assert state.error_dict[0].abs().max() < 1e-4


def _orthogonalize_3d(matrices: torch.Tensor, epsilon: float = 0) -> None:
    # What torch's batched hook needs: its _orthogonalize on a 3-D view of a 2-D matrix.
    original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)


original = torch_psgd._orthogonalize


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("warm_start", [True, False])
@pytest.mark.parametrize("rank", [1, 3])
def test_batched_power_sgd_matches_the_reference_algorithm(
    monkeypatch: pytest.MonkeyPatch, warm_start: bool, rank: int
) -> None:
    options = {
        "start_powerSGD_iter": 2,
        "matrix_approximation_rank": rank,
        "warm_start": warm_start,
        "random_seed": 5,
    }
    ours = hooks.make_power_sgd_state(None, options)
    reference = hooks.make_power_sgd_state(None, options)
    monkeypatch.setattr(torch_psgd, "_orthogonalize", _orthogonalize_3d)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        grads = torch.randn(150, generator=generator)  # 150 -> padded 13x13
        got = _run(hooks.batched_power_sgd_hook, ours, grads.clone())
        expected = _run(torch_psgd.batched_powerSGD_hook, reference, grads.clone())
        assert got.shape == grads.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert ours.iter == reference.iter == 6
    assert ours.total_numel_after_compression == reference.total_numel_after_compression
    torch.testing.assert_close(ours.error_dict[0], reference.error_dict[0][: 13 * 13])


@pytest.mark.usefixtures("one_process_group")
def test_torch_batched_power_sgd_fails_where_kwplug_works() -> None:
    options = {"start_powerSGD_iter": 2}
    state = hooks.make_power_sgd_state(None, options)
    state.iter = 2
    try:
        _run(torch_psgd.batched_powerSGD_hook, state, torch.randn(64))
    except AssertionError:
        pass
    else:  # pragma: no cover - depends on the torch release
        pytest.skip("this torch's batched_powerSGD_hook works; kwplug's is still tested")
    state = hooks.make_power_sgd_state(None, options)
    state.iter = 2
    out = _run(hooks.batched_power_sgd_hook, state, torch.randn(64))
    assert torch.isfinite(out).all()


@pytest.mark.usefixtures("one_process_group")
def test_batched_power_sgd_zero_gradient_stays_finite() -> None:
    state = hooks.make_power_sgd_state(None, {"start_powerSGD_iter": 2})
    state.iter = 2
    out = _run(hooks.batched_power_sgd_hook, state, torch.zeros(30))
    assert torch.equal(out, torch.zeros(30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_orthonormalize_columns(dtype: torch.dtype) -> None:
    batch = torch.randn(2, 10, 3).to(dtype)
    _orthonormalize_columns(batch)
    gram = batch.float().transpose(1, 2) @ batch.float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(gram, torch.eye(3).expand(2, 3, 3), atol=tol, rtol=0)
    zero = torch.zeros(1, 4, 2)
    _orthonormalize_columns(zero)
    assert torch.equal(zero, torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="rows, cols"):
        _orthonormalize_columns(torch.randn(4, 2))
    with pytest.raises(ValueError, match="cols <= rows"):
        _orthonormalize_columns(torch.randn(1, 2, 4))


def test_make_power_sgd_state() -> None:
    state = hooks.make_power_sgd_state(None, {})
    assert isinstance(state, torch_psgd.PowerSGDState)
    assert state.process_group is None
    assert state.matrix_approximation_rank == 1
    assert state.start_powerSGD_iter == 1000
    state = hooks.make_power_sgd_state(None, {"matrix_approximation_rank": 4, "warm_start": False})
    assert state.matrix_approximation_rank == 4 and state.warm_start is False
    with pytest.raises(ValueError, match="'bogus'") as info:
        hooks.make_power_sgd_state(None, {"bogus": 1})
    for name in inspect.signature(torch_psgd.PowerSGDState).parameters:
        if name != "process_group":
            assert name in str(info.value)
    assert "process_group" not in hooks.POWER_SGD_OPTIONS


# -- making hooks acceptable to DDP ----------------------------------------------------------


def typed_hook(state: Any, bucket: dist.GradBucket) -> Any:
    return noop_hook(state, bucket)


# Objects, not strings, as DDP's check wants (this module's annotations are strings).
typed_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


class CallableHook:
    def __call__(self, state: Any, bucket: Any) -> Any:
        return noop_hook(state, bucket)


def other_names(st: Any, grad_bucket: Any) -> Any:
    return noop_hook(st, grad_bucket)


def test_ddp_compatible_hook() -> None:
    assert hooks.ddp_compatible_hook(typed_hook) is typed_hook
    assert hooks.ddp_compatible_hook(hooks.batched_power_sgd_hook) is hooks.batched_power_sgd_hook
    # noop_hook's annotations are strings in this module (from __future__ import annotations).
    adapted = [
        hooks.ddp_compatible_hook(hook)
        for hook in (noop_hook, CallableHook(), functools.partial(noop_hook), other_names)
    ]
    for adapter in adapted:
        assert adapter.__name__ == "kwplug_comm_hook"
        assert list(inspect.signature(adapter).parameters) == ["state", "bucket"]
        tensor = torch.ones(3)
        assert adapter(None, FakeBucket(tensor)).wait() is tensor
    assert [a.__qualname__ for a in adapted] == [
        "kwplug_comm_hook[noop_hook]",
        "kwplug_comm_hook[CallableHook]",
        "kwplug_comm_hook[partial(noop_hook)]",
        "kwplug_comm_hook[other_names]",
    ]
    with pytest.raises(TypeError, match="callable"):
        hooks.ddp_compatible_hook(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"matrix_approximation_rank": 0},
            ValueError,
            r"'matrix_approximation_rank'\] must be >= 1",
        ),
        (
            {"matrix_approximation_rank": "2"},
            TypeError,
            r"'matrix_approximation_rank'\] must be an int",
        ),
        ({"start_powerSGD_iter": 2.5}, TypeError, "must be an int"),
        ({"warm_start": 1}, TypeError, "must be True or False"),
        ({"min_compression_rate": float("nan")}, ValueError, "must be >= 0"),
    ],
)
def test_power_sgd_option_values_are_checked_at_construction(
    options: dict[str, Any], error: type, message: str
) -> None:
    # A rank of 0 would silently zero every gradient; a str would fail deep in torch later.
    with pytest.raises(error, match=message):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option=options)


def test_misspelt_hook_name_fails_in_a_single_process_too() -> None:
    # At Accelerator() (validate_setup), before any model or data exists.
    with pytest.raises(ValueError, match="unknown communication hook 'bf17'.*'no'"):
        kwplug.Accelerator(
            cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="bf17")]
        )
    # A name changed after construction is caught in prepare().
    handler = DistributedDataParallelKwargs()
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    handler.comm_hook = "bf17"
    with pytest.raises(ValueError, match="unknown communication hook 'bf17'"):
        accelerator.prepare(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("typo", "meant"), [("bf17", "bf16"), ("PowerSGD", "power_sgd"), ("BF16", "bf16")]
)
def test_misspelt_hook_name_gets_a_suggestion(typo: str, meant: str) -> None:
    handler = DistributedDataParallelKwargs(comm_hook=typo)
    with pytest.raises(ValueError, match=f"did you mean '{meant}'\\?"):
        kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])


def _scaled_state(process_group: Any, options: Any) -> Any:
    _check_scale(options)
    return options["scale"]


def _check_scale(options: Any) -> None:
    if set(options) - {"scale"}:
        raise ValueError(f"unknown option(s) {sorted(set(options) - {'scale'})}; accepted: scale")


def test_check_options_runs_in_a_single_process() -> None:
    # Without DDP (one process) make_state never runs; check_options still catches a typo.
    kwplug.register_comm_hook(
        "scaled", hooks.mean_allreduce_hook, make_state=_scaled_state, check_options=_check_scale
    )
    try:
        handler = DistributedDataParallelKwargs(comm_hook="scaled", comm_state_option={"scal": 2})
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['scal'\]; accepted: scale"):
            kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
        handler.comm_state_option = {"scale": 2}
        accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
        model = torch.nn.Linear(2, 1)
        assert accelerator.prepare(model) is model
        handler.comm_state_option = {"scal": 2}  # changed after construction: prepare() checks
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['scal'\]"):
            accelerator.prepare(torch.nn.Linear(2, 1))
        record = accelerator.comm_hooks["scaled"]
        assert record.build_state(None, {"scale": 3}) == 3
        with pytest.raises(TypeError, match="callable"):
            CommHook("x", hooks.mean_allreduce_hook, check_options=42)  # type: ignore[arg-type]
    finally:
        kwplug.unregister_comm_hook("scaled")
