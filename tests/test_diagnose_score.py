"""The figures the README states for diagnose, recomputed on the real logs (tests/diagnose_score.py):
today every failure log is found (exit 1) and read to its root; a category is shown where a known
issue or evidence above the held-out threshold names it, and at most 1 in 20 shown is wrong; no
healthy log reports anything."""

import pytest

from diagnose_score import manifests, score


def test_every_real_failure_is_found_named_and_read_to_its_root():
    failures, healthy = manifests()
    s = score(failures, healthy)
    assert s["failures"] == len(failures) >= 320 and s["healthy"] == len(healthy) >= 80
    # every failure is found and exits 1, every root is the thread's, no healthy log says anything
    assert s["found"] == s["failures"] and s["right_root"] == s["with_root"] >= 240
    assert s["wrong_match"] == 0 and s["false_alarms"] == 0
    # a category is shown only above the threshold the held-out logs chose: of those shown, at most
    # 1 in 20 wrong (here 1 of 273: an MXFP4 MoE with no backend on GB200, config read as
    # quantization); the rest is uncategorised, neither right nor wrong. (The model learned from
    # these logs but the held-out batch: a training figure; tests/diagnose_score.py --kfold gives
    # the held-out one.)
    assert (s["right_category"], s["wrong_shown"], s["shown"], s["uncategorised"], s["with_category"]) == (272, 1, 273, 19, 292)
    assert s["wrong_shown"] * 20 <= s["shown"]


# Each blind batch today: (failures, healthy logs, (found, right category, logs with a category,
# wrong of the categories shown, right root, logs with a root)). A category counts only where it
# is shown (a known issue's, or the evidence's above the threshold). What each showed before its
# fixes, on the code with the batches before it, is in the commit that added it and in the README:
# blind-22 22/24 found, 16/23 category, 18/22 root; blind-1206 21/23, 11/23, 16/18 (3 wrong
# matches); blind2-1206 21/21, 15/19, 15/18; blind3-1206 (SGLang) 14/15, 5/15, 9/11; blind4-1206
# 15/15, 8/13, 12/12 (1 wrong match); blind5-1206 13/14, 7/14, 7/9; blind6-1206 18/18, 2/9, 14/15
# (2 wrong matches); blind7-h47 (held out: never learned from nor fixed against) 19/19, 14/19 with
# 5 of 19 evidence categories wrong, 12/12, 9 of its failures exiting 0. (11/19 right on the code of
# issue 47; 10/19 since the model was learned again with the two table logs of issue 47 item 5,
# which moved the k-fold's threshold from 0.86 to 0.87: one of its categories, 0.86, now uncategorised;
# the same at 0.66, the threshold since blind8-h49 was learned.) blind8-h49 20/20 found,
# 9/18 category with 2 of 11 shown wrong and 7 uncategorised, 11/12 root, 2 of 6 healthy logs flagged.
BLIND_BATCHES = {
    "blind-22": (24, 9, (24, 23, 23, 0, 22, 22)),
    "blind-1206": (23, 8, (23, 21, 23, 0, 18, 18)),
    "blind2-1206": (21, 6, (21, 19, 19, 0, 18, 18)),
    "blind3-1206": (15, 5, (15, 14, 15, 0, 11, 11)),
    "blind4-1206": (15, 6, (15, 12, 13, 0, 12, 12)),
    "blind5-1206": (14, 6, (14, 11, 14, 0, 9, 9)),
    "blind6-1206": (18, 4, (18, 7, 9, 1, 15, 15)),
    "blind7-h47": (19, 6, (19, 10, 19, 0, 12, 12)),
    "blind8-h49": (20, 6, (20, 17, 18, 0, 12, 12)),
}


@pytest.mark.parametrize("batch", list(BLIND_BATCHES))
def test_each_blind_batch_is_counted_apart(batch):
    n_failures, n_healthy, figures = BLIND_BATCHES[batch]
    failures, healthy = manifests(batch)
    assert len(failures) == n_failures and len(healthy) == n_healthy
    s = score(failures, healthy)
    assert (s["found"], s["right_category"], s["with_category"], s["wrong_shown"], s["right_root"], s["with_root"]) == figures
    assert s["wrong_match"] == 0 and s["false_alarms"] == 0
