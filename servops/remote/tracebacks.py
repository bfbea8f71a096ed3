# Python traceback extraction from server logs. Standard library only: used locally and
# shipped to the host inside the diagnose program.
import re as _re

_TB_START = _re.compile(r"Traceback \(most recent call last\):")
_FRAME = _re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# The line after the frames: `module.ExceptionType: message` (or a bare type).
_EXC = _re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
_USER_CODE = _re.compile(r"^from user code:")
_DEBUG_CTX = _re.compile(r"module: (?P<module>[\w.]+), qualname: (?P<qualname>[\w.]+)")


def _frame(m, lines, i):
    code = ""
    if i + 1 < len(lines) and lines[i + 1].startswith("    ") and not _FRAME.match(lines[i + 1]):
        code = lines[i + 1].strip()
    return {"path": m.group("path"), "line": int(m.group("line")), "func": m.group("func"), "code": code}


def extract_tracebacks(text):
    """Every traceback in a log: frames, exception type and message, and dynamo's user-code frames."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if not _TB_START.search(lines[i]):
            i += 1
            continue
        tb = {"start_line": i + 1, "frames": [], "user_frames": [], "exc_type": None, "message": "",
              "details": [], "skipped_call": None}
        prefix = lines[i][:_TB_START.search(lines[i]).start()].strip()
        tb["context"] = prefix
        i += 1
        while i < len(lines):
            m = _FRAME.match(lines[i])
            if m:
                tb["frames"].append(_frame(m, lines, i))
                i += 1
                continue
            if lines[i].startswith((" ", "\t")) or not lines[i].strip():
                i += 1
                continue
            break
        if i < len(lines):
            m = _EXC.match(lines[i].strip())
            if m:
                tb["exc_type"] = m.group("type")
                tb["message"] = (m.group("msg") or "").strip()
                i += 1
        # The message's continuation, dynamo's explanation and "from user code:" frames.
        in_user = False
        while i < len(lines) and not _TB_START.search(lines[i]):
            line = lines[i]
            if _USER_CODE.match(line.strip()):
                in_user = True
            elif in_user and _FRAME.match(line):
                tb["user_frames"].append(_frame(_FRAME.match(line), lines, i))
            elif line.strip() and not line.startswith((" ", "\t")) and in_user:
                break
            elif line.strip() and not in_user:
                if _re.match(r"^\[\d{4}-\d\d-\d\d", line) and tb["details"]:
                    break
                tb["details"].append(line.strip())
                ctx = _DEBUG_CTX.search(line)
                if ctx:
                    tb["skipped_call"] = ctx.group("module") + "." + ctx.group("qualname")
            i += 1
            if len(tb["details"]) > 40:
                break
        out.append(tb)
    return out
