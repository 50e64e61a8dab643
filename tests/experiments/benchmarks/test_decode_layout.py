"""The decode-layout benchmark decodes the same random model with its blocks unrolled and scanned, checks
the greedy tokens agree, and reports each layout's decode rate and their ratio."""

import json

import pytest

from experiments.benchmarks.decode_layout import main


@pytest.mark.parametrize("path", ["sampler", "engine"])
def test_both_layouts_decode_the_same_tokens_and_their_rates_are_compared(tmp_path, path):
    out = tmp_path / "decode_layout.json"
    report = main(["--layers", "2", "--vocab", "64", "--batch", "2", "--prompt-len", "8", "--new-tokens", "4",
                   "--repeats", "2", "--path", path, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["greedy_identical"] is True
    assert (report["path"], report["layers"], report["vocab"], report["new_tokens"]) == (path, 2, 64, 4)
    rates = report["decode_tokens_per_s"]
    assert set(rates) == {"unrolled", "scanned"} and all(r is None or r["min"] > 0 for r in rates.values())
    assert set(report["warmup_s"]) == {"unrolled", "scanned"}
    per_repeat = report["scanned_over_unrolled_per_repeat"]
    assert len(per_repeat) <= 2 and all(r > 0 for r in per_repeat)
    assert set(report["load_average"]) == {"before", "after"}
