"""Task sampling: groups, opponent assignment, seats and seed streams (docs/method.md §2 and §6)."""

from collections import Counter

import pytest

from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig, largest_remainder_counts

POOL = {"conservative": 0.3, "aggressive": 0.3, "intermediate": 0.4}


def sampler(**kw) -> TaskSampler:
    base = dict(num_tasks=16, group_size=8, opponents=POOL, seed=3)
    base.update(kw)
    return TaskSampler(TaskSamplerConfig(**base))


def by_group(tasks):
    groups = {}
    for t in tasks:
        groups.setdefault(t.group, []).append(t)
    return groups


def test_a_training_batch_has_b_groups_of_g_identical_copies():
    tasks = sampler().sample_train(0)
    assert len(tasks) == 128
    assert [t.meta_episode for t in tasks] == list(range(128))
    groups = by_group(tasks)
    assert sorted(groups) == list(range(16))
    for members in groups.values():
        assert len(members) == 8
        assert len({(t.seed, t.opponent, t.seat) for t in members}) == 1
    assert len({members[0].seed for members in groups.values()}) == 16  # distinct task instances


def test_largest_remainder_counts_follow_the_ratios_and_sum_to_the_total():
    assert largest_remainder_counts([0.3, 0.3, 0.4], 16) == [5, 5, 6]
    assert largest_remainder_counts([0.3, 0.3, 0.4], 10) == [3, 3, 4]
    assert largest_remainder_counts([1, 1, 1], 4) == [2, 1, 1]
    assert sum(largest_remainder_counts([0.2, 0.5, 0.3], 37)) == 37


def test_stationary_grouping_keeps_one_opponent_per_group_for_the_whole_run_in_ratio_blocks():
    s = sampler()
    first = {b: m[0].opponent for b, m in by_group(s.sample_train(0)).items()}
    for iteration in (1, 7, 150):
        assert {b: m[0].opponent for b, m in by_group(s.sample_train(iteration)).items()} == first
    assert [first[b] for b in range(16)] == ["conservative"] * 5 + ["aggressive"] * 5 + ["intermediate"] * 6


@pytest.mark.parametrize("grouping, group_size", [("stationary", 2), ("mixed", 1)])
def test_too_few_slots_for_the_pool_cover_every_opponent_across_iterations(grouping, group_size):
    # Two groups (two meta-episodes in mixed mode) cannot hold three opponents: rounding 0.3 / 0.3 / 0.4
    # over 2 slots alone gives [1, 0, 1], and the aggressive opponent would never be met.
    s = sampler(num_tasks=2, group_size=group_size, grouping=grouping, seats="mixed")
    assert s.rotation_period == 2
    met = Counter()
    for iteration in range(10):
        groups = by_group(s.sample_train(iteration))
        assert all(len({t.opponent for t in m}) == 1 for m in groups.values())  # one opponent per group
        met.update(m[0].opponent for m in groups.values())
    assert met == {"conservative": 5, "aggressive": 5, "intermediate": 10}  # the pool ratio per cycle
    assert sampler(num_tasks=2, group_size=group_size, grouping=grouping).sample_train(3) == \
        sampler(num_tasks=2, group_size=group_size, grouping=grouping).sample_train(3)  # still pure


def test_a_pool_that_covers_every_opponent_in_one_iteration_is_not_rotated():
    assert sampler().rotation_period == 1 and sampler(num_tasks=3).rotation_period == 1
    assert sampler(num_tasks=3).group_opponents(0) == sampler(num_tasks=3).group_opponents(1) == [
        "conservative", "aggressive", "intermediate"]


def test_a_pool_member_too_rare_to_be_met_within_the_longest_cycle_is_refused():
    with pytest.raises(ValueError, match="'rare' .* would not be met once in 1000 iterations of 1 groups"):
        sampler(num_tasks=1, opponents={"common": 1.0, "rare": 1e-4})


def test_mixed_grouping_mixes_opponents_inside_groups_in_the_pool_ratio():
    s = sampler(grouping="mixed")
    tasks = s.sample_train(0)
    assert Counter(t.opponent for t in tasks) == {"conservative": 39, "aggressive": 38, "intermediate": 51}
    mixed_groups = [b for b, m in by_group(tasks).items() if len({t.opponent for t in m}) > 1]
    assert len(mixed_groups) >= 8
    for members in by_group(tasks).values():  # the seed and seat are still shared by the copies
        assert len({(t.seed, t.seat) for t in members}) == 1


@pytest.mark.parametrize("seats, expected", [("first", {0}), ("second", {1})])
def test_fixed_seats(seats, expected):
    assert {t.seat for t in sampler(seats=seats).sample_train(2)} == expected


def test_mixed_seats_put_the_agent_second_in_half_the_groups_of_every_opponent():
    s = sampler(seats="mixed", num_tasks=24)
    for iteration in range(5):
        groups = by_group(s.sample_train(iteration))
        assert sum(m[0].seat for m in groups.values()) == 12  # blocks 7 / 7 / 10 balanced together
        for name in POOL:
            seats = [m[0].seat for m in groups.values() if m[0].opponent == name]
            assert abs(2 * sum(seats) - len(seats)) <= 1


def test_single_agent_tasks_have_no_opponent_and_no_seat():
    tasks = TaskSampler(TaskSamplerConfig(num_tasks=4, group_size=2)).sample_train(0)
    assert {(t.opponent, t.seat) for t in tasks} == {(None, None)}
    with pytest.raises(ValueError, match="seats"):
        TaskSamplerConfig(seats="mixed")


def test_sampling_is_a_pure_function_of_seed_and_iteration():
    assert sampler().sample_train(5) == sampler().sample_train(5)
    assert sampler().sample_train(5) != sampler().sample_train(6)
    assert sampler().sample_train(5) != sampler(seed=4).sample_train(5)


def test_training_and_evaluation_seeds_never_overlap():
    s = sampler()
    train = {t.seed for i in range(200) for t in s.sample_train(i)}
    evaluation = set(s.eval_seeds(512))
    assert not train & evaluation
    assert all(seed % 2 == 0 for seed in train) and all(seed % 2 == 1 for seed in evaluation)


def test_evaluation_tasks_have_group_size_one_and_the_same_seeds_for_every_opponent():
    s = sampler(seed=11)
    cfr = s.sample_eval(32, opponent="cfr", seat="second")
    pool = s.sample_eval(32)
    assert [t.group for t in cfr] == list(range(32)) == [t.meta_episode for t in cfr]
    assert (
        [t.seed for t in cfr] == [t.seed for t in pool] == [t.seed for t in sampler(seed=99).sample_eval(32)]
    )
    assert {t.opponent for t in cfr} == {"cfr"} and {t.seat for t in cfr} == {1}
    assert Counter(t.opponent for t in pool) == {"conservative": 10, "aggressive": 9, "intermediate": 13}
    assert Counter(t.seat for t in s.sample_eval(10, seat="mixed")) == {0: 5, 1: 5}
    with pytest.raises(ValueError, match="seat"):
        s.sample_eval(4, seat="middle")


def test_state_dict_round_trips_and_rejects_a_different_task_stream():
    s = sampler()
    state = s.state_dict()
    sampler().load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        sampler(seed=4).load_state_dict(state)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(grouping="random"), "grouping"),
        (dict(seats="left"), "seats"),
        (dict(num_tasks=0), "num_tasks"),
        (dict(opponents={"a": -1.0}), "ratio"),
        (dict(opponents={}), "opponent"),
    ],
)
def test_bad_configs_get_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        sampler(**kw)
