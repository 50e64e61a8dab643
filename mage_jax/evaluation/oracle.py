"""The Kuhn Poker oracle: what any agent can reach on evaluation meta-episodes (docs/method.md §7.1, §9).

Every Kuhn opponent is deterministic, so a meta-episode (deal, seat, opponent) is a small game
tree the agent walks alone. The oracle measures, exactly (no sampling):

- the *winnable* share: a deal is winnable if some agent line wins it; the ceiling of success@k;
- the *uniformly random* policy (PASS / BET with probability 1/2 at each decision): success@k and
  payoff@k, the mean payoff in chips of the last episode played up to episode k (a won episode
  ends the meta-episode, as in the runner);
- the *best fixed* policies: pure strategies (information state -> action, the same in every
  episode, so they cannot learn across episodes). ``best_fixed`` maximises the mean payoff (ties:
  more wins); ``best_fixed_by_success`` maximises the share of won meta-episodes (ties: payoff). On
  the training pool no single pure strategy is best at both: the success-maximiser reaches the
  winnable ceiling but gives up payoff. An information state is OpenSpiel's ``card + history``
  (e.g. ``"1pb"``), which also fixes the seat. Both criteria are sums over (card, seat) classes,
  each decided by its own two information states, so the best strategy picks the best of four
  local strategies per class; this equals enumerating all 4096 pure strategies (checked in the
  tests);
- the *adaptive bound*: the highest payoff@k any agent can reach on the set. The agent sees its
  card, the public history and its payoff after each episode, never the opponent's card or name;
  the best such policy is found by expectimax over the hidden (opponent card, opponent) pairs
  consistent with what it saw, weighted as in the evaluation set (each k optimised separately).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from mage_jax.envs.kuhn_poker import kuhn_current_player, kuhn_deal, kuhn_is_terminal, kuhn_returns
from mage_jax.envs.opponents.kuhn import ACTION_LETTERS, KUHN_TRAINING_POOL, make_kuhn_opponent

AGENT_HISTORIES = {0: ("", "pb"), 1: ("p", "b")}
"""Histories at which the agent decides, by seat."""

INFORMATION_STATES = tuple(f"{card}{history}" for card in range(3) for history in ("", "p", "b", "pb"))


@dataclasses.dataclass(frozen=True)
class KuhnMetaEpisode:
    """One evaluation meta-episode: the deal of ``seed``, the agent's seat and a deterministic opponent."""

    seed: int
    seat: int
    opponent: str
    weight: float = 1.0

    @functools.cached_property
    def cards(self) -> tuple[int, int]:
        """(agent card, opponent card)."""
        return kuhn_deal(self.seed)


@dataclasses.dataclass(frozen=True)
class ReferenceCurve:
    """success@k and payoff@k (chips) for k = 0..N-1."""

    success: np.ndarray
    payoff: np.ndarray


@dataclasses.dataclass(frozen=True)
class KuhnOracleReport:
    winnable: float
    random: ReferenceCurve
    best_fixed: ReferenceCurve
    best_fixed_strategy: dict[str, str]
    best_fixed_by_success: ReferenceCurve
    best_fixed_by_success_strategy: dict[str, str]
    adaptive_payoff_bound: np.ndarray
    omniscient_payoff: float
    """Mean payoff of an agent that knows the opponent's card and name (plays its best line at once)."""

    def summary(self) -> dict[str, object]:
        return {
            "winnable": self.winnable,
            "random_success": self.random.success.tolist(),
            "random_payoff": self.random.payoff.tolist(),
            "best_fixed_success": self.best_fixed.success.tolist(),
            "best_fixed_payoff": self.best_fixed.payoff.tolist(),
            "best_fixed_by_success_success": self.best_fixed_by_success.success.tolist(),
            "best_fixed_by_success_payoff": self.best_fixed_by_success.payoff.tolist(),
            "adaptive_payoff_bound": self.adaptive_payoff_bound.tolist(),
            "omniscient_payoff": self.omniscient_payoff,
            "best_fixed_strategy": self.best_fixed_strategy,
            "best_fixed_by_success_strategy": self.best_fixed_by_success_strategy,
        }


# --------------------------------------------------------------------------------------- game walk
@functools.cache
def _walk(agent_card: int, opponent_card: int, seat: int, opponent: str, strategy: tuple[int, int] | None):
    """Outcomes of one episode: {(history, agent payoff): probability}.

    ``strategy`` gives the agent's actions at its two decision histories (AGENT_HISTORIES[seat]);
    None means the uniformly random policy.
    """
    player = make_kuhn_opponent(opponent)
    cards = (agent_card, opponent_card) if seat == 0 else (opponent_card, agent_card)
    outcomes: dict[tuple[str, int], float] = defaultdict(float)

    def visit(history: str, probability: float) -> None:
        if kuhn_is_terminal(history):
            outcomes[(history, kuhn_returns(cards, history)[seat])] += probability
        elif kuhn_current_player(history) != seat:
            visit(history + ACTION_LETTERS[player.act(opponent_card, history)], probability)
        elif strategy is None:
            for letter in ACTION_LETTERS:
                visit(history + letter, probability / 2)
        else:
            visit(history + ACTION_LETTERS[strategy[AGENT_HISTORIES[seat].index(history)]], probability)

    visit("", 1.0)
    return dict(outcomes)


def _lines(agent_card: int, opponent_card: int, seat: int, opponent: str) -> list[int]:
    """Agent payoff of each of its four local pure strategies (some coincide)."""
    return [
        _single_payoff(_walk(agent_card, opponent_card, seat, opponent, strategy))
        for strategy in itertools.product((0, 1), repeat=2)
    ]


def _single_payoff(outcomes: Mapping[tuple[str, int], float]) -> int:
    ((_, payoff),) = outcomes
    return payoff


# --------------------------------------------------------------------------------------- references
def random_policy_curve(episode: KuhnMetaEpisode, num_episodes: int) -> ReferenceCurve:
    """Exact success@k / payoff@k of the uniformly random policy on one meta-episode.

    Episodes are independent replays of the same deal: with p = P(win), A = E[payoff; win] and
    L = E[payoff; no win], success@k = 1 - (1-p)^(k+1) and payoff@k = A * sum_{j<=k} (1-p)^j + (1-p)^k L.
    """
    agent_card, opponent_card = episode.cards
    outcomes = _walk(agent_card, opponent_card, episode.seat, episode.opponent, None)
    p = sum(prob for (_, payoff), prob in outcomes.items() if payoff > 0)
    win_part = sum(prob * payoff for (_, payoff), prob in outcomes.items() if payoff > 0)
    loss_part = sum(prob * payoff for (_, payoff), prob in outcomes.items() if payoff <= 0)
    k = np.arange(num_episodes)
    miss = (1.0 - p) ** k
    return ReferenceCurve(
        success=1.0 - (1.0 - p) ** (k + 1), payoff=win_part * np.cumsum(miss) + miss * loss_part
    )


def is_winnable(episode: KuhnMetaEpisode) -> bool:
    return max(_lines(*episode.cards, episode.seat, episode.opponent)) > 0


def fixed_strategy_payoffs(episodes: Sequence[KuhnMetaEpisode], strategy: Mapping[str, int]) -> np.ndarray:
    """Payoff (chips) of a pure strategy (information state -> 0 PASS / 1 BET) on each meta-episode."""
    payoffs = []
    for episode in episodes:
        card, opponent_card = episode.cards
        local = tuple(int(strategy[f"{card}{h}"]) for h in AGENT_HISTORIES[episode.seat])
        payoffs.append(_single_payoff(_walk(card, opponent_card, episode.seat, episode.opponent, local)))
    return np.asarray(payoffs, dtype=np.float64)


def best_fixed_strategy(episodes: Sequence[KuhnMetaEpisode], criterion: str = "payoff") -> dict[str, int]:
    """The best pure strategy on the weighted set.

    ``criterion`` "payoff" ranks by mean payoff, then wins; "success" by wins, then payoff. Remaining
    ties (and information states the set never reaches) prefer PASS.
    """
    if criterion not in ("payoff", "success"):
        raise ValueError(f"criterion must be 'payoff' or 'success', got {criterion!r}")
    strategy = {state: 0 for state in INFORMATION_STATES}
    classes: dict[tuple[int, int], list[KuhnMetaEpisode]] = defaultdict(list)
    for episode in episodes:
        classes[(episode.cards[0], episode.seat)].append(episode)
    for (card, seat), members in sorted(classes.items()):
        weights = np.array([m.weight for m in members])

        def score(local: tuple[int, int], members=members, weights=weights, seat=seat) -> tuple[float, ...]:
            payoffs = np.array([_single_payoff(_walk(*m.cards, seat, m.opponent, local)) for m in members])
            payoff, success = round(float(weights @ payoffs), 12), round(float(weights @ (payoffs > 0)), 12)
            key = (payoff, success) if criterion == "payoff" else (success, payoff)
            return (*key, -sum(local))

        best = max(itertools.product((0, 1), repeat=2), key=score)
        for history, action in zip(AGENT_HISTORIES[seat], best):
            strategy[f"{card}{history}"] = action
    return strategy


def adaptive_payoff_bound(episodes: Sequence[KuhnMetaEpisode], num_episodes: int) -> np.ndarray:
    """Highest weighted mean payoff@k over all agents that see only their card, histories and payoffs."""
    prior: dict[tuple[int, int], dict[tuple[int, str], float]] = defaultdict(lambda: defaultdict(float))
    for episode in episodes:
        card, opponent_card = episode.cards
        prior[(card, episode.seat)][(opponent_card, episode.opponent)] += episode.weight
    total = sum(e.weight for e in episodes)
    bound = np.zeros(num_episodes)
    for (card, seat), hidden in prior.items():
        for k in range(num_episodes):
            bound[k] += _expectimax(card, seat, tuple(sorted(hidden.items())), k + 1)
    return bound / total


@functools.cache
def _expectimax(
    card: int, seat: int, hidden: tuple[tuple[tuple[int, str], float], ...], remaining: int
) -> float:
    """Best weighted final payoff with ``remaining`` episodes left, given the still-possible hidden pairs."""
    best = -np.inf
    for local in itertools.product((0, 1), repeat=2):
        groups: dict[tuple[str, int], list[tuple[tuple[int, str], float]]] = defaultdict(list)
        for (opponent_card, opponent), weight in hidden:
            ((outcome, _),) = _walk(card, opponent_card, seat, opponent, local).items()
            groups[outcome].append(((opponent_card, opponent), weight))
        value = 0.0
        for (_, payoff), members in groups.items():
            if payoff > 0 or remaining == 1:
                value += payoff * sum(weight for _, weight in members)
            else:
                value += _expectimax(card, seat, tuple(members), remaining - 1)
        best = max(best, value)
    return best


def kuhn_oracle(episodes: Sequence[KuhnMetaEpisode], num_episodes: int = 3) -> KuhnOracleReport:
    """All reference numbers for a set of evaluation meta-episodes (weighted by ``weight``)."""
    episodes = list(episodes)
    if not episodes:
        raise ValueError("the Kuhn oracle needs at least one evaluation meta-episode")
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be at least 1, got {num_episodes}")
    for episode in episodes:
        make_kuhn_opponent(episode.opponent)  # clear error on unknown names
        if episode.seat not in (0, 1):
            raise ValueError(f"seat must be 0 or 1, got {episode.seat!r}")
    weights = np.array([e.weight for e in episodes], dtype=np.float64)
    weights = weights / weights.sum()

    random_curves = [random_policy_curve(e, num_episodes) for e in episodes]
    random = ReferenceCurve(
        success=weights @ np.stack([c.success for c in random_curves]),
        payoff=weights @ np.stack([c.payoff for c in random_curves]),
    )
    fixed = {}
    for criterion in ("payoff", "success"):
        strategy = best_fixed_strategy(episodes, criterion)
        payoffs = fixed_strategy_payoffs(episodes, strategy)
        curve = ReferenceCurve(
            success=np.full(num_episodes, float(weights @ (payoffs > 0))),
            payoff=np.full(num_episodes, float(weights @ payoffs)),
        )
        fixed[criterion] = curve, {state: ("BET" if a else "PASS") for state, a in strategy.items()}
    omniscient = float(weights @ np.array([max(_lines(*e.cards, e.seat, e.opponent)) for e in episodes]))
    return KuhnOracleReport(
        winnable=float(weights @ np.array([is_winnable(e) for e in episodes], dtype=np.float64)),
        random=random,
        best_fixed=fixed["payoff"][0],
        best_fixed_strategy=fixed["payoff"][1],
        best_fixed_by_success=fixed["success"][0],
        best_fixed_by_success_strategy=fixed["success"][1],
        adaptive_payoff_bound=adaptive_payoff_bound(episodes, num_episodes),
        omniscient_payoff=omniscient,
    )


# --------------------------------------------------------------------------------------- evaluation sets
def _deal_seeds() -> dict[tuple[int, int], int]:
    """The smallest seed of each of the six deals."""
    seeds: dict[tuple[int, int], int] = {}
    for seed in itertools.count():
        seeds.setdefault(kuhn_deal(seed), seed)
        if len(seeds) == 6:
            return seeds
    raise AssertionError("unreachable")


def kuhn_population(
    opponents: Mapping[str, float] = KUHN_TRAINING_POOL, seats: Iterable[int] = (0, 1)
) -> list[KuhnMetaEpisode]:
    """Every deal x seat x opponent weighted by the pool ratio: the expectation over the task distribution."""
    seats = tuple(seats)
    return [
        KuhnMetaEpisode(seed=seed, seat=seat, opponent=name, weight=ratio / (6 * len(seats)))
        for seed in sorted(_deal_seeds().values())
        for seat in seats
        for name, ratio in opponents.items()
    ]


if __name__ == "__main__":
    import json

    print(json.dumps(kuhn_oracle(kuhn_population(), num_episodes=3).summary(), indent=1))
