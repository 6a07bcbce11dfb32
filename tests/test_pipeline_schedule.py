"""Pipeline schedules as data: shapes, dependencies, bubble and activation-memory theory."""

from __future__ import annotations

import pytest

from lockstep.pipeline.schedule import (
    Action,
    bubble_fraction,
    format_schedule,
    format_timeline,
    forward_only,
    get_schedule,
    gpipe,
    in_flight_peaks,
    one_f_one_b,
    simulate,
    validate_schedule,
)

SIZES = [(1, 1), (1, 4), (2, 1), (2, 3), (3, 5), (4, 4), (4, 8), (5, 2)]


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert format_schedule(gpipe(2, 3)) == (
        "stage 0: F0 F1 F2 B0 B1 B2\n"
        "stage 1: F0 F1 F2 B0 B1 B2"
    )


def test_one_f_one_b_warms_up_then_alternates():
    assert format_schedule(one_f_one_b(3, 4)) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "stage 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
        "stage 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
def test_every_schedule_is_valid_and_ends_with_the_last_backward(name, p, m):
    schedule = get_schedule(name, p, m)
    assert len(schedule) == p
    validate_schedule(schedule, m)
    for actions in schedule:
        assert sorted(actions) == sorted([Action("F", i) for i in range(m)]
                                         + [Action("B", i) for i in range(m)])
        assert actions[-1] == Action("B", m - 1)  # DDP syncs on it


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
def test_simulated_bubble_matches_theory(name, p, m):
    timeline = simulate(get_schedule(name, p, m))
    assert timeline.makespan == 2 * (m + p - 1)
    for fraction in timeline.bubble_fractions():
        assert fraction == pytest.approx(bubble_fraction(p, m))


def test_bubble_theory_values():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 13) == pytest.approx(3 / 16)


def test_one_f_one_b_bounds_activations_by_stages_gpipe_by_microbatches():
    assert in_flight_peaks(gpipe(4, 8)) == [8, 8, 8, 8]
    assert in_flight_peaks(one_f_one_b(4, 8)) == [4, 3, 2, 1]
    assert in_flight_peaks(one_f_one_b(4, 2)) == [2, 2, 2, 1]


def test_timeline_order_respects_dependencies():
    schedule = one_f_one_b(3, 4)
    done = set()
    for stage, k in simulate(schedule).order():
        action = schedule[stage][k]
        if action.phase == "F" and stage > 0:
            assert (stage - 1, action) in done
        if action.phase == "B" and stage < 2:
            assert (stage + 1, action) in done
        done.add((stage, action))


def test_unequal_costs_give_the_slowest_stage_no_bubble_beyond_fill_and_drain():
    timeline = simulate(one_f_one_b(2, 4), forward_time=1.0, backward_time=2.0)
    assert timeline.makespan == 4 * 3 + 3  # 4 micro-batches of 3 units, plus fill and drain
    assert format_timeline(gpipe(2, 2)) == (
        "stage 0: F0 F1 .. .. B0 B1\n"
        "stage 1: .. F0 F1 B0 B1 .."
    )


def test_forward_only_has_no_backward():
    assert format_schedule(forward_only(2, 2)) == "stage 0: F0 F1\nstage 1: F0 F1"
    assert simulate(forward_only(3, 2)).makespan == 4


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        get_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be at least 1"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="num_stages must be at least 1"):
        one_f_one_b(0, 2)
    with pytest.raises(ValueError, match="stage 1 runs B0 before F0"):
        validate_schedule([[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]], 1)
    with pytest.raises(ValueError, match="stage 0 must run micro-batches 0..1 forward"):
        validate_schedule([[Action("F", 0)]], 2)
    # Stage 0 waits for B0 from stage 1, which waits for F1 that stage 0 never reaches.
    bad = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
           [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]]
    with pytest.raises(ValueError, match="schedule deadlocks: stage 0 at B0, stage 1 at F1"):
        simulate(bad)
