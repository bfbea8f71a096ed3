# Failures in server logs: Python tracebacks with their whole exception chain (and what was
# printed above the header; an ExceptionGroup reported by its sub-exceptions), C++ aborts
# (`terminate called ...` / `what():` / `frame #N`, also when the excerpt starts at what()), NCCL,
# CUDA and c10d rendezvous error lines, `Fatal Python error` with its stack, signals, Rust panics,
# SGLang/vLLM fatal lines.
# Standard library only: used locally (`--offline`) and shipped to the host, after logscan.py,
# inside the diagnose program. scan(text) is the entry point; it returns plain dicts (JSON).
import bisect as _bisect
import re as _re

if "normalise" not in globals():  # imported as a module; the host program has logscan.py above
    from .logscan import newest_first, normalise, streams  # noqa: F401

_TB_START = _re.compile(r"Traceback \(most recent call last\):?")
_FRAME = _re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+)(?:,? in ?(?P<func>.*?))?\s*$')
_CARETS = _re.compile(r"^\s*[\^~]+[\s\^~]*$")
_EXC_LINE = _re.compile(r"^(?P<type>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::(?:\s(?P<msg>.*))?)?$")
_EXC_NAME = r"(?:[A-Za-z_]\w*\.)*(?=[A-Z])(?:\w+?(?:Error|Exception|Unsupported|Exit|Interrupt|Failure|Timeout|OutOfResources)|Exception|Unsupported|OutOfResources)"
# (inside prose too: after a space, a quote, a bracket, CJK text - any character a dotted name
# cannot continue from)
_EXC_EMBEDDED = _re.compile(r"(?<![A-Za-z0-9_.])(?P<type>" + _EXC_NAME + r"): (?P<msg>\S.*)$")
# an exception logged as its repr with a message after it: `... with exception
# KVTransferError(bootstrap_room=165): Failed due to ...`
_EXC_REPR = _re.compile(r"(?<![A-Za-z0-9_.])(?P<type>" + _EXC_NAME + r")\((?P<args>[^()\n]{0,200})\): (?P<msg>\S.*)$")
# a record whose whole message is an exception's repr (`logger.exception(repr(e))`, vLLM V0's client:
# `ERROR ... client.py:282] RuntimeError('Engine process (pid 76) died.')`, then `NoneType: None`):
# the exception that record reports. Only the whole message: a repr inside a sentence (`Failed to
# import from amdsmi with ModuleNotFoundError(...)`) is that sentence's evidence, not its exception.
_EXC_REPR_WHOLE = _re.compile(r"^(?P<type>" + _EXC_NAME + r")\((?P<q>['\"])(?P<msg>.*)(?P=q)\)$")
# IPython/Jupyter: `ValueError      Traceback (most recent call last)`, then frames as `Cell In[3],
# line 5` / `File /x.py:177, in LLM.__init__(self, ...)` (IPython 8) or `/x.py in f(a)` /
# `<ipython-input-3-ab> in <module>` (IPython 7), each with a numbered source listing whose
# current line has an arrow (`----> 5 llm = LLM(...)`).
_IPY_HEADER = _re.compile(r"^\s*(?P<type>[A-Za-z_][\w.]*)\s{2,}Traceback \(most recent call last\)")
_IPY_FRAME = _re.compile(r"^(?:File (?P<p1>\S.*?):(?P<l1>\d+), in (?P<f1>[^\s(]+)|(?P<p2>Cell In\[\d+\]), line (?P<l2>\d+)|"
                         r"(?P<p3>Input In \[\d+\]), in (?P<f3>[^\s(]+)|"
                         r"(?P<p4>(?:[~/.]|[A-Za-z]:\\)\S*\.py|<ipython-input-[\w-]+>) in (?P<f4>[^\s(]+))")
_IPY_ARROW = _re.compile(r"^\s*-*>\s*(?P<no>\d+)\s(?P<code>.*)$")
_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"
_USER_CODE = _re.compile(r"^\s*from user code:\s*$")
_DEBUG_CTX = _re.compile(r"module: (?P<module>[\w.]+), qualname: (?P<qualname>[\w.]+)")
_TERMINATE = _re.compile(r"terminate called (?:after throwing an instance of '(?P<type>[^']+)'|recursively|without an active exception)")
_WHAT = _re.compile(r"^\s*what\(\):\s*(?P<msg>.*)$")
_RAISED_FROM = _re.compile(r"Exception raised from (?P<fn>\S+) at (?P<where>\S+) \(most recent call first\):")
_CXX_FRAME = _re.compile(r"^\s*frame #\d+: (?P<sym>.*?)(?: \+ 0x[0-9a-fA-F]+)?(?: \((?:0x[0-9a-fA-F]+ in )?[^()]*\)| \[0x[0-9a-fA-F]+\])?\s*$")
_FATAL = _re.compile(r"Fatal Python error: (?P<msg>.+)")
_THREAD = _re.compile(r"^\s*(?P<current>Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):")
_WARNING_STACK = _re.compile(r"originates from:\s*$|\bWarning: |^\s*Stack \(most recent call last\):")
# the words of a server that logs an exception and carries on without an optional part
# (sglang 0.5.17: "OpenAI Responses API (/v1/responses) disabled: ... init failed (ModuleNotFoundError: ...)")
_CARRIES_ON = _re.compile(r"(?i)\b(?:disabled|disabling|falling back|fall back|skipp(?:ing|ed)|continuing without|"
                          r"will not be (?:available|used)|not be available|unavailable)\b")
# a stop someone asked for (servops' SIGTERM): children then end "with exit code -15", which is no crash
_STOP_REQUESTED = _re.compile(r"SIGTERM received|Received SIGTERM|received signal 15\b|Received signal SIGTERM", _re.I)
_TERMINATED = _re.compile(r"exit code -15\b|exit(?:ed)? (?:with )?(?:code|status)\s*[:=]?\s*(?:-15|143)\b|"
                          r"signal 15\b|\bSIGTERM\b")
_FAILURE_WORDS = _re.compile(r"(?i)\b(?:error|exception|fail(?:s|ed|ure)?|fatal|abort(?:ed|ing)?)\b")
# Python 3.11's ExceptionGroup report numbers its sub-exceptions: `+-+---------------- 1 ----`
_SUB_EXCEPTION = _re.compile(r"^\s*\+[-+]*-+ (?:\d+|\.\.\.) -+\s*$|^\s*\+-{12,}\s*$")
_GROUP = _re.compile(r"(?:^|\.)(?:Base)?ExceptionGroup$")
_PROCESS_HEADER = _re.compile(r"^Process [\w.-]+:\s*$")  # multiprocessing, before a child's traceback
_QUIET_LEVELS = ("INFO", "DEBUG", "TRACE", "NOTICE", "WARN", "WARNING")
_QUIET_TRACEBACK = _QUIET_LEVELS + ("W", "I", "D")  # glog's letters (logscan)
_QUIET_ENDED = ("INFO", "DEBUG", "TRACE", "NOTICE", "I", "D")  # a warning that a worker died still counts

# Lines that are evidence on their own. "consequence" classes report that something already
# failed (a child died, a worker did not start, an exit code): they join the failure they follow.
_ERROR_CLASSES = [
    ("cuda", _re.compile(r"(?:CUDA|HIP) (?:error|Error|ERROR)\b|\b(?:cuda|hip)Error[A-Z]\w+|CUDA out of memory|CUBLAS_STATUS_(?!SUCCESS)[A-Z_]+|"
                         r"CUDNN_STATUS_(?!SUCCESS)[A-Z_]+|an illegal memory access was encountered|device-side assert(?:ion)? triggered|"
                         r"no kernel image is available|misaligned address|unspecified launch failure|"
                         # a device-side assert as the kernel prints it, before the CUDA error
                         r"block: \[\d+,\d+,\d+\],? thread: \[\d+,\d+,\d+\],? Assertion")),
    ("nccl", _re.compile(r"Watchdog caught collective operation timeout|\bNCCL (?:error|Error|ERROR)\b|\bnccl[A-Z]\w*Error\b|"
                         r"ProcessGroupNCCL.*(?:terminated with exception|[Tt]imed? ?out)|NCCL communicator was aborted")),
    ("signal", _re.compile(r"Segmentation fault|\bSIG(?:SEGV|ABRT|BUS|FPE|ILL)\b|Aborted \(core dumped\)|\(core dumped\)|^Killed\s*$|"
                           r"^Bus error|received signal (?:\d+|SIG\w+)|Signal \d+ \(SIG\w+\) received|"
                           # a shell's report of its child's death (`line 18:  1669 Illegal instruction  (core dumped) python ...`)
                           r"^(?:Illegal instruction|Aborted|Floating point exception|Trace/breakpoint trap)\s*$|"
                           r"\b\d+ (?:Illegal instruction|Segmentation fault|Aborted|Killed|Bus error|Floating point exception)\s|"
                           r"illegal hardware instruction|Caught signal (?!(?:2|15)\b)\d+|"
                           # a launcher reporting its child's death (TGI's shard manager, mpirun); not
                           # SIGINT/SIGTERM, which is how a server is stopped
                           r"(?:signaled to shutdown with|exited on|killed by|terminated by) signal (?!(?:2|15)\b)\d+")),
    # the MPI runtime (TensorRT-LLM under mpirun, Triton's multi-GPU backend) failing by itself
    ("mpi", _re.compile(r"\b(?:PRTE|ORTE|PMIX) ERROR\b|MPI_ABORT was invoked|\bMPI error\b")),
    # SGLang's advice printed after a piecewise CUDA graph failure (and by other ranks): evidence
    # that something failed there, but never the failure itself when anything else says more
    ("hint", _re.compile(r"Piecewise CUDA Graph is enabled by default as an experimental|"
                         # the advice under SGLang's "Capture cuda graph failed" (an excerpt may hold only it)
                         r"disable (?:cuda|CUDA) graph by --disable-cuda-graph|set --cuda-graph-max-bs to a smaller value")),
    # torch.compile's own footer (its hints), when the excerpt holds nothing more of the failure
    ("dynamo-hint", _re.compile(r"Set TORCH_LOGS=\S*dynamo\S* and TORCHDYNAMO_VERBOSE=1 for more information|"
                                r"Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace|"
                                r"You can suppress this exception and fall back to eager by setting")),
    # a serving controller's health check gave up on a replica or worker (Ray Serve, a router):
    # no exception word, and the log may go on serving on the others
    ("unhealthy", _re.compile(r"Didn't receive health check response for|marking it unhealthy|\bmarked (?:as )?unhealthy\b|"
                              r"\b(?:replica|worker)\b[^.\n]{0,80}\bis unhealthy\b")),
    # a router or gateway that cannot read the model's tokenizer config (TGI's router, SGLang's
    # model gateway): it serves without the chat template, or not at all
    ("tokenizer", _re.compile(r"(?i)unable to parse (?:the )?tokenizer(?:[_ ]config)?|failed to (?:load|parse) (?:the )?tokenizer\b")),
    ("sglang", _re.compile(r"Piecewise CUDA Graph failed|Capture (?:piecewise )?cuda graph failed|"
                           r"(?:TokenizerManager|DetokenizerManager|DataParallelController) hit an exception|Exception in run_tp_server|"
                           r"scheduler is dead|Child process unexpectedly failed", _re.I)),
    # a compiler's own words, with no traceback around them: nvcc's error count, ninja's failed
    # target, ptxas refusing its input
    ("build", _re.compile(r"ninja: build stopped|^FAILED: |\bfatal error: |nvcc fatal|Ninja build failed|"
                          r"^\d+ errors? detected in the compilation of|^ptxas (?:fatal|error)\s*:|"
                          r"error: command '[^']*(?:nvcc|g\+\+|gcc|c\+\+)[^']*' failed")),
    ("bind", _re.compile(r"[Aa]ddress already in use|EADDRINUSE|error while attempting to bind")),
    # torch.distributed's rendezvous: the c10d store cannot be reached or set up (multi-node
    # --dist-init-addr / MASTER_ADDR unreachable, a firewall, a wrong node rank)
    ("dist", _re.compile(r"The client socket has (?:timed out|failed)|\bDist(?:Network|Store)Error\b|"
                         r"Rendezvous(?:Connection|Timeout|Closed)Error|TCPStore.*(?:timed out|[Ff]ailed)|connect\(\) timed out|"
                         r"Gloo connectFullMesh failed")),
    # a Rust panic (SGLang's router, TGI's launcher): no Python traceback at all
    ("panic", _re.compile(r"\bthread '[^'\n]*' panicked at\b|^panicked at '")),
    ("oom-kill", _re.compile(r"Out of memory: Killed process|oom-kill|OOMKilled")),
    ("hub", _re.compile(r"Cannot access gated repo|is (?:restricted|gated)\. You must (?:have access|be authenticated)|"
                        r"\b40[13] Client Error|Repository Not Found for url|We couldn't connect to 'https://huggingface\.co'")),
    # the GPU below what the server or the dtype needs, said without an exception class
    ("arch", _re.compile(r"is only supported on GPUs with compute capability|GPUs with compute capability (?:below|lower than) [\d.]+ are not supported")),
    # vLLM's memory profile leaving the KV cache less than nothing, logged at INFO right before
    # the engine core fails (`Available KV cache memory: -2.14 GiB`)
    ("kv-cache", _re.compile(r"Available KV cache memory: -\d")),
    # an extension built against other libraries than the installed ones
    ("linker", _re.compile(r"undefined symbol: \S")),
    # the host refusing a thread or a process (pids/threads limit, ulimit)
    ("limits", _re.compile(r"pthread_create failed|can't start new thread|[Ff]ailed to create (?:a )?(?:new )?thread|Thread creation failed|"
                           r"fork: (?:retry: )?(?:Resource temporarily unavailable|No child processes)|[Tt]oo many open files")),
    # pydantic's ValidationError lines (vLLM's argument checks): "1 validation error for ModelConfig";
    # argparse refusing the command line: "launch_server.py: error: unrecognized arguments: --x"
    ("invalid", _re.compile(r"^\s*Value error, |^\d+ validation errors? for [A-Z]\w+|^[\w.-]+: error: \S")),
    # the server's list of architectures refusing the model, pasted without its ValueError
    ("model", _re.compile(r"^Model architectures? \[[^\]]*\] (?:are|is) not supported for now")),
    # vLLM's capability check of a quantization method, pasted without its exception class
    ("quantization", _re.compile(r"quantization method \S+ is not supported for the current GPU")),
    ("exit", _re.compile(r"Received sigquit from a child process|EngineCore failed to start|WorkerProc failed to start|"
                         r"Got fatal signal from worker processes|EngineCore encountered an issue|"
                         r"returned non-zero exit status -?[1-9]|"
                         r"Engine core initialization failed|Engine process failed to start|WorkerProc hit an exception|"
                         # vLLM V0's API server when its engine loop died
                         r"MQLLMEngine is already dead|AsyncLLMEngine has failed, terminating|Engine failed, terminating server|"
                         r"Background loop has errored already|Engine loop is not running|"
                         r"\bexit(?:ed)? (?:with )?(?:code|status)\s*[:=]?\s*-?[1-9]\d*|\bexitcode\s*:\s*-?[1-9]\d*|"
                         r"died with (?:exit code|signal)|\bShard \d+ failed to start|ShardCannotStart|ShardFailed|"
                         # TGI's router: the shard's socket is gone (the shard process exited)
                         r"Server error: error trying to connect", _re.I)),
    # a launcher's or wrapper's own last words, with no exception class and no log level (Go and
    # Rust CLIs, docker): `Error: llama runner process has terminated`, `docker: Error response
    # from daemon: ...`
    ("message", _re.compile(r"^(?:[\w.-]+: )?(?:Error|FATAL|Fatal error)(?: response from daemon)?: \S|^error: \S")),
]
_CONSEQUENCE = ("exit",)
_WEAK = ("hint", "dynamo-hint")  # a cause only when nothing stronger is there
# Classes that are evidence at any log level: a replica the health check gave up on and a tokenizer
# config a router cannot read are logged as warnings (they do not heal); vLLM logs a KV cache left
# less than nothing at INFO right before its engine fails.
_LOUD = ("unhealthy", "tokenizer", "kv-cache")
# A warning that carries an import failure or a missing library (`WARNING ... Failed to import from
# vllm._C with ImportError('libcudart.so.12: cannot open shared object file ...')`) is no failure by
# itself (many are optional parts), but a failure after it that shows no cause of its own (a
# traceback cut before its exception line, an engine that only says it died) has it as its root.
_LATENT = _re.compile(r"(?P<type>\b(?:ImportError|ModuleNotFoundError|OSError))\((?P<q>['\"])(?P<msg>.+?)(?P=q)\)")
_LATENT_WORDS = ("ImportError(", "ModuleNotFoundError(", "OSError(")
# NCCL reports its own failures at its WARN level (`node5:240:240 [6] misc/socket.cc:533 NCCL WARN
# socketPollConnect: Connect to 10.0.0.4<56849> returned 113(No route to host)`), followed by the
# `NCCL INFO file.cc:N -> 2` chain of return codes up to the caller. A warning alone is no failure
# (NCCL also warns and goes on), but a failure close below it that shows no cause of its own (a
# traceback cut before its exception line, a death) has it as its cause.
_NCCL_WARN = _re.compile(r"\bNCCL WARN\b")
# (a stream keeps its first ones and its latest: a flood of them costs bounded memory)
_MAX_NCCL_WARNINGS = 1000
# Exceptions that only report that another process already failed (vLLM's front end when its
# engine core died, a worker wrapper re-raising): after a real failure they are its consequence.
_CONSEQUENCE_EXC = _re.compile(r"Engine core initialization failed|EngineDeadError|EngineCore encountered an issue|"
                               r"Background loop has errored already|Engine loop is not running|"
                               r"EngineCore failed to start|Engine process failed to start|WorkerProc initialization failed|"
                               r"Exception in worker \S+ while processing method|Error executing method \S+\. This might cause deadlock")
# The process died or exited in failure: a signal, a non-zero exit, a killed child, a dead engine.
# (SIGINT/SIGTERM are how a server is stopped; exit code 0 is success.)
_ENDED = _re.compile(
    r"Segmentation fault|\bSIG(?:SEGV|ABRT|BUS|FPE|ILL|KILL)\b|\(core dumped\)|^Killed\s*$|\b\d+ Killed\s|^Bus error|"
    r"Illegal instruction|illegal hardware instruction|^Aborted\s*$|Floating point exception|Trace/breakpoint trap|"
    r"received signal (?!(?:2|15|SIGINT|SIGTERM)\b)(?:\d+|SIG\w+)|"
    r"(?:signaled to shutdown with|exited on|killed by|terminated by) signal (?!(?:2|15)\b)\d+|"
    r"\bexit(?:ed)? (?:with )?(?:code|status)\s*[:=]?\s*-?[1-9]\d*|\bexitcode\s*:\s*-?[1-9]\d*|returned non-zero exit status|"
    r"died with (?:exit code|signal)|died, exit code|Out of memory: Killed process|OOMKilled|"
    r"EngineDeadError|Engine core initialization failed|EngineCore failed to start|Engine process failed to start|"
    r"MQLLMEngine is already dead|AsyncLLMEngine has failed, terminating|Engine failed, terminating server|"
    r"Got fatal signal from worker processes|Received sigquit from a child process|ShardCannotStart|Shard \d+ failed to start")
_ENDED_WORDS = ("ault", "SIG", "core dumped", "Killed", "Bus error", "llegal", "Aborted", "Floating", "Trace/", "signal",
                "xit", "died", "Out of memory", "OOMKilled", "Engine", "sigquit", "Shard")
_GAP = 25          # lines between pieces of evidence that belong to one failure
_MAX_DETAILS = 40
# One failure holds at most this many error lines and chained exceptions: the first ones and the
# latest (a log of a million error lines is read in time linear in its size, and what diagnose
# matches against stays bounded).
_MAX_ERRORS = 100
_MAX_CHAIN = 40
_MAX_ROOT = 2000


def _keep(items, item, cap):
    """Append `item`, or, once `items` holds `cap`, let it replace the latest (the first ones stay)."""
    if len(items) < cap:
        items.append(item)
    else:
        items[-1] = item
    return len(items) - 1
_MAX_FINDINGS = 60


# Every error class needs one of these words: a cheap test before the regexes.
# Words every line of a class contains (each alternative of its regex needs one of them): a
# cheap test before that class's regex, which most lines of a long log never reach.
_CLASS_WORDS = {
    "cuda": ("CUDA", "cuda", "HIP", "hipError", "CUBLAS", "CUDNN", "illegal memory", "device-side assert", "kernel image",
             "misaligned", "launch failure", "Assertion"),
    "nccl": ("Watchdog", "NCCL", "nccl"),
    "signal": ("Segmentation", "SIG", "core dumped", "Killed", "Bus error", "ignal", "Illegal instruction", "Aborted",
               "Floating point", "Trace/", "illegal hardware"),
    "mpi": ("TE ERROR", "PMIX", "MPI"),
    "hint": ("Piecewise", "-cuda-graph"),
    "dynamo-hint": ("TORCHDYNAMO_VERBOSE", "fall back to eager"),
    "unhealthy": ("health check response", "unhealthy"),
    "tokenizer": ("okenizer",),
    "sglang": ("raph failed", "RAPH FAILED", "hit an exception", "run_tp_server", "is dead", "unexpectedly"),
    "build": ("ninja", "Ninja", "FAILED", "fatal", "detected in the compilation", "ptxas", "error: command"),
    "bind": ("ddress already", "EADDRINUSE", "bind"),
    "dist": ("socket has", "Dist", "Rendezvous", "TCPStore", "connect()", "connectFullMesh"),
    "panic": ("panicked",),
    "oom-kill": ("Out of memory", "oom-kill", "OOMKilled"),
    "hub": ("gated repo", "You must", "Client Error", "Repository Not Found", "couldn't connect"),
    "arch": ("compute capability",),
    "kv-cache": ("KV cache memory: -",),
    "linker": ("undefined symbol",),
    "limits": ("pthread_create", "new thread", "to create", "Thread creation", "fork:", "open files"),
    "invalid": ("alue error", "validation error", ": error: "),
    "model": ("not supported for now",),
    "quantization": ("current GPU",),
    "exit": ("sigquit", "to start", "initialization failed", "WorkerProc", "xit", "XIT", "died with", "Shard",
             "trying to connect", "fatal signal", "encountered an issue", "already dead", "has failed", "Engine failed",
             "errored already", "not running"),
    "message": ("Error", "FATAL", "Fatal error", "error: "),
}
_EXC_WORDS = ("Error", "Exception", "Unsupported", "Exit", "Interrupt", "Failure", "Timeout", "OutOfResources")


def classify(text):
    """The error class of a line ("cuda", "nccl", ...), or None."""
    for name, rx in _ERROR_CLASSES:
        if any(w in text for w in _CLASS_WORDS[name]) and rx.search(text):
            return name
    return None


def _indent(text):
    return len(text) - len(text.lstrip())


def _looks_exception(text):
    """`Type: message` (or a bare `Type`) where Type is a dotted, capitalised exception name."""
    m = _EXC_LINE.match(text.strip())
    if not m:
        return None
    last = m.group("type").rsplit(".", 1)[-1]
    if not last[:1].isupper() or last in ("Traceback", "Thread", "File", "Process", "Current"):
        return None
    return m


_WRAP_GAP = _re.compile(r"\s{2,}(?=/)")
_FRAME_START = _re.compile(r'^\s*File "')  # a frame line the excerpt cut short
_ELIDED = _re.compile(r"^\s*\.\.\.<\d+ lines?>\.\.\.\s*$")  # Python 3.13 eliding a statement's middle
_OPEN, _CLOSE = "([{", ")]}"


_CLOSERS = {'"': '"', "'": "'", "`": "`", "“": "”", "‘": "’", "(": ")", "[": "]", "*": "*", "_": "_"}


def _unquoted(context, message):
    """An exception quoted inside a sentence (`it shows - "RuntimeError: ..."`, `**ValueError:
    ...**`) without the quote or markup that closes it."""
    opener = ""
    for c in reversed(context):
        if c not in _CLOSERS:
            break
        opener = c + opener
    closer = "".join(_CLOSERS[c] for c in reversed(opener))
    return message[:-len(closer)].rstrip() if closer and message.endswith(closer) else message


def _structural(text):
    """Lines that mean something to a traceback (never another writer's stray line)."""
    return bool(_TB_START.search(text) or _CAUSE in text or _CONTEXT in text or _USER_CODE.match(text)
                or _PROCESS_HEADER.match(text) or "terminate called" in text or "Fatal Python error" in text
                or _THREAD.match(text) or _SUB_EXCEPTION.match(text))


def _bracket_depth(text):
    return sum(1 for c in text if c in _OPEN) - sum(1 for c in text if c in _CLOSE)


def _frame(m):
    path = m.group("path")
    if "  " in path:
        path = _WRAP_GAP.sub("", path)  # a terminal's padding where it wrapped the path
    return {"path": path, "line": int(m.group("line")), "func": (m.group("func") or "?").strip(), "code": ""}


class _Stream(object):
    """Evidence in one stream's lines, read front to back."""

    def __init__(self, lines):
        self.lines = lines
        self.n = len(lines)
        self.items = []
        self.gapped = False
        self.stop_requested = None  # the line number of the last "SIGTERM received"
        self.latent = []            # import failures logged as warnings (_LATENT), as exceptions
        self.nccl_warnings = []     # NCCL's own `NCCL WARN` lines (_NCCL_WARN), as error lines

    def text(self, i):
        return self.lines[i].text

    # -- Python tracebacks -------------------------------------------------------------
    def _foreign(self, j, ref):
        """Whether line j was written by someone else than the traceback whose frame is line ref:
        another thread's log record (a header where the traceback has none, or another level)."""
        ln, r = self.lines[j], self.lines[ref]
        return (ln.new_record is not None and r.new_record is None) or (ln.level is not None and ln.level != r.level)

    def _skip_foreign(self, j, ref, want):
        """Past up to 3 lines another writer put inside the traceback, when the line after them
        is what the traceback goes on with (`want(line index)`); else j."""
        k = j
        while k < self.n and k - j < 3 and self.text(k).strip() and not _structural(self.text(k)) \
                and (self._foreign(k, ref) or not _looks_exception(self.text(k))):
            k += 1
        return k if j < k < self.n and want(k) else j

    def _statement(self, j, frame_indent):
        """Past the rest of a frame's source statement after its first line at j: Python 3.13
        shows a multi-line call whole, eliding its middle (`...<3 lines>...`), carets under each line."""
        depth = _bracket_depth(self.text(j))
        j += 1
        while j < self.n:
            t = self.text(j)
            if _CARETS.match(t) or _ELIDED.match(t):
                j += 1
                continue
            if depth > 0 and t.strip() and _indent(t) > frame_indent and not _FRAME.match(t):
                depth += _bracket_depth(t)
                j += 1
                continue
            break
        return j

    def frames(self, i):
        """Frames from line i on (with their source lines); returns (frames, next i)."""
        frames = []
        self.gapped = False
        while i < self.n:
            t = self.text(i)
            m = _FRAME.match(t)
            if m:
                fr = _frame(m)
                ind = _indent(t)
                j = i + 1
                if j < self.n and self._foreign(j, i):
                    j = self._skip_foreign(j, i, lambda k: _indent(self.text(k)) > ind and not _FRAME.match(self.text(k)))
                # faulthandler's frames (`line 12 in f`, no comma) never show a source line
                if j < self.n and (m.group("func") is None or ", in" in t):
                    nt = self.text(j)
                    if (nt.strip() and not _FRAME.match(nt) and not _CARETS.match(nt) and not _TB_START.search(nt)
                            and _CAUSE not in nt and _CONTEXT not in nt and not self._foreign(j, i)
                            and (_indent(nt) > ind or not _looks_exception(nt) or self._frame_at(j + 1))):
                        fr["code"] = nt.strip()
                        j = self._statement(j, ind)
                while j < self.n and _CARETS.match(self.text(j)):
                    j += 1
                frames.append(fr)
                # another writer's lines before the next frame or the exception line
                if j < self.n and not _FRAME.match(self.text(j)) and self.text(j).strip():
                    j = self._skip_foreign(j, i, lambda k: bool(_FRAME.match(self.text(k)))
                                           or (_indent(self.text(k)) <= ind and bool(_looks_exception(self.text(k)))))
                i = j
                continue
            if not t.strip():
                # faulthandler and some pastes put blank lines between frames
                k = i + 1
                while k < self.n and not self.text(k).strip():
                    k += 1
                if frames and k < self.n and _FRAME.match(self.text(k)):
                    self.gapped = True
                    i = k
                    continue
            break
        return frames, i

    def _frame_at(self, j):
        while j < self.n and _CARETS.match(self.text(j)):
            j += 1
        return j < self.n and bool(_FRAME.match(self.text(j)))

    def exception(self, i, start, context="", header=True):
        """A traceback from its header (or its first orphan frame) at line `start`."""
        exc = {"type": None, "message": "", "details": [], "frames": [], "user_frames": [], "skipped_call": None,
               "context": context.strip(), "has_traceback": header, "line": self.lines[start].no,
               "rank": self.lines[start].rank, "last": self.lines[start].no}
        exc["frames"], i = self.frames(i)
        if i > start:
            exc["last"] = self.lines[i - 1].no
        while i < self.n and not self.text(i).strip() and not exc["frames"]:
            i += 1
        if self.gapped and i < self.n and not self.text(i).strip():
            # a paste with blank lines between the frames (TGI's shard output) has one above the
            # exception line too
            k = i + 1
            while k < self.n and k - i < 3 and not self.text(k).strip():
                k += 1
            if k < self.n and _indent(self.text(k)) == 0 and _looks_exception(self.text(k)):
                i = k
        if i < self.n:
            t = self.text(i)
            m = _EXC_LINE.match(t.strip()) if not _FRAME.match(t) and not _TB_START.search(t) else None
            if m and (_looks_exception(t) or (exc["frames"] and _indent(t) <= 2)):
                exc["type"] = m.group("type")
                exc["message"] = (m.group("msg") or "").strip()
                exc["line"] = exc["last"] = self.lines[i].no
                i += 1
        return exc, self.details(i, exc)

    def details(self, i, exc):
        """The message's continuation, dynamo's explanation and its "from user code:" frames."""
        level = self.lines[i - 1].level if i else None
        header = self.lines[i - 1].new_record if i else None
        while i < self.n and len(exc["details"]) < _MAX_DETAILS:
            ln = self.lines[i]
            t = ln.text
            s = t.strip()
            if (_TB_START.search(t) or _CAUSE in s or _CONTEXT in s or _FRAME.match(t) or _PROCESS_HEADER.match(t) or _TERMINATE.search(t)
                    or (s[:2] == "+-" and _SUB_EXCEPTION.match(s))
                    or _FATAL.search(t) or _RAISED_FROM.search(t) or _CXX_FRAME.match(t)
                    or (ln.new_record and ln.new_record != header) or (level and ln.level and ln.level != level)):
                break
            if _USER_CODE.match(t):
                frames, i = self.frames(i + 1)
                exc["user_frames"].extend(frames)
                continue
            if not s:
                k = i + 1
                while k < self.n and not self.text(k).strip():
                    k += 1
                if k < self.n and (_indent(self.text(k)) > 0 or _USER_CODE.match(self.text(k))) \
                        and not _FRAME.match(self.text(k)) and self.lines[k].new_record in (None, header):
                    i = k
                    continue
                break
            if _indent(t) == 0 and _EXC_EMBEDDED.match(t) and exc["type"]:
                break  # another exception
            exc["details"].append(s)
            ctx = _DEBUG_CTX.search(t)
            if ctx:
                exc["skipped_call"] = ctx.group("module") + "." + ctx.group("qualname")
            exc["last"] = ln.no
            i += 1
        return i

    # -- C++ ---------------------------------------------------------------------------
    def cxx_trace(self, i, item):
        """`Exception raised from F at FILE:LINE` and the `frame #N:` lines after it."""
        m = _RAISED_FROM.search(self.text(i)) if i < self.n else None
        if m:
            item["raised_from"] = "%s at %s" % (m.group("fn"), m.group("where"))
            item["last"] = self.lines[i].no
            i += 1
        while i < self.n:
            fm = _CXX_FRAME.match(self.text(i))
            if not fm:
                break
            item["cxx_frames"].append(fm.group("sym").strip())
            item["last"] = self.lines[i].no
            i += 1
        return i

    def abort(self, i, header=True):
        """`terminate called ...` and its what(); header=False: a what() whose terminate line is
        not in the log (an excerpt cut just above it): the C++ type is then unknown ("")."""
        ln = self.lines[i]
        m = _TERMINATE.search(ln.text) if header else None
        item = {"kind": "abort", "type": (m.group("type") or m.group(0)) if m else "", "what": "", "raised_from": None,
                "cxx_frames": [], "line": ln.no, "last": ln.no, "rank": ln.rank}
        if header:
            i += 1
        # ranks aborting at once interleave their `terminate called` lines: find the what()
        for j in range(i, min(self.n, i + 8)):
            t = self.text(j)
            if _WHAT.match(t):
                i = j
                break
            if _TB_START.search(t) or _FRAME.match(t) or _FATAL.search(t) or _RAISED_FROM.search(t):
                break
        what = []
        if i < self.n and _WHAT.match(self.text(i)):
            what.append(_WHAT.match(self.text(i)).group("msg").strip())
            item["last"] = self.lines[i].no
            i += 1
            while i < self.n and self.text(i).strip() and not _RAISED_FROM.search(self.text(i)) \
                    and not _CXX_FRAME.match(self.text(i)) and not _TERMINATE.search(self.text(i)) and len(what) < 10:
                what.append(self.text(i).strip())
                item["last"] = self.lines[i].no
                i += 1
        item["what"] = "\n".join(what)
        return item, self.cxx_trace(i, item)

    # -- faulthandler --------------------------------------------------------------------
    def fatal(self, i, header=True):
        """`Fatal Python error: ...` and faulthandler's thread dumps after it; header=False: a dump
        whose `Fatal Python error` line is not in the log (cut, or written over by another process)."""
        ln = self.lines[i]
        item = {"kind": "fatal", "message": _FATAL.search(ln.text).group("msg").strip() if header else NO_FATAL_LINE,
                "threads": [], "line": ln.no, "last": ln.no, "rank": ln.rank}
        if header:
            i += 1
        while i < self.n:
            t = self.text(i)
            if not t.strip():
                i += 1
                continue
            m = _THREAD.match(t)
            if not m:
                break
            i += 1
            while i < self.n and not self.text(i).strip():
                i += 1
            frames, i = self.frames(i)
            frames.reverse()  # faulthandler prints the most recent call first
            item["threads"].append({"current": m.group("current") == "Current thread", "frames": frames})
            if frames:
                item["last"] = self.lines[i - 1].no
        return item, i

    # -- IPython / Jupyter ---------------------------------------------------------------
    def ipython(self, start, header=True):
        """An IPython traceback from its header (or its first frame, when the excerpt starts
        there) to its exception line; the arrow lines are the frames' source, never an error."""
        exc = {"type": None, "message": "", "details": [], "frames": [], "user_frames": [], "skipped_call": None,
               "context": "", "has_traceback": header, "line": self.lines[start].no,
               "rank": self.lines[start].rank, "last": self.lines[start].no}
        i = start + 1 if header else start
        fr = None
        while i < self.n:
            t = self.text(i)
            s = t.strip()
            m = _IPY_FRAME.match(t)
            if m:
                cell = m.group("p2") or m.group("p3")
                fr = {"path": "<%s>" % cell if cell else m.group("p1") or m.group("p4"),
                      "line": int(m.group("l1") or m.group("l2") or 0),
                      "func": m.group("f1") or m.group("f3") or m.group("f4") or "<cell>", "code": ""}
                exc["frames"].append(fr)
            elif _IPY_ARROW.match(t):
                a = _IPY_ARROW.match(t)
                if fr is not None and not fr["code"]:
                    fr["code"] = a.group("code").strip()
                    fr["line"] = fr["line"] or int(a.group("no"))
            elif s and _indent(t) == 0 and not s.startswith("-"):
                if _looks_exception(t) and not _structural(t):
                    em = _EXC_LINE.match(s)
                    exc["type"], exc["message"] = em.group("type"), (em.group("msg") or "").strip()
                    exc["line"] = exc["last"] = self.lines[i].no
                    i += 1
                break
            exc["last"] = self.lines[i].no
            i += 1
        if exc["type"] is None and header:
            # an excerpt cut before the exception line: the header names its class
            # (`OutOfMemoryError                          Traceback (most recent call last)`)
            hm = _IPY_HEADER.match(self.text(start))
            if hm and _looks_exception(hm.group("type")):
                exc["type"] = hm.group("type")
        return exc, self.details(i, exc)

    def _message_above(self, i):
        """The log message a traceback belongs to when the logger put it on the line above the
        header (`logger.exception("Error in inspecting model architecture ...")`, "EngineCore
        failed to start."): the line right above, when it is an error message no other evidence took."""
        k = i - 1
        if k < 0 or not self.text(k).strip():
            return ""
        ln = self.lines[k]
        t = ln.text.strip()
        if self.items and self.items[-1][1].get("last", self.items[-1][1].get("line", 0)) >= ln.no:
            return ""
        if (ln.level in _QUIET_LEVELS or _FRAME.match(t) or _looks_exception(t) or _EXC_EMBEDDED.search(t)
                or _CAUSE in t or _CONTEXT in t or classify(t) or len(t) > 300):
            return ""
        if ln.level in ("ERROR", "CRITICAL", "FATAL") or _FAILURE_WORDS.search(t):
            return t
        return ""

    def _previous_text(self, i):
        k = i - 1
        while k >= 0 and not self.text(k).strip():
            k -= 1
        return self.text(k) if k >= 0 else ""

    # -- the whole stream ----------------------------------------------------------------
    def scan(self):
        i = 0
        while i < self.n:
            ln = self.lines[i]
            t = ln.text
            tb = _TB_START.search(t) if "Traceback" in t else None
            if tb and _IPY_HEADER.match(t):
                exc, i = self.ipython(i)
                if ln.level not in _QUIET_TRACEBACK:
                    self.items.append(("exc", exc))
                continue
            if tb:
                context = t[:tb.start()]
                if not context.strip():
                    context = self._message_above(i)
                exc, i = self.exception(i + 1, i, context=context)
                # a traceback logged as a warning or info (a retried import, a fallback) is no failure
                if ln.level not in _QUIET_TRACEBACK:
                    self.items.append(("exc", exc))
                continue
            s = t.strip()
            if _CAUSE in s or _CONTEXT in s:
                self.items.append(("sep", {"line": ln.no, "cause": _CAUSE in s}))
                i += 1
                continue
            if s[:2] == "+-" and _SUB_EXCEPTION.match(s):
                if " -" in s:  # the closing `+------` line separates nothing
                    self.items.append(("sep", {"line": ln.no, "cause": True, "sub": True}))
                i += 1
                continue
            if "terminate called" in t and _TERMINATE.search(t):
                item, i = self.abort(i)
                self.items.append(("abort", item))
                continue
            if "what():" in t and _WHAT.match(t) and not ln.level in _QUIET_LEVELS:
                item, i = self.abort(i, header=False)
                self.items.append(("abort", item))
                continue
            if "Fatal Python error" in t:
                item, i = self.fatal(i)
                self.items.append(("fatal", item))
                continue
            if "most recent call first" in t and _THREAD.match(t) and not ln.level in _QUIET_LEVELS:
                item, i = self.fatal(i, header=False)
                self.items.append(("fatal", item))
                continue
            if ("Exception raised from" in t and _RAISED_FROM.search(t)) or ("frame #" in t and _CXX_FRAME.match(t)):
                item = {"kind": "cxx", "raised_from": None, "cxx_frames": [], "line": ln.no, "last": ln.no, "rank": ln.rank}
                i = self.cxx_trace(i, item)
                self.items.append(("cxx", item))
                continue
            if t[:5] in ("File ", "Cell ") and _IPY_FRAME.match(t) and not _FRAME.match(t):
                exc, i = self.ipython(i, header=False)
                if exc["type"] or len(exc["frames"]) > 1:
                    self.items.append(("exc", exc))
                continue
            if 'File "' in t and _FRAME.match(t):
                # frames without their header: an excerpt, or dynamo's "from user code:" section
                before = self._previous_text(i)
                user = bool(_USER_CODE.match(before))
                exc, i = self.exception(i, i, header=False)
                if user:
                    exc["user_frames"], exc["frames"] = exc["frames"], []
                # a warning's "This call originates from:" stack is not a failure
                if exc["type"] or not _WARNING_STACK.search(before):
                    self.items.append(("exc", exc))
                continue
            if "NCCL WARN" in t and _NCCL_WARN.search(t):
                _keep(self.nccl_warnings, {"class": "nccl", "text": s[:_MAX_ROOT], "line": ln.no, "last": ln.no,
                                           "rank": ln.rank}, _MAX_NCCL_WARNINGS)
            # (an extension that cannot load, logged only as a warning, never heals: evidence)
            quiet = ln.level in _QUIET_LEVELS and not (ln.level[:4] == "WARN" and "undefined symbol" in t)
            if quiet and ln.level[:4] == "WARN" and any(w in t for w in _LATENT_WORDS):
                lm = _LATENT.search(t)
                if lm:
                    self.latent.append({"type": lm.group("type"), "message": lm.group("msg").strip(), "details": [],
                                        "frames": [], "user_frames": [], "skipped_call": None,
                                        "context": t[:lm.start("type")].strip(), "has_traceback": False,
                                        "line": ln.no, "rank": ln.rank, "last": ln.no})
            m = None
            if not quiet and ": " in t and any(w in t for w in _EXC_WORDS):
                m = _EXC_EMBEDDED.search(t)
                if m is None and "): " in t:
                    m = _EXC_REPR.search(t)
            if m is None and not quiet and s[-1:] == ")" and any(w in s for w in _EXC_WORDS) \
                    and not (i + 1 < self.n and "Traceback" in self.text(i + 1)):
                # (a repr right above a traceback header is that traceback's message: read with it)
                m = _EXC_REPR_WHOLE.match(s)
            if m and _CARRIES_ON.search(t[:m.start()]):
                i += 1  # logged and handled: the server goes on without that part
                continue
            if m and not _EXC_EMBEDDED.search(t[:m.start()] or "-"):
                context, message = t[:m.start()].strip(), m.group("msg").strip()
                exc = {"type": m.group("type"), "message": _unquoted(context, message), "details": [], "frames": [],
                       "user_frames": [], "skipped_call": None, "context": context, "has_traceback": False,
                       "line": ln.no, "rank": ln.rank, "last": ln.no}
                i = self.details(i + 1, exc)
                self.items.append(("exc", exc))
                continue
            cls = classify(t) if s else None
            if quiet and cls not in _LOUD:
                cls = None
            if "SIG" in t or "ignal" in t:
                if _STOP_REQUESTED.search(t):
                    self.stop_requested = ln.no
                elif cls == "exit" and self.stop_requested is not None and ln.no - self.stop_requested <= 100 \
                        and _TERMINATED.search(t):
                    cls = None  # a child ended by the stop that was asked for
            if cls:
                item = {"kind": "line", "class": cls, "text": s, "line": ln.no, "last": ln.no, "rank": ln.rank}
                i += 1
                # a panic's message is on the line after `panicked at FILE:LINE:COL:` (Rust >= 1.73)
                if cls == "panic" and s.endswith(":") and i < self.n and self.text(i).strip():
                    item["text"] = s + " " + self.text(i).strip()
                # a C++ message's own trace follows it
                while i < self.n and self.text(i).strip() and not _RAISED_FROM.search(self.text(i)) and i < self.n \
                        and not _FRAME.match(self.text(i)) and not _TB_START.search(self.text(i)) and not classify(self.text(i)) \
                        and _indent(self.text(i)) == 0 and self.lines[i].new_record in (None, ln.new_record) \
                        and self.lines[i].no - item["last"] <= 3 \
                        and not _EXC_EMBEDDED.search(self.text(i)) and not _TERMINATE.search(self.text(i)) \
                        and not _FATAL.search(self.text(i)):
                    i += 1
                while i < self.n and not self.text(i).strip() and i + 1 < self.n and _RAISED_FROM.search(self.text(i + 1)):
                    i += 1
                if i < self.n and _RAISED_FROM.search(self.text(i)):
                    item["cxx_frames"] = []
                    i = self.cxx_trace(i, item)
                self.items.append(("line", item))
                continue
            i += 1
        return self.items


def _chains(items):
    """Python exceptions joined by "The above exception was the direct cause..." into chains."""
    out = []
    prev_exc = None
    pending = None
    for kind, item in items:
        if kind == "sep":
            pending = item
            continue
        if kind == "exc":
            if pending is not None and prev_exc is not None and pending["line"] - prev_exc["last"] <= 60:
                prev_chain = out[-1]
                group = next((k for k, e in enumerate(prev_chain["chain"]) if _GROUP.search(e.get("type") or "")), None)
                if pending.get("sub") and group is not None:
                    # a sub-exception of an ExceptionGroup is what the group reports: its cause
                    if len(prev_chain["chain"]) < _MAX_CHAIN:
                        prev_chain["chain"].insert(group, item)
                        prev_chain["links"].insert(group, "group")
                else:
                    at = _keep(prev_chain["chain"], item, _MAX_CHAIN)
                    del prev_chain["links"][at - 1:]
                    prev_chain["links"].append("cause" if pending["cause"] else "context")
                prev_chain["last"] = max(prev_chain["last"], item["last"])
            else:
                out.append({"kind": "python", "chain": [item], "links": [], "line": item["line"], "last": item["last"],
                            "rank": item["rank"], "cut_above": pending is not None})
            prev_exc = item
            pending = None
            continue
        if kind == "line" and item["class"] in _WEAK and prev_exc is not None:
            # advice printed between the exceptions of one chain (dynamo's hint after each): the
            # chain goes on, the advice is among its lines
            _keep(out[-1].setdefault("advice", []), {"class": item["class"], "text": item["text"], "line": item["line"]},
                  _MAX_ERRORS)
            continue
        out.append(dict(item, chain=[]))
        pending = None
        prev_exc = None
    return out


def _attach(pieces):
    """Failures from the evidence of one stream: nearby pieces belong together."""
    failures = []
    for p in pieces:
        if failures and p["line"] - failures[-1]["last"] <= _GAP and _joinable(failures[-1], p):
            _merge(failures[-1], p)
        else:
            failures.append(_new_failure(p))
    return failures


def _joinable(f, p):
    if p["kind"] == "python":
        # a second Python chain is its own failure unless what came before was only lines
        return not f["chain"] and f["kind"] in ("errors", "cxx")
    return True


def _new_failure(p):
    f = {"kind": {"python": "python", "abort": "abort", "fatal": "fatal"}.get(p["kind"], "errors"),
         "chain": [], "links": [], "abort": None, "fatal": None, "errors": [], "cxx": None,
         "line": p["line"], "last": p["last"], "rank": p["rank"], "cut_above": False}
    _merge(f, p)
    return f


def _names_type(abort):
    return bool(abort["type"]) and not abort["type"].startswith("terminate called")


def _merge(f, p):
    k = p["kind"]
    if k == "python":
        f["chain"], f["links"], f["cut_above"] = p["chain"], p["links"], p["cut_above"]
        for e in p.get("advice") or []:
            _keep(f["errors"], e, _MAX_ERRORS)
        if f["kind"] in ("errors", "cxx"):
            f["kind"] = "python"
    elif k == "abort":
        # a later `terminate called recursively` (another thread dying of the same abort) does not
        # replace an abort that named its exception's type
        if f["abort"] is None or not _names_type(f["abort"]) or _names_type(p):
            f["abort"] = p
        if f["kind"] == "errors":
            f["kind"] = "abort"
    elif k == "fatal":
        # the first dump names the death, unless only a later one kept its message
        if f["fatal"] is None or (f["fatal"]["message"] == NO_FATAL_LINE and p["message"] != NO_FATAL_LINE):
            f["fatal"] = p
        if f["kind"] in ("errors", "abort"):
            f["kind"] = "fatal"
    elif k == "cxx":
        if f["abort"] is not None and not f["abort"]["cxx_frames"]:
            f["abort"]["cxx_frames"] = p["cxx_frames"]
            f["abort"]["raised_from"] = f["abort"]["raised_from"] or p["raised_from"]
        elif f["cxx"] is None:
            f["cxx"] = p
    else:
        _keep(f["errors"], {"class": p["class"], "text": p["text"], "line": p["line"]}, _MAX_ERRORS)
        if p.get("cxx_frames"):
            f["cxx"] = f["cxx"] or {"raised_from": p.get("raised_from"), "cxx_frames": p["cxx_frames"]}
    f["line"] = min(f["line"], p["line"])
    f["last"] = max(f["last"], p["last"])


def _mask(text):
    text = _re.sub(r"0x[0-9a-fA-F]+", "H", text or "")
    return _re.sub(r"\d+(?:\.\d+)?", "N", text)[:160]


def signature(f):
    """What makes two failures the same failure (on another rank, or again)."""
    parts = [f["kind"]]
    for exc in f["chain"]:
        parts.append("%s:%s" % (exc["type"], _mask(exc["message"] or exc["context"])))
        if not exc["type"]:
            tail = (exc["frames"] or exc["user_frames"])[-1:]
            parts.extend("%s:%s" % (fr["path"], fr["func"]) for fr in tail)
    if f["abort"]:
        parts.append("%s:%s" % (f["abort"]["type"], _mask(f["abort"]["what"].split("\n")[0])))
    if f["fatal"]:
        parts.append(_mask(f["fatal"]["message"]))
    if not f["chain"] and not f["abort"] and not f["fatal"]:
        parts.extend(_mask(e["text"]) for e in f["errors"][:1])
    return "|".join(parts)


# The lines every CUDA/HIP error carries, whatever it was: they say nothing of which error it was
# (evidence is what the specific error says: an illegal address, a capture, a missing kernel).
BOILERPLATE = _re.compile(r"(?:CUDA|HIP) kernel errors might be asynchronously reported|"
                          r"For debugging consider passing (?:CUDA_LAUNCH_BLOCKING|AMD_SERIALIZE_KERNEL)|"
                          r"Compile with .?TORCH_USE_(?:CUDA|HIP)_DSA.? to enable device-side assertions")


def epitaph(text):
    """Whether a line only reports that a process died or failed to start (an engine core, a
    worker, a scheduler, an actor): a consequence, never the cause."""
    return bool(_CONSEQUENCE_EXC.search(text) or (classify(text) in _CONSEQUENCE) or _EPITAPH.search(text))


_EPITAPH = _re.compile(r"(?:Scheduler|TpModelWorkerClient|DataParallelController|TokenizerManager|Detokenizer\w*) hit an "
                       r"exception|\bactor died\b|The actor (?:died|is dead)|Worker failed with error|WorkerProc failed to start|"
                       r"WorkerProc hit an exception|Engine core proc \S+ died|Worker proc \S+ died|"
                       # vLLM V0's front end when its engine process exited: `RuntimeError('Engine process (pid 76) died.')`
                       r"Engine process \(pid \d+\) died")


NO_EXCEPTION_LINE = "(exception line not in the log)"
NO_FATAL_LINE = "(a faulthandler dump; its message is not in the log)"


def describe(exc):
    """`Type: message` of one exception of a chain."""
    if not exc:
        return ""
    if exc.get("type"):
        # a message that starts on the line below (`raise ImportError("\n[sgl_kernel] ...")`):
        # its first line
        message = exc.get("message") or next((d for d in exc.get("details") or [] if d.strip()), "")
        return exc["type"] + (": " + message.strip() if message else "")
    return NO_EXCEPTION_LINE


def _death(f):
    if f["abort"]:
        what = f["abort"]["what"].split("\n")[0]
        return "%s: %s" % (f["abort"]["type"], what) if f["abort"]["type"] else what
    if f["fatal"]["message"] == NO_FATAL_LINE:
        return NO_FATAL_LINE
    return "Fatal Python error: " + f["fatal"]["message"]


_WORDS_ONLY = _re.compile(r"\W+")


def _repeats(text, chain):
    """Whether an error line says what an exception of the chain says (its message in a repr,
    wrapped, or logged again): the line's words, in order, are part of the exception's message."""
    words = _WORDS_ONLY.sub(" ", text).strip()
    if len(words) < 12:
        return False
    for exc in chain:
        if exc.get("type") and words in _WORDS_ONLY.sub(" ", exc.get("message") or ""):
            return True
    return False


# A reporter's sentence that introduces the log ("Error: it crashes when I ... Log below:"): never
# the root when an exception follows it.
_PROSE = _re.compile(r"\b(?:[Bb]elow|the following|as follows)\b[^.]*[:.]?\s*$|(?:^|\s)(?:I|I'm|I've|my|we) ")


def summarise(f):
    """Root and final exception of a failure, as the user reads them."""
    strong = [e for e in f["errors"] if e["class"] not in _CONSEQUENCE and e["class"] not in _WEAK]
    causes = strong + [e for e in f["errors"] if e["class"] in _WEAK]
    if f["chain"]:
        typed = [e for e in f["chain"] if e.get("type")]
        if typed:
            root, final = describe(typed[0]), describe(f["chain"][-1])
            # an error printed above the traceback (a kernel's CUDA error) is the earlier cause,
            # unless it only repeats the exception (a logger's message, a repr of it)
            said = [e for e in strong if not _PROSE.search(e["text"])]
            if said and said[0]["line"] < f["chain"][0]["line"] and not _repeats(said[0]["text"], f["chain"]):
                root = said[0]["text"]
        elif f["fatal"] or f["abort"]:
            # frames without their exception line, then the process died: the death says more
            root = final = _death(f)
            if causes and causes[0]["line"] < f["chain"][0]["line"]:
                root = causes[0]["text"]
        else:
            final = NO_EXCEPTION_LINE
            # (a shell prompt before the header, `$ Traceback ...`, says nothing)
            context = next((e["context"] for e in f["chain"] if _re.search(r"[A-Za-z]{2}", e.get("context") or "")), "")
            root = causes[0]["text"] if causes else (context or final)
    elif f["abort"] or f["fatal"]:
        root = final = _death(f)
        # a kernel's device-side assert (or another error line) printed before the C++ abort that
        # reports it (`terminate called ... c10::Error`, what(): device-side assert triggered) is its cause
        if strong and strong[0]["line"] < (f["abort"] or f["fatal"])["line"]:
            root = strong[0]["text"]
    elif f["errors"]:
        causes = causes or f["errors"]
        root, final = causes[0]["text"], f["errors"][-1]["text"]
    else:
        # a C++ stack alone (`Exception raised from ...`, `frame #N`): its top is all there is
        trace = f["cxx"] or {}
        root = final = "C++ exception raised from " + trace["raised_from"] if trace.get("raised_from") else \
            "C++ stack, top: " + (trace.get("cxx_frames") or ["?"])[0]
    # (a message of a 16 KiB line is read, not printed whole: the root a user reads is its start)
    return root[:_MAX_ROOT], final[:_MAX_ROOT]


def all_frames(f):
    """Python frames of a failure: the chain's, dynamo's user-code frames, a fatal's current thread."""
    frames = []
    for exc in f["chain"]:
        frames.extend(exc["frames"])
        frames.extend(exc["user_frames"])
    if f["fatal"]:
        threads = f["fatal"]["threads"]
        cur = [t for t in threads if t["current"]] or threads
        for t in cur:
            frames.extend(t["frames"])
    return frames


def _shows_no_cause(f):
    """A failure that says what died but not why: no exception line of its own (a traceback cut
    above it), only exceptions that report another process's death, or only exit lines."""
    if f["abort"] or f["fatal"] or any(e["class"] not in _CONSEQUENCE for e in f["errors"]):
        return False
    typed = [e for e in f["chain"] if e.get("type")]
    return not typed or _only_reports_a_death(f) or not f["chain"]


def _attach_nccl_warnings(f, warnings, lines):
    """NCCL's warnings (sorted, with their line numbers) in the _GAP lines above a failure that
    shows no cause of its own become its first error lines (its root): NCCL said what failed, the
    process only what died."""
    if not warnings or not _shows_no_cause(f):
        return
    near = warnings[_bisect.bisect_left(lines, f["line"] - _GAP):_bisect.bisect_right(lines, f["line"])]
    if near:
        f["errors"] = sorted(near + f["errors"], key=lambda e: e["line"])[:_MAX_ERRORS]
        f["line"] = min(f["line"], near[0]["line"])


def _only_reports_a_death(f):
    """A Python failure whose exceptions only say that another process failed."""
    if f["kind"] != "python" or f["errors"] or f["abort"] or f["fatal"]:
        return False
    said = [describe(e) if e.get("type") else e["context"] for e in f["chain"]]
    return all(s and _CONSEQUENCE_EXC.search(s) for s in said)


def ended_abnormally(lines):
    """{line, text, how}: the last line saying the process died or exited in failure, else the
    log's last line when the log stops inside a traceback; None when it shows neither."""
    found, stop_requested = None, None
    for ln in lines:
        t = ln.text
        if ("SIG" in t or "ignal" in t) and _STOP_REQUESTED.search(t):
            stop_requested = ln.no
            continue
        if ln.level in _QUIET_ENDED or not any(w in t for w in _ENDED_WORDS):
            continue
        if stop_requested is not None and ln.no - stop_requested <= 100 and _TERMINATED.search(t):
            continue  # ended by the stop that was asked for
        if _ENDED.search(t):
            found = {"line": ln.no, "text": t.strip()[:300], "how": "died"}
    tail = [ln for ln in lines[-3:] if ln.text.strip()]
    if tail:
        last, before = tail[-1], (tail[-2].text if len(tail) > 1 else "")
        t = last.text
        # (a faulthandler dump, `line 24 in get` with no comma, ends with a frame by design)
        inside = ((_FRAME.match(t) and ", in" in t) or _FRAME_START.match(t) and not _FRAME.match(t)
                  or _TB_START.search(t) or _CAUSE in t or _CONTEXT in t
                  or (_FRAME.match(before) and ", in" in before and (_indent(t) > _indent(before) or _CARETS.match(t))))
        if inside and found is None and last.level not in _QUIET_TRACEBACK:
            found = {"line": last.no, "text": t.strip()[:300], "how": "mid-traceback"}
    return found


# Signs of a failure in a log where no traceback, abort, fatal dump or error line was found: a
# failure is never reported clean (issue 38). Strong signs count at any log level: a signal
# (`Caught signal 7 (Bus error)` above an empty ChildFailedError), a vendor's error tag
# (`[TensorRT-LLM][ERROR] Assertion failed: ...`), a failed assertion, an exception written as
# its constructor (`ValueError("` with the message on the next line), a CUDA/NCCL error or an
# out of memory inside a warning, a timeout or a wait given up.
_SIGNS = [
    ("signal", _re.compile(r"Caught signal \d+|\bSIG(?:SEGV|BUS|ABRT|ILL|FPE|KILL)\b|\bBus error\b|Segmentation fault|core dumped")),
    ("vendor", _re.compile(r"^\[[^\]\n]{1,40}\]\[(?:ERROR|FATAL|CRITICAL|E|F)\]")),
    ("assert", _re.compile(r"\bAssertion\b.{0,300}\bfailed|\b[Aa]ssert(?:ion)? failed|\bAssertionError\b")),
    ("constructor", _re.compile(r"(?<![\w.])(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception))\(\s*(?P<rest>[\"'].*|$)")),
    ("cuda", _re.compile(r"\bCUDA error\b|\bcudaError\w+|\bNCCL (?:error|WARN)\b|\bout of memory\b|\bOOM\b|"
                         r"illegal memory access|device-side assert|\bsegfault")),
    ("timeout", _re.compile(r"(?i)\btimed out\b|\btime ?out\b(?!\s*[=:])(?:\s+\d+\s*s\b)?.{0,40}?\b(?:error|expired|reached|"
                            r"exceeded|while|after|waiting)\b|deadline exceeded|\b(?:gave|giving) up\b|did not (?:become|get) ready|"
                            r"never became ready|(?:startup|health[- ]check|wait(?:ing)?|ready)\S* .{0,60}\btimeout\b")),
]
_SIGN_WORDS = ("ignal", "SIG", "Bus error", "Segmentation", "core dumped", "][", "ssert", "Error(", "Exception(", "CUDA",
               "cuda", "NCCL", "out of memory", "OOM", "imed out", "imeout", "deadline", "gave up", "giving up", "ready",
               "illegal memory", "device-side", "segfault")
# Weak signs, any level: failure words. They count where the log shows no server that went on
# (loaded, started, served: _SERVED) after them, and never in a line that says the server handled it and went on, or in one
# that only waits for something still starting.
_SIGN_WEAK = _re.compile(r"(?i)\b(?:error|errors|failed|failure|fatal|exception|crash(?:es|ed|ing)?|abort(?:ed)?|panic|"
                         r"could not|couldn't|cannot|unable to)\b")
_SIGN_HANDLED = _re.compile(r"(?i)\b(?:ignor(?:e|ed|ing)|retry|retrying|will retry|falling back|fall back|skipp(?:ing|ed)|"
                            r"disabled|disabling|continuing|deprecated|failed to connect|connection refused|"
                            r"health check failed|not ready|waiting|is pending|0 errors?|no errors?|errors?=0|"
                            r"error_?(?:rate|count)|\w+_error\w*=|if you (?:see|get|encounter))\b|=\s*(?:False|None|True)\b|"
                            r"Warning: |\bif\b[^.]{0,60}\b(?:occurs?|happens?|encounter\w*|you see|you get)\b|\bconsider\b|"
                            r"\b(?:may|might|can) (?:\w+ ){0,3}(?:fail|error|crash)|"
                            # torch's c10d on a host without a resolvable name: harmless, said at every start
                            r"hostname of the client socket cannot be retrieved")
_IGNORED = _re.compile(r"(?i)\bignor(?:e|ed|ing)\b")
# Advice is no failure: vLLM's INFO at every CUDA graph capture ("If you are running out of memory,
# consider decreasing `gpu_memory_utilization`"), a tokenizer's warning that a text is longer than
# the model ("... will result in indexing errors": a server truncates or refuses such a prompt).
_ADVICE = _re.compile(r"(?i)\bif (?:you(?:'re| are)?|the|an?|it|this)\b[^.]{0,80}?,? (?:please )?(?:consider|try|reduce|decrease|"
                      r"lower|increase|set|use|enable|disable)\b|\bconsider (?:decreasing|reducing|increasing|lowering|"
                      r"raising|using|setting|enabling|disabling)\b|will result in (?:indexing )?errors\b")
_SERVED = _re.compile(r"Uvicorn running on|Application startup complete|The server is fired up|\b200 OK\b|HTTP/1\.1\\?\" 200|"
                      r"Avg (?:prompt|generation) throughput|Decode batch|Prefill batch|Started server process|"
                      r"Connected|[Rr]eady to (?:roll|serve)|[Ss]erver (?:is )?(?:started|ready|listening)|"
                      r"Starting (?:the )?(?:HTTP|API) server|Available routes are|Route: /|Warming up|"
                      r"Capturing (?:cuda|CUDA) graph|Graph capturing finished|KV cache|Loading (?:safetensors|weights)|"
                      r"Model loading took|Memory profiling takes|Loading model weights took|Load weight end")
_HANG_REPEATS = 20  # the same notice this many times at the end of the log, nothing served: a wait that never ended


def _sign_text(kind, m, lines, k):
    """What a sign says, as the root a user reads: a constructor's message joined from the next line."""
    t = lines[k].text.strip()
    if kind == "constructor":
        rest = m.group("rest").strip().strip("\"'),").strip()
        if not rest and k + 1 < len(lines):
            rest = lines[k + 1].text.strip().strip("\"'),").strip()
        return "%s: %s" % (m.group("type"), rest) if rest else t
    return t


def failure_signs(lines):
    """[{line, text, class}]: the lines showing a failure in a log nothing else found one in,
    strongest first (at most 8): strong signs at any level, then weak ones where no server that
    started or served follows them, then a notice repeated until the log ends."""
    strong, weak = [], []
    served_after = None  # the last line showing a server that went on (loaded, started, served)
    for ln in lines:
        if any(w in ln.text for w in ("running", "complete", "fired", "200", "throughput", "batch", "Started", "Connected",
                                      "eady", "erver", "Starting", "routes", "Route", "Warming", "apturing", "KV cache",
                                      "Loading", "took", "takes", "Load weight")) and _SERVED.search(ln.text):
            served_after = ln.no
    stop_requested = None
    for k, ln in enumerate(lines):
        t = ln.text
        s = t.strip()
        if not s:
            continue
        if ("SIG" in t or "ignal" in t) and _STOP_REQUESTED.search(t):
            stop_requested = ln.no
        if stop_requested is not None:
            continue  # a stop that was asked for: what the processes say while stopping is no failure
        if any(w in t for w in _SIGN_WORDS):
            for kind, rx in _SIGNS:
                m = rx.search(t)
                if m and kind == "constructor" and m.start() > len(t) - len(t.lstrip()) and m.group("rest").strip() not in "\"'":
                    m = None  # a repr inside a message (`with ImportError('...')`): what the message says decides
                if m and not (kind in ("assert", "cuda", "timeout") and (_CARRIES_ON.search(t) or _IGNORED.search(t)
                                                                          or _ADVICE.search(t))):
                    strong.append({"class": "sign-" + kind, "text": _sign_text(kind, m, lines, k)[:400], "line": ln.no})
                    break
            else:
                m = None
            if m:
                continue
        if ln.level in _QUIET_LEVELS and any(w in t for w in _LATENT_WORDS) and _LATENT.search(t):
            continue  # an optional part's import failure logged as a warning (_LATENT): no failure by itself
        if (ln.level in ("ERROR", "CRITICAL", "FATAL") or _SIGN_WEAK.search(t)) and not _SIGN_HANDLED.search(t) \
                and not _ADVICE.search(t) \
                and (served_after is None or served_after < ln.no):
            weak.append({"class": "sign-error", "text": s[:400], "line": ln.no})
    signs = strong + weak
    if not signs and lines and served_after is None:
        masked = [_mask(ln.text.strip()) for ln in lines if ln.text.strip()]
        last = masked[-1] if masked else ""
        run = 0
        for m in reversed(masked):
            if m != last:
                break
            run += 1
        if run >= _HANG_REPEATS:
            ln = next(ln for ln in reversed(lines) if ln.text.strip())
            signs.append({"class": "sign-hang", "text": "%s (the same notice %d times until the log ends)"
                          % (ln.text.strip()[:300], run), "line": ln.no})
    return signs[:8]


def _sign_finding(signs):
    f = {"kind": "signs", "chain": [], "links": [], "abort": None, "fatal": None, "errors": signs, "cxx": None,
         "line": min(s["line"] for s in signs), "last": max(s["line"] for s in signs), "rank": "", "cut_above": False,
         "ranks": ["main"], "occurrences": 1}
    f["root_exception"], f["final_exception"] = signs[0]["text"], signs[-1]["text"]
    return f


def scan(text):
    """Every failure in a log, the same failure on several ranks grouped into one finding."""
    lines = normalise(text)
    failures, latent, nccl_warnings = [], [], []
    for _name, stream_lines in streams(lines):
        stream = _Stream(stream_lines)
        pieces = _chains(stream.scan())
        failures.extend(_attach(pieces))
        latent.extend(stream.latent)
        nccl_warnings.extend(stream.nccl_warnings)
    failures.sort(key=lambda f: f["line"])
    latent.sort(key=lambda e: e["line"])
    nccl_warnings.sort(key=lambda e: e["line"])
    # Unprefixed lines next to a failure of a rank (a CUDA error a kernel printed to stderr,
    # just above the rank's traceback) and consequence-only failures join that failure.
    last_real = None
    for k, f in enumerate(failures):
        only_lines = f["kind"] == "errors" and not f["cxx"]
        if only_lines and all(e["class"] in _WEAK for e in f["errors"]):
            # advice only (another rank's copy of SGLang's piecewise hint): it belongs to the
            # failure it advises on, the next one close below it, or the last one above
            g = next((g for g in failures[k + 1:k + 6] if g["line"] - f["last"] <= _GAP
                      and (g["kind"] != "errors" or any(e["class"] not in _WEAK for e in g["errors"]))), None)
            if g is not None or last_real is not None:
                g = g if g is not None else last_real
                g["errors"] = sorted(g["errors"] + f["errors"], key=lambda e: e["line"])[:_MAX_ERRORS]
                g["line"], g["last"] = min(g["line"], f["line"]), max(g["last"], f["last"])
                f["absorbed"] = True
                continue
        near = None
        if only_lines and f["rank"] == "":
            for g in failures[max(0, k - 4):k] + failures[k + 1:k + 5]:
                if g["kind"] != "errors" and (abs(g["line"] - f["last"]) <= 3 or abs(f["line"] - g["last"]) <= 3):
                    near = g
                    break
        if near is not None:
            near["errors"] = sorted(near["errors"] + f["errors"], key=lambda e: e["line"])[:_MAX_ERRORS]
            near["line"], near["last"] = min(near["line"], f["line"]), max(near["last"], f["last"])
            f["absorbed"] = True
        elif only_lines and all(e["class"] in _CONSEQUENCE for e in f["errors"]):
            if last_real is not None:
                for e in f["errors"]:
                    _keep(last_real["errors"], e, _MAX_ERRORS)
                f["absorbed"] = True
        elif last_real is not None and _only_reports_a_death(f):
            # (kept apart from its evidence: what the front end says is no cause)
            last_real.setdefault("consequences", []).append(
                {"line": f["line"], "text": describe(f["chain"][-1]) if f["chain"][-1].get("type")
                 else f["chain"][-1]["context"]})
            f["absorbed"] = True
        else:
            last_real = f
    kept = [f for f in failures if not f.get("absorbed")]
    for f in kept:
        before = [e for e in latent if e["line"] < f["line"]]
        if before and _shows_no_cause(f):
            # the import failure a warning carried earlier is the cause this failure does not show
            f["chain"].insert(0, before[-1])
            f["links"].insert(0, "earlier")
            f["kind"] = "python" if f["kind"] == "errors" else f["kind"]
    nccl_lines = [w["line"] for w in nccl_warnings]
    for f in kept:
        _attach_nccl_warnings(f, nccl_warnings, nccl_lines)
    findings = []
    by_sig = {}
    for f in kept:
        sig = signature(f)
        rank = f["rank"] or "main"
        if sig in by_sig:
            g = by_sig[sig]
            g["occurrences"] += 1
            if rank not in g["ranks"]:
                g["ranks"].append(rank)
            continue
        f["ranks"] = [rank]
        f["occurrences"] = 1
        f["root_exception"], f["final_exception"] = summarise(f)
        by_sig[sig] = f
        findings.append(f)
    ended = ended_abnormally(lines)
    if not findings and ended is None:
        signs = failure_signs(lines)
        if signs:
            findings.append(_sign_finding(signs))
    result = {"findings": findings[:_MAX_FINDINGS], "more": max(0, len(findings) - _MAX_FINDINGS), "lines": len(lines),
              "ended": ended}
    if newest_first(text[:400000].splitlines()):  # (the lines normalise() judged by)
        result["newest_first"] = True  # (read oldest first: its line numbers count from the oldest line)
    return result
