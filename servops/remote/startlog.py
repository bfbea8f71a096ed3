# A server's start-up split into its phases, read from the engine's own log lines (sglang's and
# vLLM's, and FlashInfer's and DeepGEMM's JIT lines in either). Stdlib only: deploy_ctl includes
# it on the host (the health gate reads the phases off the lines it already holds), and servops
# imports it locally (tune, the tests, bench/).
#
# The phases, in seconds; a phase the log does not show is left out (never a guessed 0):
#   weights_s   loading the weights     sglang "Load weight end. elapsed=X s" (0.5.1x; older: the
#                                       begin/end lines' timestamps), which holds the "Loading
#                                       weights took" 0.5.x prints too; vLLM "Model loading took .. GiB
#                                       and X seconds", else its "Initializing model took" and
#                                       "Loading weights took X seconds"
#   jit_s       JIT kernel builds       FlashInfer "Loading JIT ops: M" .. "Finished loading JIT
#                                       ops: M" (0.2.x) or "Building JIT module M" (0.6+), DeepGEMM
#                                       "Entering DeepGEMM JIT Pre-Compile session" / "Try DeepGEMM JIT
#                                       Compiling for ..." (sglang): each to the log's next record
#   compile_s   torch.compile           sglang "Compiling a graph for (dynamic shape|shape N) takes X
#                                       s" (piecewise; inside its prefill capture, so taken out of
#                                       capture_s); vLLM "torch.compile takes|took X s in total",
#                                       else its parts (dynamo's transform, each graph's compile
#                                       or cache load); its CPU runner's "Warming up model for the
#                                       compilation..." to "Warming up done."
#   capture_s   CUDA-graph capture      sglang "Capture <role> <phase> CUDA graph end. elapsed=X s"
#                                       (0.5.14+; a draft's per step too), "Capture (draft |
#                                       piecewise )cuda graph end. Time elapsed: X s" (older); vLLM
#                                       "Graph capturing finished in X secs"
#   other_s     the rest of start to healthy (imports, process start, KV cache, the server's own
#               warm-up request), when the total is known
# Several ranks (sglang's "[... TP1]", vLLM's "(Worker_TP1 pid=..)"): each phase is summed per
# rank and the slowest rank's sum is taken.
import calendar as _calendar
import re as _re
import time as _time

START_PHASES = ("weights_s", "jit_s", "compile_s", "capture_s")
# A log can lie (a clock stepped back, a line from another program, a number a bug printed): a
# phase or a total outside 0..MAX_PHASE_S (a week) is not a time this start spent; it is left out.
MAX_PHASE_S = 7 * 24 * 3600.0
MAX_LINE_CHARS = 4096

_SGLANG_TS = _re.compile(r"^\s*(?:\([^)]*\) )?\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?: ([^\]]*))?\]")
_ASCTIME = _re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - [A-Z]+ - ")
_VLLM_TS = _re.compile(r"^\s*(?:\((\S+) pid=\d+\) )*(?:INFO|WARNING|DEBUG|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d) ")
_VLLM_RANK = _re.compile(r"\((?:Worker_)?(\S*TP\d+)\S* pid=\d+\)")

# A number of seconds as the engines print it (12, 12.5): "1.2.3" or "." is none
_SECS = r"(\d{1,12}(?:\.\d{1,9})?)(?![\d.])"
# (phase, level, regex with the seconds as group 1): a phase the line states itself. A phase
# some engines state twice, as its parts and as a whole that holds them, has two levels: each
# level is added up on its own, and the phase is the larger (never parts plus whole):
#   vLLM's "Model loading took" and sglang's "Load weight end. elapsed=" hold the loader's
#   "Initializing model took" / "Loading weights took";
#   vLLM's "torch.compile takes|took X s in total" (older: "graph compilation takes") and
#   "init engine ... (compilation: X s)" hold its "Dynamo bytecode transform time", each
#   "Compiling a graph for ... takes" and "Directly load the compiled graph(s) ... took". That
#   whole is a "total": cumulative where a draft model compiles too (5.71 s, then 6.25 s), so
#   its level keeps the largest, not the sum.
_VALUES = (
    # sglang 0.5.x prints vLLM's loader line too: its "Load weight end. elapsed=" holds it
    ("weights_s", "whole", _re.compile(r"Load weight end\. elapsed=%s s" % _SECS)),
    ("weights_s", "part", _re.compile(r"Loading weights took %s seconds" % _SECS)),
    ("weights_s", "part", _re.compile(r"Initializing model took %s seconds" % _SECS)),  # vLLM 0.2x+: before its weights
    ("weights_s", "whole", _re.compile(r"Model loading took [0-9.]+ ?GiB(?: memory)? and %s seconds" % _SECS)),
    # 0.5.14+: "Capture target decode CUDA graph end.", "Capture draft extend CUDA graph end. step=2,"
    # (each step its own), "Capture single-CG draft extend end.", "Capture target decode NPU graph end."
    ("capture_s", "part", _re.compile(r"Capture [\w-]+(?: [\w-]+){1,4} end\. (?:step=\d+, )?elapsed=%s s" % _SECS)),
    ("capture_s", "part", _re.compile(r"Capture (?:[\w-]+ ){0,3}(?:cuda|CUDA) graph end\. Time elapsed: %s s" % _SECS)),
    ("capture_s", "part", _re.compile(r"Graph capturing finished in %s secs?" % _SECS)),
    ("compile_s", "part", _re.compile(r"Compiling a graph for (?:dynamic shape|general shape|shape \S+|"
                                      r"compile range \([^)]{0,64}\)) takes %s s" % _SECS)),
    ("compile_s", "part", _re.compile(r"Dynamo bytecode transform time: %s s" % _SECS)),
    ("compile_s", "part", _re.compile(r"Directly load the compiled graph\(s\) for .{0,200}? took %s s" % _SECS)),
    ("compile_s", "total", _re.compile(r"(?:torch\.compile|graph compilation) (?:takes|took) %s s in total" % _SECS)),
    ("compile_s", "total", _re.compile(r"init engine \(.{0,80}\) took [0-9.]+ s(?:econds)? \(compilation: %s s\)"
                                       % _SECS)),
)
# sglang's piecewise compile runs within its prefill capture: taken out of capture_s (vLLM
# compiles before it captures)
_COMPILE_IN_CAPTURE = "Compiling a graph for"
_WEIGHTS_BEGIN = _re.compile(r"Load weight begin\b")
_WEIGHTS_END = _re.compile(r"Load weight end\.")
# vLLM's CPU runner times its compile by two lines, "Warming up model for the compilation..." and
# "Warming up done." (0.32: dynamo traced once, inductor); nothing between them states a time
_CPU_COMPILE_BEGIN = _re.compile(r"Warming up model for the compilation\b")
_CPU_COMPILE_END = _re.compile(r"\] Warming up done\.")
_JIT_PAIR = _re.compile(r"flashinfer\.jit: (Finished loading|Loading) JIT ops: (\S+)")
_JIT_ONE = _re.compile(r"Building JIT module (\S+?);|Entering DeepGEMM JIT Pre-Compile session|"
                       r"Try DeepGEMM JIT Compiling for")


def log_stamp(line):
    """(seconds, rank) of a log record's own timestamp, or None for a line that is not one (a
    progress bar, a traceback line). The clock is the log's: only differences are meaningful."""
    m = _SGLANG_TS.match(line)
    if m:
        t = _seconds_of(m.group(1))
        return None if t is None else (t, _log_rank(m.group(2) or ""))
    m = _VLLM_TS.match(line)
    if m:
        rank = _VLLM_RANK.search(line)
        t = _seconds_of("2000-" + m.group(2))
        return None if t is None else (t, rank.group(1) if rank else "")
    m = _ASCTIME.search(line)
    if m:
        rank = _VLLM_RANK.search(line[:m.start()])
        t = _seconds_of(m.group(1))
        return None if t is None else (t + int(m.group(2)) / 1000.0, rank.group(1) if rank else "")
    return None


def _seconds_of(stamp):
    """A "YYYY-MM-DD HH:MM:SS" stamp as seconds; None for one no clock shows (month 13, Feb 30)."""
    try:
        return _calendar.timegm(_time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return None


def _plausible(seconds):
    return seconds is not None and seconds == seconds and 0 <= seconds <= MAX_PHASE_S


def _log_rank(tag):
    """sglang's "DP0 TP1" -> "TP1" (the ranks of one node: TP, with DP/PP/EP before it)."""
    words = tag.split()
    return " ".join(w for w in words if w[:2] in ("TP", "DP", "PP", "EP"))


def start_phases(lines, total=None):
    """{weights_s, jit_s, compile_s, capture_s, other_s, start_s} from a start's log lines (only
    this start's), `total` the start to healthy as the gate measured it. A phase the log does
    not show is not in the result; other_s is the total less the phases shown (with a total)."""
    per_rank = {}   # rank -> phase -> seconds
    inside = {}     # rank -> seconds of compile inside capture
    jit_open = {}   # (rank, module) -> its "Loading JIT ops" time
    jit_pending = None  # (rank, time) of a one-line JIT record, ended by the next record
    weights_begin = {}
    compile_begin = {}  # rank -> vLLM's CPU compile warm-up began
    last_time = None
    for raw in lines:
        line = raw.rstrip("\n")
        # a progress bar rewrites one line with CRs, and a record may follow on it
        for part in line.split("\r") if "\r" in line else (line,):
            part = part[:MAX_LINE_CHARS]  # a record's stamp and phase come first; a 50 MB line is not read whole
            st = log_stamp(part)
            if st is None:
                continue
            t, rank = st
            last_time = t
            got = per_rank.setdefault(rank, {})
            if jit_pending is not None:
                _phase_add(per_rank.setdefault(jit_pending[0], {}), ("jit_s", "part"), max(0.0, t - jit_pending[1]))
                jit_pending = None
            for key, level, rx in _VALUES:
                m = rx.search(part)
                if m:
                    _phase_add(got, (key, level), float(m.group(1)))
                    if _COMPILE_IN_CAPTURE in part and _SGLANG_TS.match(part):
                        inside[rank] = inside.get(rank, 0.0) + float(m.group(1))
            if _CPU_COMPILE_BEGIN.search(part):
                compile_begin[rank] = t
            elif _CPU_COMPILE_END.search(part) and rank in compile_begin:
                _phase_add(got, ("compile_s", "part"), t - compile_begin.pop(rank))
            if _WEIGHTS_BEGIN.search(part):
                weights_begin[rank] = t
            elif _WEIGHTS_END.search(part) and "elapsed=" not in part and rank in weights_begin:
                _phase_add(got, ("weights_s", "whole"), t - weights_begin.pop(rank))  # (a clock stepped back: left out)
            m = _JIT_PAIR.search(part)
            if m:
                if m.group(1) == "Loading":
                    jit_open.setdefault((rank, m.group(2)), t)
                elif (rank, m.group(2)) in jit_open:
                    _phase_add(got, ("jit_s", "part"), t - jit_open.pop((rank, m.group(2))))
            elif _JIT_ONE.search(part):
                jit_pending = (rank, t)
    if jit_pending is not None and last_time is not None:  # a build still running at the log's end
        _phase_add(per_rank.setdefault(jit_pending[0], {}), ("jit_s", "part"), max(0.0, last_time - jit_pending[1]))
    for (rank, _m), t in jit_open.items():
        _phase_add(per_rank.setdefault(rank, {}), ("jit_s", "part"), max(0.0, (last_time or t) - t))
    phases = {rank: _by_phase(levels) for rank, levels in per_rank.items()}
    for rank, secs in inside.items():
        got = phases[rank]
        if "capture_s" in got:
            got["capture_s"] = max(0.0, got["capture_s"] - secs)
    out = {}
    for key in START_PHASES:
        seen = [r[key] for r in phases.values() if _plausible(r.get(key))]
        if seen:
            out[key] = round(max(seen), 2)
    total = _total_of(total)
    if total is not None:
        # a phase longer than the whole start (20,000 JIT builds "still running" summed) is not one
        out = {key: value for key, value in out.items() if value <= total + 1.0}
        shown = sum(out.values())
        out["start_s"] = round(total, 2)
        out["other_s"] = round(max(0.0, total - shown), 2)
    return out


def _total_of(total):
    try:
        total = float(total) if total is not None else None
    except (TypeError, ValueError):
        return None
    return total if _plausible(total) else None


def _by_phase(levels):
    """{phase: seconds} of one rank's {(phase, level): seconds}: the larger level (a whole holds
    its parts); a level marked unknown makes the phase unknown."""
    out = {}
    for (key, _level), seconds in levels.items():
        known = out.get(key, 0.0)
        out[key] = float("nan") if seconds != seconds or known != known else max(known, seconds)
    return out


def _phase_add(got, key, seconds):
    """A phase's seconds added to its (phase, level); a "total" level's lines are cumulative, so its
    largest is kept. A negative part (its end logged before its start) or one past MAX_PHASE_S
    spoils the phase: it is marked unknown (NaN), never summed into a plausible one."""
    if not 0 <= seconds <= MAX_PHASE_S:
        seconds = float("nan")
    known = got.get(key, 0.0)
    # NaN stays: known + NaN is NaN, and max(NaN, x) keeps the NaN it starts from
    got[key] = max(known, seconds) if key[1] == "total" and seconds == seconds else known + seconds
