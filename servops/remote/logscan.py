# Log normalisation for diagnose. Standard library only: it runs locally (`--offline`) and on the
# host inside the diagnose program (shipped before tracebacks.py).
#
# Real server logs prefix every line, and differently per tool: SGLang's `[2025-.. TP3] `, vLLM's
# `(Worker_TP2 pid=99) ERROR 06-26 23:10:17 [multiproc_executor.py:527] `, Ray's
# `(SGLangEngine pid=952, ip=10.0.0.1) `, torchrun's `[rank0]:`, Kubernetes CRI
# `2025-..+08:00 stdout F `, docker compose `sglang-1  | `, journald, CI timestamps, ANSI colours,
# CR line ends, a paste that double-spaced every line, JSON records (docker's json-file driver,
# TGI's --json-output: read as their level and message). normalise() strips them, learns unknown
# leading tags from the lines that carry a Traceback header or an error, and says which
# rank/process each line came from so multi-rank logs can be read one stream at a time.
import re as _re

_ANSI = _re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
# A colour code whose ESC was lost in a copy/paste shows up as `[36m`, `←[0m`, `^[[0m`, or with a
# space where the ESC was (` [36m(RayWorker pid=1) [0m `): the space goes with the code.
_BARE_ANSI = _re.compile(r"(?:\^\[|←| )?\[(?:\d{1,3}(?:;\d{1,3})*)?m")
_BARE_ANSI_START = _re.compile(r" ?\[\d{1,3}(?:;\d{1,3})*m")
# What a paste or a viewer puts in front of every line: markdown quote marks (`> `), CI viewers'
# line gutters (`  | `), box-drawing frames (`│ ... │`). Each mark takes one space with it, so the
# indentation of what follows is kept.
_GUTTER = _re.compile(r"(?:[ \t]*[>|│┃](?= |$) ?)+")
_GUTTER_END = _re.compile(r"[ \t]+[│┃][ \t]*$")
# Markdown left in a pasted log: a code fence line, or one inline-code backtick at an end.
_FENCE = _re.compile(r"\s*```[\w+-]*\s*$")
_RAY_REPEAT = _re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
_LEVEL = r"(?:TRACE|DEBUG|INFO|NOTICE|WARN|WARNING|ERROR|CRITICAL|FATAL)"
_RANK_TOKEN = _re.compile(r"(?:^|[_\s])((?:ATTN_)?(?:DP|TP|PP|EP|CP|MOE_DP)\d+)(?=$|[_\s])")

# (name, regex, kind). kind "proc": a tag naming the process that wrote the line (every line of
# it carries one); "record": the header of one log record naming its rank (continuation lines
# carry none); "header": a record header that names no rank (level, time); "transport": a stamp
# the log collector put on every line (CRI, docker -t, CI).
_PREFIXES = [
    ("cri", _re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d) (?:stdout|stderr) [FP] ?"), "transport"),
    ("sglang", _re.compile(r"\[(?:\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d(?:[.,]\d+)?(?P<ranks>(?: (?:ATTN_)?(?:DP|TP|PP|EP|CP|MOE_DP)\d+)+)?\] ?"), "record"),
    ("sglang-gpu", _re.compile(r"\[gpu=(?P<gpu>\d+)\] ?"), "record"),
    ("proc", _re.compile(r"\((?P<name>[^()\n]{1,80}?),? pid=(?P<pid>\d+)(?:, ip=[^)\n]*)?\) ?"), "proc"),
    ("torchrun", _re.compile(r"\[(?:default)?rank(?P<rank>\d+)\]: ?"), "record"),
    ("iso-t", _re.compile(r"\[?\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?(?: |$)"), "transport"),
    ("iso", _re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?(?: |$)"), "header"),
    # glog (torch's C++ log, Mooncake): its first letter is the level (`[W ...]`, `E0414 ...`)
    ("glog", _re.compile(r"\[(?P<glevel>[EWIFD])(?:\d{3,4} \d\d:\d\d:\d\d\.\d+(?: \d+)?)? ?[\w.]+:\d+\] ?"), "header"),
    ("glog2", _re.compile(r"(?P<glevel>[EWIF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w./-]+:\d+\] ?"), "header"),
    ("vllm", _re.compile(r"(?P<level>" + _LEVEL + r") (?:\d{4}-)?\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? (?:\[[^\]\n]*\]|[\w.]+:\d+\]) ?"), "header"),
    ("level-ts", _re.compile(r"(?:\d\d-\d\d )?\d\d:\d\d:\d\d(?:[.,]\d+)? ?(?:(?P<level>" + _LEVEL + r")\b:? *)?"), "header"),
    # loguru `| ERROR    | module:fn:12 - `, and FastChat's `| ERROR | stderr | ` (a logger name
    # between bars)
    ("loguru", _re.compile(r"\| ?(?P<level>" + _LEVEL + r") *\| [^\s|]+ (?:- |\| ?)"), "header"),
    # (Rust's `tracing` right-aligns the level: ` INFO`, `ERROR`.)
    # (`ERROR (uvicorn.error):  `: a `%(levelname)s (%(name)s): ` format names the logger too; the
    # spaces after it beyond the format's own are the message's indentation.)
    ("level", _re.compile(r" ?(?P<level>" + _LEVEL + r"):? +(?:\([\w.-]{1,60}\):(?: {1,2}|\s*$)|(?=\S))"), "header"),
    # Rust `tracing` (SGLang's router, TGI's launcher): after the level, `span{fields}:span: ` and
    # the target, with its `file.rs:N: `, or a `crate::module: ` target.
    # (A paste may start inside the span list: `:infer:send_error: text_generation_router::infer: `.)
    # (TGI's shard manager: a span named with a hyphen and a bare target, `shard-manager: text_generation_launcher: `.)
    ("rust", _re.compile(r"(?::?(?:[A-Za-z_]\w*(?:\{[^{}\n]*\})?:)+ )?[a-z_][a-z0-9_]*(?:(?:::[a-z0-9_]+)*: [\w./-]+\.rs:\d+|(?:::[a-z0-9_]+)+): |"
                         r"[a-z][a-z0-9_]*-[\w-]*(?:\{[^{}\n]*\})?: [a-z]+(?:_[a-z0-9]+)+: "),
     "header"),
    ("compose", _re.compile(r"(?P<svc>[A-Za-z0-9][\w.-]*?[-_]\d+) +\| ?"), "proc"),
    ("journal", _re.compile(r"[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ (?P<prog>[\w.@/-]+?)(?:\[(?P<jpid>\d+)\])?: "), "proc"),
]
# Which prefixes can start with a given character (most lines start with none of them: this keeps
# a 16 MiB log to a few regex attempts per line).
_BY_FIRST = {}
for _name, _rx, _kind in _PREFIXES:
    _first = {"cri": "0123456789", "iso-t": "[0123456789", "iso": "0123456789", "level-ts": "0123456789",
              "sglang": "[", "sglang-gpu": "[", "torchrun": "[", "glog": "[", "proc": "(", "loguru": "|",
              "glog2": "EWIF", "vllm": "TDINWECF", "level": "TDINWECF ", "rust": "abcdefghijklmnopqrstuvwxyz_:",
              "journal": "JFMASOND"}.get(_name)
    for _c in (_first or "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"):
        _BY_FIRST.setdefault(_c, []).append((_name, _rx, _kind))
# (glog's W/I/D stay letters: torch's C++ warns `[W socket.cpp] ... Address already in use` just
# before it fails, so those lines are evidence; a Traceback logged at W or I is no failure.)
_GLOG_LEVELS = {"E": "ERROR", "F": "FATAL", "W": "W", "I": "I", "D": "D"}
# Headers that open a new log record: what follows them is not the continuation of a message.
_NEW_RECORD = {"sglang", "sglang-gpu", "glog", "glog2"}
_LEARN_ANCHOR = _re.compile(
    r"Traceback \(most recent call last\)|terminate called|Fatal Python error|File \"[^\"]+\", line \d+|what\(\): |frame #\d+: |"
    r"(?:^|\s)(?:[A-Za-z_][\w]*\.)*(?=[A-Z])\w*(?:Error|Exception|Unsupported|OutOfResources)(?::|$)|"
    # a Rust panic (SGLang's router, TGI's launcher) under a wrapper's tag: `[SGLang LOG] thread 'x' panicked at`
    r"thread '[^'\n]*' panicked at\b")
_ANCHOR_WORDS = ("Traceback", "terminate", "Fatal", "File \"", "Error", "Exception", "Unsupported", "OutOfResources",
                 "what():", "frame #", "panicked at")
_UNKNOWN_TAG = _re.compile(r"(?:\[[^\]\n]{1,40}\]|\([^)\n]{1,60}\)|<[^>\n]{1,40}>) ?")


# A request the server logs (vLLM's "Received request ...: prompt: '...'", SGLang's "Receive:
# obj=GenerateReqInput(text='...')" and "Finish: ... out={'text': '...'}") is data: a user's
# prompt may quote a traceback, an error or a crash, in escaped newlines or over several lines,
# and none of it is the server's failure. The quoted value is left out of the line, up to its
# closing quote (a quote mark followed by a comma, a bracket or the line's end), on this line or
# on the unprefixed lines after it.
_REQUEST_LOG = _re.compile(r"Received request|Receive: obj=|Finish: obj=|Added request|[Ll]ogging request|"
                           r"[Rr]equest (?:received|details)\b")
_DATA_FIELD = _re.compile(r"\b(?:prompt|text|content|messages|input|inputs|output|outputs|response|completion|"
                          r"generated_text)['\"]?\s*[:=]\s*\[?\{?(?P<q>['\"])")
_DATA_CLOSE = _re.compile(r"\s*(?:[,)\]}]|$)")  # what follows the quote mark that closes a logged value


class Line(object):
    """One log line without its prefixes. `stream`: the rank/process it came from ("" = main);
    `level`: the log level its header gave; `new_record`: the header that opened a new log record
    on this line (None: the line continues a record)."""

    __slots__ = ("no", "text", "stream", "rank", "level", "new_record")

    def __init__(self, no, text, stream="", rank="", level=None, new_record=None):
        self.no, self.text, self.stream, self.rank = no, text, stream, rank
        self.level, self.new_record = level, new_record

    def __repr__(self):
        return "Line(%d, %r, stream=%r)" % (self.no, self.text, self.stream)


# A structured log line (TGI's --json-output, docker's json-file driver, JSON loggers): its
# message, with the record's level in front where it names one (cut pastes leave it unclosed).
_JSON_MSG = _re.compile(r'"(?:message|msg|log)"\s*:\s*"((?:[^"\\]|\\.)*)')
_JSON_LEVEL = _re.compile(r'"(?:level|levelname|severity)"\s*:\s*"([A-Za-z]+)"')
_JSON_ESC = _re.compile(r'\\(u[0-9a-fA-F]{4}|.)')
_JSON_CHARS = {"n": " ", "t": "\t", "r": "", "b": "", "f": ""}


def _json_line(line):
    m = _JSON_MSG.search(line)
    if not m:
        return line
    msg = _JSON_ESC.sub(lambda e: chr(int(e.group(1)[1:], 16)) if len(e.group(1)) == 5
                        else _JSON_CHARS.get(e.group(1), e.group(1)), m.group(1)).rstrip()
    lv = _JSON_LEVEL.search(line)
    return (lv.group(1).upper() + " " + msg) if lv else msg


def _clean(raw):
    line = raw
    if line.startswith('{"'):
        line = _json_line(line)
    if line.endswith("\r"):
        line = line.rstrip("\r")
    if line.endswith("^M"):
        line = line[:-2]
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "[0m" in line or "\u2190[" in line or "^[[" in line or (line[:2] in (" [", "[1", "[2", "[3", "[9")
                                                                and _BARE_ANSI_START.match(line)):
        line = _BARE_ANSI.sub("", line)
    if "across cluster]" in line:
        line = _RAY_REPEAT.sub("", line)
    first = line.lstrip(" \t")[:1]
    if first and first in ">|│┃":
        m = _GUTTER.match(line)
        if m and m.end():
            line = line[m.end():]
            if line.rstrip().endswith(("│", "┃")):
                line = _GUTTER_END.sub("", line)
    elif first == "`":
        if _FENCE.match(line):
            return ""
        if line.count("`") % 2:
            line = line.replace("`", "", 1)
        elif line.rstrip().endswith("`") and len(line.strip()) > 2:
            # a whole line pasted as inline code that has code spans of its own: `E: ... `x` ...`
            body = line.strip()
            line = line[:len(line) - len(line.lstrip())] + body[1:-1]
    elif first == '"' and line.rstrip().endswith('"') and line.count('"') == 2 and len(line.strip()) > 2:
        # a message quoted whole in prose: "CUDA error 209 at ...: no kernel image is available"
        body = line.strip()
        line = line[:len(line) - len(line.lstrip())] + body[1:-1]
    if line.endswith("`") and line.count("`") % 2:
        line = line[:-1]
    return line


def _rank_of_proc(name, pid):
    m = _re.search(r"\brank=(\d+)", name)
    if m:
        return "rank" + m.group(1)
    tokens = _RANK_TOKEN.findall(name.replace(" ", "_"))
    if tokens:
        return " ".join(tokens)
    return "%s pid=%s" % (name.strip(), pid)


def strip_prefixes(line, learned=()):
    """(text, tags): the line without its known prefixes; tags = [(name, kind, label, level, text)]."""
    tags = []
    text = line
    for _ in range(12):
        for rx in learned:
            m = rx.match(text)
            if m and m.end():
                text = text[m.end():]
                tags.append(("learned", "transport", None, None, m.group(0)))
                break
        else:
            for name, rx, kind in _BY_FIRST.get(text[:1], ()):
                m = rx.match(text)
                if not m or not m.end():
                    continue
                groups = m.groupdict()
                label = None
                if name == "proc":
                    label = _rank_of_proc(groups["name"], groups["pid"])
                elif name == "sglang":
                    label = (groups.get("ranks") or "").strip()
                elif name == "sglang-gpu":
                    label = "gpu" + groups["gpu"]
                elif name == "torchrun":
                    label = "rank" + groups["rank"]
                elif name == "compose":
                    label = groups["svc"]
                elif name == "journal":
                    label = groups["prog"] + ("[%s]" % groups["jpid"] if groups.get("jpid") else "")
                level = groups.get("level")
                if name[:4] == "glog":
                    level = _GLOG_LEVELS.get(groups["glevel"])
                tags.append((name, kind, label, level, m.group(0)))
                text = text[m.end():]
                break
            else:
                break
    return text, tags


def _generalise(tag):
    """A regex for an unknown leading tag: digits and hex generalised, the rest literal."""
    out = []
    for part in _re.split(r"(\d+)", tag):
        out.append(r"\d+" if part.isdigit() else _re.escape(part))
    return "".join(out)


# Text the runtime prints at the start of a line: what stands before it is a prefix.
_LINE_START_ANCHOR = _re.compile(r'File "[^"]+", line \d+|terminate called |Fatal Python error: |frame #\d+: |'
                                 r'Exception raised from |what\(\): ')


def learn_prefixes(raw_lines, limit=2000):
    """Prefixes no rule knows, learned from the lines that hold a frame, a Traceback header or an
    error, as regexes (digits generalised).

    A frame line shows its prefix exactly: whatever stands before `File "...", line N`
    (`... MODEL_LOG -   File`, `| ERROR | stderr |   File`); so do `terminate called`,
    `what():`, `frame #N:` and `Fatal Python error:`. Before a Traceback header or an exception
    line there may be a message instead (`Scheduler hit an exception: Traceback`): that text is
    a prefix only when the lines after it start with it too, or when it is a run of tags
    followed by a known prefix (`[VLLM LOG] (Worker_TP3 pid=1) ERROR ...`)."""
    learned = []
    seen = set()
    for k, raw in enumerate(raw_lines):
        if len(learned) >= 6 or limit <= 0:
            break
        if not any(w in raw for w in _ANCHOR_WORDS):
            continue
        if ("equest" in raw or "obj=" in raw) and _REQUEST_LOG.search(raw):
            continue  # a logged request: what it quotes is a user's text, never a prefix
        anchor = _LEARN_ANCHOR.search(raw)
        if not anchor:
            continue
        limit -= 1
        text, _ = strip_prefixes(_clean(raw), learned)
        rx = None
        start = _LINE_START_ANCHOR.search(text)
        if start and start.start() > 0:
            before = text[:start.start()].rstrip()
            if before and '"' not in before and len(before) <= 160:
                rx = _generalise(before) + r"\s?"
        if rx is None:
            m = _UNKNOWN_TAG.match(text)
            if m:
                after, tags = strip_prefixes(text[m.end():])
                if tags or _LEARN_ANCHOR.match(after.lstrip()):
                    rx = _generalise(m.group(0))
        if rx is None:
            a = _LEARN_ANCHOR.search(text)
            before = text[:a.start()] if a else ""
            if before.strip() and '"' not in before and len(before) <= 160:
                cand = _re.compile(_generalise(before.rstrip()) + r"\s?")
                following = [strip_prefixes(_clean(r), learned)[0] for r in raw_lines[k + 1:k + 9]]
                if sum(1 for f in following if cand.match(f)) >= 3:
                    rx = cand.pattern
        if rx is not None and rx not in seen:
            seen.add(rx)
            learned.append(_re.compile(rx))
    # An unknown tag in front of a known prefix on several lines (`[80746] [rank0]:[E321 ...] `, a
    # collector's line counter before torchrun's prefix) is a prefix too, whatever the line says.
    counts = {}
    for raw in raw_lines[:20000]:
        if len(learned) >= 6:
            break
        if raw[:1] not in "[(<":
            continue
        text = _clean(raw)
        m = _UNKNOWN_TAG.match(text)
        if not m or strip_prefixes(text, learned)[1]:
            continue
        if not strip_prefixes(text[m.end():])[1]:
            continue
        rx = _generalise(m.group(0))
        counts[rx] = counts.get(rx, 0) + 1
        if counts[rx] == 2 and rx not in seen:
            seen.add(rx)
            learned.append(_re.compile(rx))
    return learned


_FILE_IN_LINE = ' File "'


def _fold_separator(raw):
    """The per-line prefix a paste that lost its line breaks repeats inside one line: the text
    that stands before each of its `File "..."` frames, e.g. ` (SGLangWorker pid=38138)`."""
    first = raw.find(_FILE_IN_LINE)
    second = raw.find(_FILE_IN_LINE, first + 1) if first >= 0 else -1
    if second < 0:
        return None
    a, b = raw[:first], raw[:second]
    n = 0
    while n < len(a) and a[-1 - n] == b[-1 - n]:
        n += 1
    sep = a[len(a) - n:]
    sep = sep[sep.find(" "):] if " " in sep.strip() or sep.startswith(" ") else sep
    if len(sep.strip()) < 6 or raw.count(sep) < 3:
        return None
    return sep


def _unfold(raw, sep):
    """A line split again where the prefix `sep` repeats inside it."""
    parts = raw.split(sep)
    return ([parts[0]] if parts[0].strip() else []) + [sep.lstrip() + " " + p.strip() for p in parts[1:]]


# Lines a terminal wrapped (or a viewer cut at its width) and the piece it put on the next line,
# which carries no prefix of its own: a frame line cut in its path or before its line number or
# function (`File "/x/convert_frame.py", li` + `ne 715, in compile_inner`), `Exception raised
# from F at` + its C location, a dotted exception type cut at a dot (`torch._dynamo.exc.` +
# `Unsupported: ...`).
_FRAME_DONE = _re.compile(r'^\s*File "[^"]+", line \d+,? in \S')
_FRAME_CUT = _re.compile(r'^\s*File "')
_RAISED_CUT = _re.compile(r"Exception raised from \S+(?: at ?\S*)?$")
_RAISED_DONE = _re.compile(r"Exception raised from \S+ at \S+ \(most recent call first\):")
_MODULE_CUT = _re.compile(r"^\s*(?:[A-Za-z_]\w*\.)+$")
_TYPE_REST = _re.compile(r"^[A-Z]\w*(?::|$)")


def _rewrap(body, next_raw, learned):
    """`body` joined with the next raw line when that line is the rest a terminal wrapped off it."""
    nxt, tags = strip_prefixes(_clean(next_raw), learned)
    if tags or not nxt.strip():
        return None
    if _FRAME_CUT.match(body) and not _FRAME_DONE.match(body) and 'File "' not in nxt:
        quote_open = body.count('"') % 2 == 1
        joined = body.rstrip() + nxt.strip() if quote_open else body + nxt
        return joined if _FRAME_DONE.match(joined) else None
    if "Exception raised from" in body and _RAISED_CUT.search(body.rstrip()):
        joined = body + nxt if body.endswith(" ") or nxt.startswith(" ") else body + " " + nxt
        for cand in (joined, body.rstrip() + nxt.strip()):
            if _RAISED_DONE.search(cand):
                return cand
        return None
    if _MODULE_CUT.match(body) and _TYPE_REST.match(nxt):
        return body.rstrip() + nxt
    return None


_GUTTER_ONLY = _re.compile(r"^(?:[ \t]*>)+[ \t]*$")  # a blank line of a quoted paste


def _blank(raw):
    return not raw.strip() or bool(_GUTTER_ONLY.match(raw))


def _double_spaced(raw_lines):
    """Whether a paste put a blank line after every line (a web viewer's or an email client's
    copy, a CI console quoted line by line): then every single blank line is an artefact, and a
    run of 2k+1 stands for k."""
    if len(raw_lines) < 7:
        return False
    blanks = sum(1 for raw in raw_lines if _blank(raw))
    return blanks * 20 >= (len(raw_lines) - 1) * 7


def _undouble(raw_lines):
    """The lines of a double-spaced paste without its artefact blank lines, and their numbers."""
    out, numbers = [], []
    run = 0
    for no, raw in enumerate(raw_lines, 1):
        if _blank(raw):
            run += 1
            continue
        if run:
            keep = run // 2
            out.extend([""] * keep)
            numbers.extend(range(no - keep, no))
            run = 0
        out.append(raw)
        numbers.append(no)
    return out, numbers


_STAMP = _re.compile(r"(?:^|\s)(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?)")


def newest_first(raw_lines):
    """Whether the lines are in reverse order of time, as cloud log viewers show them (Google
    Cloud's Logs Explorer, some Kubernetes consoles): the time stamp near each line's start never
    rises from one line to the next and falls at least a few times."""
    stamps = []
    for raw in raw_lines[:5000]:
        m = _STAMP.search(raw[:80])
        if m:
            stamps.append(m.group(1).replace("T", " ").replace(",", "."))
    if len(stamps) < 5:
        return False
    falls = sum(1 for a, b in zip(stamps, stamps[1:]) if b < a)
    rises = sum(1 for a, b in zip(stamps, stamps[1:]) if b > a)
    return rises == 0 and falls >= 3


# A line is read by its first 16 KiB: what a failure says leads its line, and every pattern run
# over a line then costs at most as much as it does on 16 KiB (time linear in the log's size,
# whatever one line holds: a 50 MB line is read, never skipped).
MAX_LINE = 16384


def read_tail(fh, size, limit):
    """(bytes, cut): the last `limit` bytes of an open binary log of `size` bytes, from a line
    start. The line the cut falls in is read by its head (its first MAX_LINE bytes), never dropped:
    a log whose end is one huge line (`ERROR: RuntimeError: ...` over 50 MB) still shows its failure."""
    if size <= limit:
        return fh.read(), False
    cut = size - limit
    fh.seek(cut)
    data = fh.read(limit)
    first = data.find(b"\n")
    start = cut
    while start > 0:  # back to the start of the line the cut falls in, a block at a time
        step = min(start, 1 << 20)
        fh.seek(start - step)
        block = fh.read(step)
        at = block.rfind(b"\n")
        if at >= 0:
            start = start - step + at + 1
            break
        start -= step
    fh.seek(start)
    head = fh.read(min(MAX_LINE, size - start))
    rest = data[first + 1:] if first >= 0 else b""
    return (head if first < 0 or start + len(head) <= cut + first else head[:cut + first - start]) + b"\n" + rest, True


def _bounded(raw_lines):
    return [raw if len(raw) <= MAX_LINE else raw[:MAX_LINE] for raw in raw_lines]


# A terminal (or a viewer) that wrapped the log at its width: every long line split into rows of
# exactly that many characters, the rest on the next row with no prefix of its own. The width is
# the longest row's when it is a terminal's width and rows of it are common; such a row and the
# row after it are one line (unless that row opens a record of its own).
_WRAP_WIDTHS = (80, 100, 120, 132, 160, 200)


def _wrap_width(raw_lines):
    lengths = {}
    for raw in raw_lines[:20000]:
        n = len(raw.rstrip("\r"))
        lengths[n] = lengths.get(n, 0) + 1
    width = max(lengths) if lengths else 0
    rows = sum(lengths.values())
    if width not in _WRAP_WIDTHS or lengths[width] < max(2, rows // 50):
        return None
    full = [raw for raw in raw_lines[:20000] if len(raw.rstrip("\r")) == width and not _drawn_row(raw)]
    # (rows of one repeated character are a separator drawn at the terminal's width, not a wrap)
    return width if any(len(set(raw.strip())) > 2 for raw in full) else None


def _unwrap(raw_lines, numbers, width, learned):
    out, renumbered = [], []
    k = 0
    while k < len(raw_lines):
        raw, no = raw_lines[k], numbers[k] if numbers else k + 1
        while (len(raw_lines[k].rstrip("\r")) == width and k + 1 < len(raw_lines) and raw_lines[k + 1].strip()
               and not _drawn_row(raw_lines[k])
               and not strip_prefixes(_clean(raw_lines[k + 1]), learned)[1] and len(raw) < MAX_LINE):
            k += 1
            raw = raw.rstrip("\r") + raw_lines[k]
        out.append(raw)
        renumbered.append(no)
        k += 1
    return out, renumbered


# A text table (Triton's model and backend tables, tabulate's and PrettyTable's grids, rich's boxes)
# prints a cell longer than its column over several rows: the rest of the cell's text in the same
# column of the rows after it, every other cell of those rows blank. Such rows are read as the
# first row with that cell's text joined, so an error message in a status cell (`UNAVAILABLE:
# Internal: ... [TensorRT-LLM][E` + `RROR] Assertion failed: mpiSize == tp * pp`) is one line.
# The columns are where the border characters stand: a row that continues another has its borders
# at the same places. A row continues the text of the one above it when that row filled its cell
# (a printer that cuts at the column's width, mid-word: joined as it stands) or when the next word
# could not have fitted after it (a printer that wraps at words: joined with a space); a row whose
# first word would have fitted, or that is indented, starts a new line of the cell's own text
# (a stack frame under the message), and a row with text in another cell is a new row.
_CELL_BORDERS = "|\u2502\u2503"          # | │ ┃
_ROW_EDGES = "|+\u2502\u2503\u250c\u2510\u2514\u2518\u251c\u2524\u250f\u2513\u2517\u251b\u2523\u252b" \
             "\u256d\u256e\u256f\u2570\u2521\u2529\u2547\u2548"  # and the corners and tees a frame is drawn with
_BORDER = _re.compile("[" + _CELL_BORDERS + "]")


def _drawn_row(raw):
    """Whether a line is a row (or a rule) of a drawn table: it starts and ends on the table's frame."""
    s = raw.strip()
    return len(s) > 2 and s[0] in _ROW_EDGES and s[-1] in _ROW_EDGES


def _table_row(raw):
    """The positions of a table row's borders (at least three: two cells or more), or None."""
    s = raw.rstrip()
    if len(s) < 5 or s[-1] not in _CELL_BORDERS or s.lstrip()[:1] not in _CELL_BORDERS:
        return None
    cols = tuple(m.start() for m in _BORDER.finditer(s))
    return cols if len(cols) >= 3 else None


def _cells(raw, cols):
    return [raw[a + 1:b] for a, b in zip(cols, cols[1:])]


def _cell_glue(above, below):
    """What stands between the text of a table cell `above` (as drawn between its borders, its
    padding included) and the text `below` continues it with in the row under it: "" (cut at the
    column's width), " " (wrapped at a word), or None where `below` starts a line of its own."""
    width = len(above) - 2                  # one space of padding on each side
    text, rest = above[1:].rstrip(), below[1:].rstrip()
    if width < 1 or not text.strip() or not rest.strip():
        return None
    if len(text) >= width:                  # it filled its cell: cut at the column's width
        return ""
    if rest[:1].isspace():                  # indented: a line of its own
        return None
    word = rest.split(None, 1)[0]
    if len(text) + 1 + len(word) > width:   # the next word did not fit after it: wrapped at words
        return " "
    return None


def continue_cell(above, below):
    """The text of cell `above` joined with the text of cell `below` under it, or None where
    `below` is no continuation of it (both as drawn between their borders)."""
    glue = _cell_glue(above, below)
    return None if glue is None else above[1:].rstrip() + glue + below[1:].rstrip()


def join_table_cells(raw_lines, numbers=None):
    """(lines, numbers): the lines with each table cell a printer continued over the rows under it
    joined into its first row (the row rebuilt from its cells, without its right border), those
    rows left out. Linear: each line is looked at once, a joined cell grows to MAX_LINE at most."""
    out, renumbered = [], []
    k, n = 0, len(raw_lines)
    while k < n:
        raw = raw_lines[k]
        no = numbers[k] if numbers else k + 1
        cols = _table_row(raw)
        if cols:
            cells = _cells(raw, cols)
            col, above, pieces, size = None, None, [], 0
            while k + 1 < n and _table_row(raw_lines[k + 1]) == cols:
                below = _cells(raw_lines[k + 1], cols)
                filled = [j for j, c in enumerate(below) if c.strip()]
                if len(filled) != 1 or (col is not None and filled[0] != col):
                    break
                j = filled[0]
                glue = _cell_glue(cells[j] if col is None else above, below[j])
                if glue is None:
                    break
                if col is None:
                    pieces = [cells[j][1:].rstrip()]
                    size = len(raw) - len(cells[j]) + len(pieces[0])
                rest = below[j][1:].rstrip()
                if size + len(glue) + len(rest) > MAX_LINE:
                    break   # (the row stays a line of at most MAX_LINE: the rows after it go on in one of their own)
                pieces += [glue, rest]
                size += len(glue) + len(rest)
                col, above = j, below[j]
                k += 1
            if col is not None:
                cells = [c.strip() for c in cells]
                cells[col] = "".join(pieces).strip()
                row = raw[:cols[0] + 1]
                for j, cell in enumerate(cells):
                    row += " " + cell + (" " + raw[cols[j + 1]] if j + 1 < len(cells) else "")
                raw = row.rstrip()
        out.append(raw)
        renumbered.append(no)
        k += 1
    return out, renumbered


_MAX_DATA_LINES = 5000


def _data_close(text, quote, start):
    """The index of the quote mark that closes a logged value in `text` from `start`, or -1."""
    k = start
    while True:
        k = text.find(quote, k)
        if k < 0:
            return -1
        if text[k - 1:k] != "\\" and _DATA_CLOSE.match(text, k + 1):
            return k
        k += 1


def _without_request_data(body, pending):
    """(the line without the request data in it, the quote a value still open at its end waits
    for or None). `pending`: the quote of a value an earlier line opened."""
    if pending:
        close = _data_close(body, pending, 0)
        return ("", pending) if close < 0 else (body[close:], None)
    if ("equest" not in body and "obj=" not in body) or not _REQUEST_LOG.search(body):
        return body, None
    m = _DATA_FIELD.search(body)
    if not m:
        return body, None
    close = _data_close(body, m.group("q"), m.end())
    if close < 0:
        return body[:m.end()], m.group("q")
    return body[:m.end()] + body[close:], None


def normalise(text):
    """Every line without its prefixes, with the rank/process (stream) that wrote it."""
    raw_lines = text.splitlines()
    numbers = None
    head = text[:200000]
    if ("\n\n" in head or "\n\r\n" in head or "\n>" in head) and _double_spaced(raw_lines):
        raw_lines, numbers = _undouble(raw_lines)
    if newest_first(raw_lines):
        # read oldest first, as written; line numbers count from the oldest line (what comes
        # before a failure is compared by them), the report says so
        raw_lines, numbers = raw_lines[::-1], None
    if any(len(r) > 400 and r.count(_FILE_IN_LINE) > 1 for r in raw_lines):
        # (the same prefix found in a line with frames splits the paste's other joined lines too:
        # the one holding the exception line has no frame to find it by)
        seps = {sep for sep in (_fold_separator(r) for r in raw_lines if len(r) > 400) if sep}
        unfolded, renumbered = [], []
        for k, raw in enumerate(raw_lines):
            sep = next((sep for sep in seps if sep in raw[1:]), None) if len(raw) > 200 else None
            parts = _unfold(raw, sep) if sep else [raw]
            unfolded.extend(parts)
            renumbered.extend([numbers[k] if numbers else k + 1] * len(parts))
        raw_lines, numbers = unfolded, renumbered
    raw_lines = _bounded(raw_lines)
    learned = learn_prefixes(raw_lines)
    width = _wrap_width(raw_lines)
    if width:
        raw_lines, numbers = _unwrap(raw_lines, numbers, width, learned)
    raw_lines, numbers = join_table_cells(raw_lines, numbers)
    out = []
    data, data_from = None, 0   # the quote a logged request's value still open waits for, from which line
    current = ""          # stream of the last record header: its continuation lines follow it
    follows = False       # whether untagged lines continue that record
    ranks = {"": ""}      # stream -> the rank its last record header named
    k = -1
    while k + 1 < len(raw_lines):
        k += 1
        raw = raw_lines[k]
        no = numbers[k] if numbers else k + 1
        body, tags = strip_prefixes(_clean(raw), learned)
        if data and (tags or k - data_from > _MAX_DATA_LINES):
            data = None   # a new record: the value ended unseen
        if data or "equest" in body or "obj=" in body:
            opened = data
            body, data = _without_request_data(body, data)
            if data and not opened:
                data_from = k
        if k + 1 < len(raw_lines) and (_FILE_IN_LINE in body or body.endswith((".", "at", "at "))):
            joined = _rewrap(body, raw_lines[k + 1], learned)
            if joined is not None:
                body = joined
                k += 1
        proc = [t[2] for t in tags if t[1] == "proc"]
        record = [t[2] for t in tags if t[1] == "record"]
        levels = [t[3] for t in tags if t[3]]
        if proc:
            # The innermost process tag names the writer; a rank in a record header refines it.
            stream = proc[-1]
            if record and record[-1]:
                ranks[stream] = record[-1]
            ranks.setdefault(stream, stream)
            current, follows = stream, False
        elif record:
            stream = record[-1] or ""
            ranks[stream] = stream
            current, follows = stream, True
        else:
            # SGLang and torch's C++ log prefix only the first line of a record; after a
            # process-tagged line an untagged one comes from the main process.
            stream = current if follows else ""
        headers = [t[4] for t in tags if t[0] in _NEW_RECORD]
        out.append(Line(no, body, stream, ranks.get(stream, stream), levels[-1].upper() if levels else None,
                        headers[-1] if headers else None))
    return out


def streams(lines):
    """De-interleave: the lines of each stream, in order; streams in order of first appearance."""
    order = []
    by = {}
    for ln in lines:
        if ln.stream not in by:
            by[ln.stream] = []
            order.append(ln.stream)
        by[ln.stream].append(ln)
    return [(s, by[s]) for s in order]
