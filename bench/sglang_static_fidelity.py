"""sglang's static (AST) parser against its real one, for one release: option strings, action
count, dest/nargs/required/type/const/action class/choices of every option, the verdict of
every abbreviation (each prefix of 4+ characters of every long option), and value acceptance
(six sample values per option).

Run it with a python where `import sglang.srt.server_args` works for that release, e.g. the
tests' cached release venvs (~/.cache/servops-tests/sglang-X-real-*), or another release's wheel
unpacked on PYTHONPATH in front of one of them (plus whatever it also imports: fastapi,
xgrammar, opentelemetry for 0.4.10-0.5.6):

    ~/.cache/servops-tests/sglang-0.5.23-real-*/bin/python bench/sglang_static_fidelity.py
    PYTHONPATH=/tmp/real/0.5.4:/tmp/deps ~/.cache/servops-tests/sglang-0.5.15-real-*/bin/python \\
        bench/sglang_static_fidelity.py

Prints one JSON object; differences other than choices flagged run-time (unchecked) are gaps.
"""

import argparse
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "servops", "remote"))
import sglang_args as sa  # noqa: E402


def table(p):
    d = {}
    for o, a in p._option_string_actions.items():
        cls = getattr(a, "servops_class", None) or type(a).__name__
        d[o] = dict(dest=a.dest, nargs=a.nargs, required=a.required,
                    choices=sorted(map(str, a.choices)) if a.choices is not None else None,
                    type=getattr(a.type, "__name__", None) if a.type is not None else None, cls=cls,
                    const=None if getattr(a, "servops_class", None) else repr(a.const))
    return d


def same_class(real, static):
    # sglang's DeprecatedAction vs the static StaticAction carrying its name; argparse's
    # _StoreTrueAction vs "store_true"
    return real == static or real.lstrip("_").lower().replace("action", "") == str(static).replace("_", "")


def main():
    pkg = sa.sglang_package()
    try:
        real = sa.real_parser(pkg)
    except BaseException as exc:
        print(json.dumps({"pkg": pkg, "error": sa._one_line(exc)}))
        return
    static = sa.static_parser(pkg)
    R, S = table(real), table(static)
    out = {"version": sa.sglang_version(pkg), "actions": [len(real._actions), len(static._actions)],
           "only_real": sorted(set(R) - set(S)), "only_static": sorted(set(S) - set(R)), "fields": {},
           "unchecked": static.servops_unchecked, "skipped": static.servops_skipped}
    for o in sorted(set(R) & set(S)):
        for k, rv in R[o].items():
            sv = S[o][k]
            if (k == "const" and sv is None) or (k == "type" and (sv == rv or (sv is None and rv in (None, "str")))) \
                    or (k == "cls" and same_class(rv, sv)):
                continue
            if rv != sv and not (k == "choices" and sv is None and o in static.servops_unchecked):
                out["fields"].setdefault(o, {})[k] = [rv, sv]
    longs = sorted(o for o in R if o.startswith("--"))
    prefixes = sorted(set(o[:i] for o in longs for i in range(4, len(o))))
    out["abbreviations"] = len(prefixes)
    out["abbreviation_mismatches"] = [[x, sa._lookup(real, x)[0], sa._lookup(static, x)[0]] for x in prefixes
                                      if sa._lookup(real, x)[0] != sa._lookup(static, x)[0]][:20]
    mism = []
    for o in longs:
        if o not in S:
            continue
        for sample in ("1", "1.5", "abc", "true", "-1", '{"a": 1}'):
            res = []
            for p in (real, static):
                act = p._option_string_actions[o]
                if act.nargs == 0:
                    res.append("flag")
                    continue
                try:
                    p._get_values(act, [sample] if act.nargs not in (None, "?") else sample)
                    res.append("ok")
                except (argparse.ArgumentError, TypeError, ValueError, Exception):
                    res.append("err")
            if res[0] != res[1] and o not in static.servops_unchecked:
                mism.append([o, sample] + res)
    out["value_mismatches"] = mism[:20]
    out["same"] = not (out["only_real"] or out["only_static"] or out["fields"] or out["abbreviation_mismatches"]
                       or mism or out["actions"][0] != out["actions"][1])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
