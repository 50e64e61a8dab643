"""The depth benchmark compiles a preset's generation programs at several depths in both block layouts
and reports compile seconds, the deep / shallow ratio and issue 28's 2x target for the scanned layout."""

import json

from experiments.benchmarks.compile_depth import main


def test_compile_seconds_of_each_program_at_each_depth_and_layout(tmp_path):
    out = tmp_path / "compile_depth.json"
    narrow = 'model.overrides={"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_kv_heads": 1}'
    report = main(["--preset", "tiny", "--depths", "2", "1", "--layouts", "scanned", "--set", narrow,
                   "--out", str(out)])  # the unrolled layout is the same code with scan_layers false
    assert json.loads(out.read_text()) == report
    assert report["depths"] == [1, 2] and set(report["results"]) == {"scanned"}
    for layout, runs in report["results"].items():
        assert [r["depth"] for r in runs] == [1, 2]
        assert runs[1]["params"] > runs[0]["params"]  # the depth is really there
        for r in runs:
            assert set(r["compile_s"]) == {"insert", "decode"} and all(s > 0 for s in r["compile_s"].values())
            assert r["build_s"] >= 0
        ratios = report["deep_over_shallow"][layout]
        assert ratios == {k: round(runs[1]["compile_s"][k] / runs[0]["compile_s"][k], 2) for k in ratios}
    assert report["target"]["scanned_deep_within_2x_of_shallow"] == {
        k: v <= 2.0 for k, v in report["deep_over_shallow"]["scanned"].items()}
    assert set(report["load_average"]) == {"before", "after"}
