"""The figures the README states for diagnose, recomputed on the real logs (tests/diagnose_score.py):
today every failure log is found, named in its category and read to its root (but one whose
excerpt stops before anything names the cause); no healthy log reports anything."""

from diagnose_score import manifests, score


def test_every_real_failure_is_found_named_and_read_to_its_root():
    failures, healthy = manifests()
    s = score(failures, healthy)
    assert s["failures"] == len(failures) >= 180 and s["healthy"] == len(healthy) >= 35
    assert s["found"] == s["failures"]
    # the port was taken, but the paste stops in a frame line, before the OSError says so
    assert s["missed"] == ["openhands-680-interleaved-chars-bind.log"]
    assert s["right_category"] == s["with_category"] - 1 >= 140
    assert s["right_root"] == s["with_root"] >= 130
    assert s["wrong_match"] == 0 and s["false_alarms"] == 0


def test_the_blind_batch_is_counted_apart():
    failures, healthy = manifests("blind-22")
    assert len(failures) == 24 and len(healthy) == 9
    s = score(failures, healthy)
    assert (s["found"], s["right_category"], s["with_category"], s["right_root"], s["with_root"]) == (24, 22, 23, 22, 22)
    assert s["wrong_match"] == 0 and s["false_alarms"] == 0
