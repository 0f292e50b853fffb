"""The emulated backends' rules, run directly on pooled ranks of each profile.

Every planted mistake must raise on the rank, before any traffic, with the
rule, the fix and its source; every correct program next to it must pass and
give the real backend's result.
"""

from __future__ import annotations

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_testing.profiles import BackendRuleError

ALL = ["gloo", "nccl-emu", "hccl-emu"]
FP8 = torch.float8_e4m3fn


def _each(backends: list[str], world: int = 2) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "backend_name",
        [pytest.param(b, marks=pytest.mark.distributed(world_size=world, backend=b), id=b) for b in backends],
    )


@_each(ALL)
def test_platform_reports_the_emulated_device(rank, backend_name):
    platform = hp_core.get_platform()
    expected = {"gloo": ("cpu", "gloo"), "nccl-emu": ("cuda", "nccl"), "hccl-emu": ("npu", "hccl")}
    assert (platform.device_type, platform.backend) == expected[backend_name]
    assert platform.tensor_device_type == "cpu"
    assert platform.device() == torch.device("cpu")
    stream = platform.handle.new_stream()
    stream.wait_stream(platform.handle.current_stream())  # no-op streams
    assert platform.handle.new_event().query()
    assert hp_core.capabilities_for(dist.group.WORLD).backend == expected[backend_name][1]


@_each(ALL)
def test_non_contiguous_tensor_is_rejected_on_every_profile(rank, backend_name):
    base = torch.ones(4, 4)
    with pytest.raises(BackendRuleError, match=r"tensor is not contiguous \(shape \(4,\), stride \(4,\)\)"):
        dist.all_reduce(base[:, 0])
    assert base.sum().item() == 16, "the base must be untouched"
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [2.0] * 4


@_each(["nccl-emu"])
def test_nccl_accepts_dense_channels_last(rank, backend_name):
    t = torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last)
    dist.all_reduce(t)
    assert t.sum().item() == 16


@_each(["hccl-emu"])
def test_hccl_rejects_any_non_contiguous_layout(rank, backend_name):
    t = torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last)
    with pytest.raises(BackendRuleError, match=r"hccl-emu.*not contiguous.*ProcessGroupHCCL"):
        dist.all_reduce(t)


@_each(["nccl-emu", "hccl-emu"])
@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_bitwise_reduce_ops_are_rejected(rank, backend_name, op):
    t = torch.ones(4, dtype=torch.int32)
    with pytest.raises(BackendRuleError, match=rf"reduce op {op} is not supported"):
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))


@_each(["gloo"])
def test_gloo_runs_bitwise_ops_and_rejects_premul_sum(rank, backend_name):
    t = torch.tensor([3, 5], dtype=torch.int32) if rank == 0 else torch.tensor([6, 4], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    assert t.tolist() == [2, 4]
    with pytest.raises(BackendRuleError, match=r"PREMUL_SUM is not supported by gloo.*hp_core.all_reduce"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(0.5))
    # hp_core emulates it on gloo with the same result
    assert hp_core.all_reduce(torch.ones(2), "premul_sum", scale=0.5).tolist() == [1.0, 1.0]


@_each(["nccl-emu"])
def test_premul_sum_is_emulated_with_nccls_result(rank, backend_name):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert t.tolist() == [1.5] * 3  # 0.5 * 1 + 0.5 * 2
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(4.0), op=dist._make_nccl_premul_sum(2.0))
    assert out.tolist() == ([0.0, 4.0] if rank == 0 else [8.0, 12.0])
    grad = torch.full((2,), 4.0)
    assert hp_core.all_reduce(grad, "premul_sum", scale=0.25).tolist() == [2.0, 2.0]
    assert hp_core.all_reduce(torch.ones(2), "avg").tolist() == [1.0, 1.0]


@_each(["hccl-emu"])
def test_hccl_has_no_avg_but_hp_core_emulates_it(rank, backend_name):
    with pytest.raises(BackendRuleError, match=r"reduce op AVG is not supported by hccl.*hcclcpp"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.AVG)
    assert hp_core.all_reduce(torch.full((2,), float(rank)), "avg").tolist() == [0.5, 0.5]


@_each(["nccl-emu"])
def test_nccl_moves_fp8_but_will_not_reduce_it(rank, backend_name):
    data = torch.full((4,), float(rank + 1)).to(FP8)
    out = torch.empty(8, dtype=FP8)
    dist.all_gather_into_tensor(out, data)
    assert out.float().tolist() == [1.0] * 4 + [2.0] * 4
    shared = torch.full((2,), 3.0).to(FP8) if rank == 0 else torch.zeros(2, dtype=FP8)
    dist.broadcast(shared, src=0)
    assert shared.float().tolist() == [3.0, 3.0]
    with pytest.raises(BackendRuleError, match=r"dtype torch.float8_e4m3fn cannot be reduced by nccl"):
        dist.all_reduce(torch.ones(2).to(FP8))


@_each(["gloo", "hccl-emu"])
def test_fp8_cannot_move_on_gloo_or_hccl(rank, backend_name):
    with pytest.raises(BackendRuleError, match="float8_e4m3fn"):
        dist.all_gather_into_tensor(torch.empty(4, dtype=FP8), torch.ones(2).to(FP8))


@_each(["gloo"])
def test_gloo_refuses_int16_before_it_breaks_the_peers(rank, backend_name):
    """gloo fails int16 asynchronously ("Invalid scalar type"); the rule names a carrier instead."""
    with pytest.raises(BackendRuleError, match=r"gloo cannot move dtype torch.int16.*torch.float16"):
        dist.all_gather_into_tensor(torch.empty(4, dtype=torch.int16), torch.ones(2, dtype=torch.int16))
    out = torch.empty(4, dtype=torch.int16)
    hp_core.all_gather_into_tensor(out, torch.full((2,), rank + 7, dtype=torch.int16))
    assert out.tolist() == [7, 7, 8, 8]  # hp_core carries it as float16 bits


@_each(["nccl-emu"])
def test_nccl_rejects_int16(rank, backend_name):
    with pytest.raises(BackendRuleError, match=r"torch.int16 cannot be reduced by nccl"):
        dist.all_reduce(torch.ones(2, dtype=torch.int16))


@_each(["hccl-emu"])
def test_hccl_reduce_dtypes(rank, backend_name):
    with pytest.raises(BackendRuleError, match=r"torch.uint8 cannot be reduced by hccl"):
        dist.all_reduce(torch.ones(2, dtype=torch.uint8))
    with pytest.raises(BackendRuleError, match=r"PRODUCT does not support dtype torch.bfloat16"):
        dist.all_reduce(torch.ones(2, dtype=torch.bfloat16), op=dist.ReduceOp.PRODUCT)
    t = torch.ones(2, dtype=torch.bfloat16)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
    moved = torch.ones(2, dtype=torch.uint8)
    dist.broadcast(moved, src=1)  # uint8 moves on HCCL; only its reduction is missing


@_each(ALL)
def test_complex_tensors_travel_as_their_real_view(rank, backend_name):
    # torch views complex tensors as real before any backend sees them, so complex64 is judged
    # as float32 (an HCCL type) rather than rejected as "not a data type".
    value = torch.tensor([complex(1, rank), complex(2, -rank)], dtype=torch.complex64)
    out = torch.empty(4, dtype=torch.complex64)
    dist.all_gather_into_tensor(out, value)
    assert out.tolist() == [1 + 0j, 2 + 0j, 1 + 1j, 2 - 1j]
    dist.all_reduce(value)
    assert value.tolist() == [2 + 1j, 4 - 1j]


def test_hccl_a2_profile_has_no_float64_reductions(monkeypatch: pytest.MonkeyPatch) -> None:
    from hp_testing.profiles import get_profile

    assert torch.float64 in (get_profile("hccl-emu").reduce_dtypes or ())
    monkeypatch.setenv("HP_TEST_HCCL_SOC", "a2")
    assert torch.float64 not in (get_profile("hccl-emu").reduce_dtypes or ())


@_each(ALL)
def test_uneven_all_gather(rank, backend_name):
    mine = torch.full((rank + 1,), float(rank))
    outs = [torch.empty(1), torch.empty(2)]
    if backend_name == "gloo":
        with pytest.raises(BackendRuleError, match=r"different sizes \[1, 2\].*input_sizes"):
            dist.all_gather(outs, mine)
    else:
        dist.all_gather(outs, mine)
        assert outs[0].tolist() == [0.0] and outs[1].tolist() == [1.0, 1.0]
    gathered = hp_core.all_gather_into_tensor(torch.empty(3), mine, input_sizes=[1, 2])
    assert gathered.tolist() == [0.0, 1.0, 1.0]


@_each(ALL)
def test_uneven_all_to_all_single(rank, backend_name):
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and 1 to itself
    send = [1, 2] if rank == 0 else [3, 1]
    recv = [1, 3] if rank == 0 else [2, 1]
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, torch.full((sum(send),), float(rank)), recv, send)
    assert out.tolist() == ([0.0, 1.0, 1.0, 1.0] if rank == 0 else [0.0, 0.0, 1.0])


@_each(["nccl-emu", "hccl-emu"])
def test_recv_from_any_source_is_rejected(rank, backend_name):
    with pytest.raises(BackendRuleError, match="recv without src"):
        dist.recv(torch.empty(1))
    dist.barrier()


@_each(["nccl-emu", "hccl-emu"])
def test_monitored_barrier_only_exists_on_gloo(rank, backend_name):
    with pytest.raises(BackendRuleError, match="monitored_barrier does not exist"):
        dist.monitored_barrier()


@_each(ALL)
def test_object_collectives_and_p2p_objects(rank, backend_name):
    got: list[object] = [None, None]
    dist.all_gather_object(got, {"rank": rank})
    assert got == [{"rank": 0}, {"rank": 1}]
    assert hp_core.broadcast_object({"from": rank}, src=1) == {"from": 1}
    if rank == 0:
        dist.send_object_list(["hello", 3], dst=1)
    else:
        box: list[object] = [None, None]
        dist.recv_object_list(box, src=0)
        assert box == ["hello", 3]


@_each(["nccl-emu"])
def test_library_code_on_the_emulated_platform(rank, backend_name, device_mesh_factory):
    mesh = device_mesh_factory((2,), ("dp",))
    assert mesh.device_type == "cuda"
    grad = torch.full((4,), float(rank))
    work = hp_core.all_reduce(grad, "avg", group=mesh, async_op=True)
    assert work.wait().tolist() == [0.5] * 4
    torch_mesh = mesh.to_torch()
    assert torch_mesh.device_type == "cpu"
    group = dist.new_group([0, 1], backend=hp_core.get_platform().backend)  # "nccl" maps to gloo
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2
