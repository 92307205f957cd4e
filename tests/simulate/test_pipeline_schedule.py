"""The schedules' action orders the simulator rebuilds (simulate/pipeline_schedule.py) are the
ones torch 2.13 runs, and what they give: micro-batches in flight per stage, the bubble."""
import pytest

from memadvisor.simulate import pipeline_schedule


def _torch_interleaved_order(num_ranks, stages_per_rank, microbatches, rank):
    """torch's own ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (no process
    group needed: the order is computed from these four attributes)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages = stages_per_rank
    schedule.pp_group_size = num_ranks
    schedule._n_microbatches = microbatches
    schedule.number_of_rounds = max(1, microbatches // num_ranks)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in schedule._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8),
                                     (4, 3, 3), (2, 2, 3), (4, 2, 12)])
def test_interleaved_order_is_torchs(p, v, m):
    for rank in range(p):
        ours = [(kind, local * p + rank, mb) for kind, local, mb in
                pipeline_schedule.rank_actions("interleaved", p, v, m, rank)]
        assert ours == _torch_interleaved_order(p, v, m, rank), (p, v, m, rank)


def test_in_flight_per_local_stage_at_each_backward():
    # pp=2 x 2 stages per rank, M=2: rank 0 runs all four forwards first (warm-up
    # (V-1) x 2 + 2 = 4), so its first backward (stage 2, micro-batch 0) finds both
    # micro-batches in flight on both its stages; rank 1 warms up with 2 (stage 1), then
    # runs stage 3's forward and backward in turn: 2 on stage 1 and 1 on stage 3
    rank0 = pipeline_schedule.rank_actions("interleaved", 2, 2, 2, 0)
    assert rank0 == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
                     ("B", 1, 0), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1)]
    first = pipeline_schedule.in_flight_at_backwards(rank0, 2)[0]
    assert first == (1, (2, 2), (0, 0))
    rank1 = pipeline_schedule.in_flight_at_backwards(
        pipeline_schedule.rank_actions("interleaved", 2, 2, 2, 1), 2)
    assert [held for _, held, _ in rank1] == [(2, 1), (2, 1), (2, 0), (1, 0)]
    assert rank1[2] == (0, (2, 0), (0, 2))  # stage 3's two backwards ran: its gradients made


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 8), (3, 4)])
def test_one_stage_per_rank_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for schedule in ("1f1b", "gpipe"):
        assert pipeline_schedule.bubble_fraction(schedule, p, 1, m) == \
            pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_interleaved_bubble_shrinks_by_v(p, v, m):
    """torch's order, stage costs 1/V of a rank's: (P - 1) / (V M + P - 1)."""
    assert pipeline_schedule.bubble_fraction("interleaved", p, v, m) == \
        pytest.approx((p - 1) / (v * m + p - 1))
