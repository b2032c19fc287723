"""The parallel backends: one per plugin name, found by name or by plugin class, each answering for its plugin."""

from __future__ import annotations

import typing

import pytest
import torch

from coati_kto.config.schema import GEMINI_REFUSAL, PluginName
from coati_kto.errors import ConfigError
from coati_kto.parallel.backends import BACKENDS, backend_class, backend_of
from coati_kto.parallel.distributed import ParallelLayout
from coati_kto.parallel.grad_norm import GradNorm
from coati_kto.parallel.plan import ParallelPlan


def test_every_plugin_name_the_config_takes_has_one_backend() -> None:
    assert sorted(BACKENDS) == sorted(typing.get_args(PluginName))
    for name, backend in BACKENDS.items():
        assert backend_class(name) is backend and backend.name == name


def test_an_unknown_name_is_refused_in_one_line_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        backend_class("megatron")
    assert str(err.value) == (
        "plugin.name 'megatron' is no parallel backend; known: ddp, gemini, hybrid_parallel, low_level_zero"
    )


def test_a_plugin_object_finds_its_backend_by_class() -> None:
    """``ParallelPlan.from_plugin`` for a plugin built elsewhere: by ColossalAI's class name; anything else
    (no plugin at all, a subclass such as the one-rank DDP plugin) is a plain torch run: ddp."""

    def plugin(kind: str, **attrs: object) -> object:
        return type(kind, (), attrs)()

    assert backend_of(plugin("HybridParallelPlugin")).name == "hybrid_parallel"
    assert backend_of(plugin("LowLevelZeroPlugin")).name == "low_level_zero"
    assert backend_of(plugin("TorchDDPPlugin")).name == "ddp"
    assert backend_of(plugin("GeminiPlugin")).name == "gemini"
    assert backend_of(None).name == "ddp"
    assert backend_of(plugin("SingleRankDDPPlugin")).name == "ddp"
    recovered = ParallelPlan.from_plugin(
        plugin("LowLevelZeroPlugin", stage=1, precision="bf16", max_norm=1.0)
    )
    assert (recovered.plugin, recovered.zero_stage, recovered.precision) == ("low_level_zero", 1, "bf16")
    assert recovered.max_grad_norm == 1.0 and recovered.backend.name == "low_level_zero"


# plugin, zero_stage, dp_size -> torch_ddp, forward_collectives, no_sync, chunked head, gradients in ZeRO's store
CAPABILITIES = [
    ("ddp", 0, 2, (True, True, True, True, False)),
    ("ddp", 0, None, (True, True, True, True, False)),  # dp size not known: as at several ranks
    ("ddp", 0, 1, (False, False, True, True, False)),  # one data-parallel rank: nothing wrapped
    ("hybrid_parallel", 0, 2, (True, True, True, True, False)),
    ("hybrid_parallel", 0, 1, (False, False, True, True, False)),
    ("hybrid_parallel", 1, 2, (False, False, True, True, True)),
    ("hybrid_parallel", 2, 2, (False, False, False, True, True)),  # ZeRO-2 asserts against no_sync
    ("low_level_zero", 1, 2, (False, False, True, True, True)),
    ("low_level_zero", 2, 1, (False, False, False, True, True)),
    ("gemini", 0, 2, (False, False, False, False, False)),  # chunks released outside the forward
]


@pytest.mark.parametrize("plugin, zero_stage, dp_size, expected", CAPABILITIES)
def test_each_backend_answers_for_its_plugin(
    plugin: str, zero_stage: int, dp_size: int | None, expected: tuple[bool, ...]
) -> None:
    backend = ParallelPlan(plugin, "bf16", zero_stage, dp_size=dp_size).backend  # type: ignore[arg-type]
    answers = (
        backend.torch_ddp,
        backend.forward_collectives,
        backend.no_sync_accumulation,
        backend.chunked_head,
        backend.gradients_in_zero_store,
    )
    assert answers == expected


def test_gemini_is_refused_with_the_reason_at_every_way_in() -> None:
    backend = ParallelPlan("gemini", "bf16", 0).backend
    calls = [
        backend.build_plugin,
        lambda: backend.grad_norm(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), None),
        lambda: backend.boost(None, torch.nn.Linear(1, 1), None, None),
        lambda: backend.build_reference(None, torch.nn.Linear(1, 1)),
    ]
    for call in calls:
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value) == GEMINI_REFUSAL and "\n" not in GEMINI_REFUSAL


def test_the_gradient_norm_is_read_where_the_backend_says_or_refused() -> None:
    """A backend that says ZeRO's store, handed an optimizer that keeps its gradients in ``p.grad``, is a
    ValueError: the norm read from the empty store would be 0 and vote nothing."""
    layout = ParallelLayout(0, 1, 0, 0, 1, None)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    with pytest.raises(ValueError) as err:
        ParallelPlan("low_level_zero", "fp32", 2).backend.grad_norm(optimizer, layout)
    assert (
        str(err.value)
        == "the backend reads gradients from ZeRO's gradient store, but SGD keeps them in p.grad"
    )
    norm = ParallelPlan("ddp", "fp32", 0).backend.grad_norm(optimizer, layout, max_norm=0.5)
    assert isinstance(norm, GradNorm) and norm.max_norm == 0.5
    optimizer.param_groups[0]["params"][0].grad = torch.tensor([3.0, 4.0])
    assert float(norm.local_share()) == 25.0  # from p.grad: the squared norm


def test_a_rank_without_gradients_puts_its_zero_share_where_the_collectives_run(monkeypatch) -> None:
    """A rank or stage holding no gradient contributes a zero share to the tensor-, sequence- and
    pipeline-parallel all-reduces. It was made on the optimizer's first parameter's device, in host memory
    under ``cpu_offload``, which NCCL refuses; now on the collectives' device (``meta`` stands in for the GPU)."""
    from coati_kto.parallel import grad_norm

    monkeypatch.setattr(grad_norm, "comm_device", lambda: torch.device("meta"), raising=False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)  # no gradient yet
    norm = ParallelPlan("ddp", "fp32", 0).backend.grad_norm(optimizer, ParallelLayout(0, 1, 0, 0, 1, None))
    share = norm.local_share()
    assert (share.device.type, share.dtype, share.shape) == ("meta", torch.float64, torch.Size([]))
