"""The generic config machinery works on any tree of typed frozen dataclasses, not only the experiment's."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from mage_jax import configtools as T


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = 0.5
    """How fast."""
    mode: Literal["a", "b"] = "a"


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = "x"
    sizes: tuple[int, ...] = (1, 2)
    limit: int | None = None
    inner: Inner = Inner()


def test_overrides_are_parsed_by_field_type_in_nested_sections():
    overrides = {"inner.rate": "1e-3", "sizes": "3,4", "limit": "none", "inner.mode": "b"}
    cfg = T.apply_overrides(Outer(), overrides)
    assert cfg == Outer(sizes=(3, 4), limit=None, inner=Inner(rate=1e-3, mode="b"))
    assert T.get_key(cfg, "inner.rate") == 1e-3


@pytest.mark.parametrize("overrides, fragment", [
    ({"inner.speed": "1"}, "unknown config key 'inner.speed'"),
    ({"limit": "many"}, "limit: expected int, got 'many'"),
    ({"inner.mode": "c"}, "inner.mode must be one of a, b"),
    ({"inner": "1"}, "inner is a section"),
])
def test_a_bad_override_is_one_config_error_naming_the_key(overrides, fragment):
    with pytest.raises(T.ConfigError, match=fragment.replace(".", r"\.")):
        T.apply_overrides(Outer(), overrides)


def test_keys_are_listed_with_type_default_and_field_docstring():
    assert T.all_keys(Outer) == ["name", "sizes", "limit", "inner.rate", "inner.mode"]
    rate = {info.key: info for info in T.describe_keys(Outer)}["inner.rate"]
    assert (rate.type_name, rate.default, rate.doc) == ("float", 0.5, "How fast.")


def test_a_dict_round_trips_and_the_generic_checks_name_the_key():
    cfg = Outer(sizes=(5,), inner=Inner(rate=2.0))
    assert T.from_dict(Outer, T.to_dict(cfg)) == cfg
    with pytest.raises(T.ConfigError, match="inner.rate must be a finite number"):
        T.check_finite(Outer(inner=Inner(rate=float("nan"))))
    with pytest.raises(T.ConfigError, match="inner.mode must be one of a, b"):
        T.check_choices(Outer(inner=Inner(mode="z")))


@pytest.mark.parametrize("key, hint", [
    ("rate", "inner.rate"),  # the same name in another section
    ("inner.rte", "inner.rate"),  # a misspelling
    ("outer.mode", "inner.mode"),
    ("inner.sizes", "sizes"),
])
def test_an_unknown_key_names_the_closest_key_of_any_section(key, hint):
    with pytest.raises(T.ConfigError, match=rf"^unknown config key '{key}' .*; did you mean '{hint}'\?$"):
        T.apply_overrides(Outer(), {key: "1"})


def test_an_unknown_key_with_nothing_close_gets_no_guess():
    with pytest.raises(T.ConfigError) as err:
        T.apply_overrides(Outer(), {"inner.zzz": "1"})
    assert "did you mean" not in str(err.value)
