"""A failure's category from what its lines say, for the failures no known issue names (and to
order the known issues when several of other categories match): the way an SRE reads a log, the
failing statement and its context - exception classes and messages, the library and module in
its frames, signal names, error codes, words such as out of memory / NCCL / undefined symbol.

Two parts, added: a hand-written lexicon of cues (regex -> category, weight: below, written from
what each category's failures say, not fitted), and a naive Bayes model over the words, word pairs,
exception classes and frame modules of the evidence, learned from the labelled real logs of
tests/fixtures/real (servops/data/diagnose_categories.json; tests/diagnose_score.py --kfold checks it
held out by thread and prints its calibration curve, --write-model writes it).

A category is shown only when the model's confidence reaches the model's threshold, chosen held
out by thread for at most 1 wrong category in 20 shown; below it the failure is "uncategorised"
with the category it leans to. Pure functions; standard library only.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

MODEL_PATH = Path(__file__).resolve().parent / "data" / "diagnose_categories.json"

# (category, weight, regex): what a category's failures say in any library's words. A weight of 3
# is a cue that alone names the category; 1 one that only leans towards it.
CUES = [
    ("dynamo-trace", 3, r"torch\._dynamo|\bDynamo\b|TorchDynamo|InternalTorchDynamoError|graph break|from user code:|"
                        r"TORCHDYNAMO_VERBOSE|fall back to eager|stream is capturing|StreamCaptureUnsupported"),
    ("dynamo-trace", 1, r"torch\.compile|\bUnsupported: |piecewise"),
    ("cuda-oom", 3, r"(?i)out of memory|OutOfMemoryError|\bOOM\b|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|"
                    r"No available memory for the cache blocks|Tried to allocate"),
    ("cuda-oom", 1, r"(?i)KV cache|gpu[-_]memory[-_]utilization|mem[-_]fraction|free memory|memory profil"),
    ("nccl", 3, r"\bNCCL\b|\bnccl\w*|ProcessGroupNCCL|collective operation timeout|\bc10d\b|\bGloo\b|\bgloo\b|"
                r"[Rr]endezvous|TCPStore|DistNetworkError|DistStoreError|MASTER_ADDR|dist[-_]init[-_]addr"),
    ("nccl", 1, r"all_?reduce|all_?gather|broadcast|process group|init_process_group|\bib\b|RDMA|DeepEP|nvshmem"),
    ("illegal-memory-access", 3, r"(?i)illegal memory access|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS|"
                                 r"misaligned address|device-side assert|unspecified launch failure|\bXid\b"),
    ("jit-build", 3, r"\bninja\b|\bnvcc\b|compilation terminated|error: command '.*' failed|BuildExtension|"
                     r"cpp_extension|\bptxas\b|Error building extension|fatal error: \S+\.h"),
    ("jit-build", 1, r"(?i)\bjit\b|CalledProcessError|\bgcc\b|\bg\+\+|compil"),
    ("arch-unsupported", 3, r"(?i)compute capability|no kernel image|cudaErrorNoKernelImageForDevice|illegal instruction|"
                            r"\bSIGILL\b|not supported on (?:this|your|the current) (?:GPU|device|architecture)|"
                            r"unsupported (?:GPU|architecture|arch)"),
    ("arch-unsupported", 1, r"\bsm_?\d{2,3}a?\b|\bSM\d{2,3}\b|Blackwell|Hopper|Ampere|Turing|Volta|\bAVX|\bAMX\b|gfx\d+"),
    ("model-load", 3, r"(?i)not a local folder|repo[_ ]id|HFValidationError|RepositoryNotFound|does not appear to have a file|"
                      r"safetensors|state_dict|checkpoint|config\.json|model_path|weight name|gated repo|tokenizer"),
    ("model-load", 1, r"(?i)\bweights?\b|No such file or directory|trust[-_]remote[-_]code|architectures?\b|KeyError|"
                      r"huggingface|load(?:ing)? (?:the )?model"),
    ("port-in-use", 3, r"(?i)address (?:already )?in use|EADDRINUSE|errno 98|port \d+ is (?:in use|already|not available)"),
    ("port-in-use", 1, r"(?i)\bbind\b|\bport\b"),
    ("triton-resources", 3, r"OutOfResources|out of resource|shared memory, Required"),
    ("triton-resources", 1, r"(?i)\btriton\b|num_stages|num_warps|BLOCK_[A-Z]"),
    ("quantization", 3, r"(?i)quantiz|\bfp8\b|\bfp4\b|nvfp4|mxfp4|\bawq\b|\bgptq\b|marlin|bitsandbytes|w8a8|w4a16|"
                        r"compressed[-_]tensors|modelopt|\bgguf\b"),
    ("quantization", 1, r"(?i)\bint[48]\b|\bscales?\b|block[-_]?wise|per[-_]?tensor|cutlass"),
    ("config", 3, r"(?i)unrecognized arguments|not divisible|divisible by|ValidationError|validation error|"
                  r"must be (?:one of|a|an|at|less|greater|divisible)|"
                  r"max[-_]model[-_]len|context[-_ ]length|is larger than|exceeds"),
    # an invalid argument or value, but not in a GPU runtime's error report (`CUDA error: invalid
    # argument`, `[FT][ERROR] CUDA runtime error: invalid argument`, `CUDA error in k.cu:178
    # executing 'cudaLaunchKernelEx(...)': invalid argument`): that is a kernel launch's or an
    # allocation's bad value (cudaErrorInvalidValue), no setting of the server's
    ("config", 3, r"(?i)^(?!.*\b(?:CUDA|HIP)(?: runtime)? error\b).*?\binvalid (?:argument|value|choice|config)"),
    ("config", 1, r"(?i)argument|ServerArgs|EngineArgs|\bflag\b|--[a-z][\w-]+|expected|should be|not supported|"
                  r"tensor[-_]parallel|tp[-_]size"),
    ("install", 3, r"ImportError|ModuleNotFoundError|No module named|undefined symbol|cannot import name|"
                   r"_OpNamespace|GLIBC|shared library|cannot open shared object|version mismatch|"
                   r"(?:was|were) compiled (?:against|with)|NameError"),
    ("install", 1, r"(?i)\bversion\b|has no attribute|\.so\b|libcuda|libcudart|pip install|requires?|incompatible|"
                   r"\b_C\b|AttributeError|TypeError|driver"),
    ("host-limits", 3, r"(?i)too many open files|ulimit|pthread_create|can't start new thread|"
                       r"resource temporarily unavailable|/dev/shm|\bshm\b|SIGBUS|Bus error|No space left|ENOSPC|"
                       r"oom-kill|OOMKilled|Killed process|RLIMIT"),
    ("host-limits", 1, r"(?i)shared memory|\bKilled\b|\bthreads?\b|file descriptor|disk"),
    # a bus error where shared memory is set up: /dev/shm too small for NCCL's or the allocator's
    # segments (both in one line; two patterns, each searched once: no backtracking over the line)
    ("host-limits", 4, (r"(?i)bus error|sigbus|signal 7\b", r"(?i)/dev/shm|\bshm|shared memory")),
    ("engine-death", 3, r"EngineDeadError|EngineCore failed|Engine core initialization failed|scheduler is dead|"
                        r"Child process unexpectedly|RayActorError|actor died|ChildFailedError|WorkerProc"),
    ("engine-death", 1, r"(?i)exit ?code|SIGQUIT|sigquit|\bdied\b|terminated|\bdead\b|engine core"),
]
_CUES = [(cat, w, tuple(re.compile(r) for r in (rx if isinstance(rx, tuple) else (rx,)))) for cat, w, rx in CUES]
# Exception classes any library raises for anything: a bare AssertionError, NotImplementedError,
# ValueError, RuntimeError or a TGI ShardFailed names no category by itself (what its message says
# decides).
GENERIC = frozenset({"assertionerror", "notimplementederror", "valueerror", "runtimeerror", "exception", "shardfailed",
                     "error"})

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_HEXISH = re.compile(r"^(?:0x)?[0-9a-f]{6,}$|^\d")
_STOP = frozenset("""the and for with from this that not are was were has have had but can may will would could should
into onto its it's you your our their them then than there here when where which while what who how all any each
use used using line file files self none true false return raise def lib usr local home root python python3 site
packages dist opt tmp app src workspace""".split())
_GENERIC_PATH = frozenset({"", "usr", "lib", "lib64", "local", "home", "root", "opt", "tmp", "site-packages",
                           "dist-packages", "python", "app", "workspace", "src", "conda", "envs", "venv", ".venv",
                           "miniconda3", "anaconda3", "__init__", "<frozen runpy>", "<string>"})


@dataclass
class Category:
    name: str                  # a category of diagnose.CATEGORIES, or "unknown"
    confidence: float          # the model's probability of it, 0..1
    evidence: list[str] = field(default_factory=list)   # the lines that point to it most
    scores: dict[str, float] = field(default_factory=dict)
    threshold: float = 0.0     # the confidence below which it is not shown (the model's)

    @property
    def shown(self) -> bool:
        """Whether it is the category a user reads, not only the one the evidence leans to."""
        return self.name != "unknown" and self.confidence >= self.threshold


def _path_tokens(frame: str) -> set[str]:
    """Packages and modules a frame names: `p:torch`, `p:_dynamo`, `p:scheduler`, `fn:capture`."""
    out = set()
    path, _, func = frame.rpartition(":") if ".py:" in frame else ("", "", frame)
    if path:
        parts = re.split(r"[\\/]", path)
        if "site-packages" in parts or "dist-packages" in parts:
            k = max(i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages"))
            parts = parts[k + 1:]
        for part in parts:
            stem = part[:-3] if part.endswith(".py") else part
            if stem.lower() not in _GENERIC_PATH and not stem.startswith("python3") and not _HEXISH.match(stem.lower()):
                out.add("p:" + stem.lower())
        if func:
            out.add("fn:" + func.strip().lower())
    else:  # a C++ symbol: its namespaces and class
        for part in re.findall(r"[A-Za-z_]\w+", frame.split("(")[0])[:4]:
            if part.lower() not in _STOP and len(part) > 2:
                out.add("p:" + part.lower())
    return out


# (diagnose reads each line's words and cues once per category it weighs, k-fold scoring once
# per fold and weight: both are pure functions of the line)
@functools.lru_cache(maxsize=65536)
def line_features(line: str) -> frozenset[str]:
    """Words (`w:`) and word pairs (`b:`) of one evidence line."""
    words = [w.lower() for w in _WORD.findall(line)]
    words = [w for w in words if len(w) >= 3 and w not in _STOP and w not in GENERIC and not _HEXISH.match(w)]
    feats = {"w:" + w for w in words}
    feats.update("b:%s_%s" % pair for pair in zip(words, words[1:]))
    return frozenset(feats)


@functools.lru_cache(maxsize=65536)
def cues_of(line: str) -> tuple[tuple[str, int], ...]:
    return tuple((cat, w) for cat, w, rxs in _CUES if all(rx.search(line) for rx in rxs))


# A wrapper's message with the real error quoted inside it (`Worker failed with error '...'`,
# `RayTaskError(...): ... died with exception "..."`): the quoted error is what the category reads.
_WRAPPED = re.compile(r"(?i)\b(?:failed|died|crashed|exited|terminated|raised)\b[^'\"\n]{0,30}?\b(?:with|:)\s*"
                      r"(?:(?:an? )?(?:error|exception)\s*[:=]?\s*)?['\"](?P<inner>[^'\"\n]{8,})['\"]")


def unwrap(line: str) -> str:
    m = _WRAPPED.search(line)
    return m.group("inner") if m else line


def features(types: list[str], text: str, frames: list[str], classes: list[str] = (),
             epitaph=lambda line: False) -> tuple[set[str], list[str]]:
    """(features, evidence lines) of one failure's evidence (diagnose.evidence). A line that only
    reports a death (`epitaph`: an engine core or worker that failed to start) weighs nothing
    beside anything else the failure shows."""
    lines = [unwrap(ln.strip()) for ln in text.split("\n") if ln.strip()]
    said = [ln for ln in lines if not epitaph(ln)]
    if said or frames:
        lines = said
    feats: set[str] = set()
    for t in types:
        name = t.rsplit(".", 1)[-1].lower()
        if name in GENERIC:
            continue
        feats.add("exc:" + name)
        if "." in t:
            feats.add("excmod:" + t.split(".", 1)[0].lower())
    for ln in lines:
        feats |= line_features(ln)
    for fr in frames:
        feats |= _path_tokens(fr)
    feats.update("cls:" + c for c in classes)
    return feats, lines


# -- the learned part: multinomial naive Bayes over feature presence ---------------------------

def train(samples: list[tuple[set[str], str]], alpha: float = 0.5, min_df: int = 2) -> dict:
    """A model from (features, category) samples: per category its sample count and how many of
    its samples hold each feature (features in fewer than min_df samples are left out)."""
    df: dict[str, int] = {}
    for feats, _ in samples:
        for f in feats:
            df[f] = df.get(f, 0) + 1
    vocab = sorted(f for f, n in df.items() if n >= min_df)
    keep = set(vocab)
    docs: dict[str, int] = {}
    counts: dict[str, dict[str, int]] = {}
    for feats, cat in samples:
        docs[cat] = docs.get(cat, 0) + 1
        for f in feats & keep:
            counts.setdefault(f, {})
            counts[f][cat] = counts[f].get(cat, 0) + 1
    return {"alpha": alpha, "docs": dict(sorted(docs.items())),
            "counts": {f: dict(sorted(counts[f].items())) for f in vocab if f in counts}}


def _totals(model: dict) -> dict[str, int]:
    tot = model.get("_totals")
    if tot is None:
        tot = {c: 0 for c in model["docs"]}
        for per in model["counts"].values():
            for c, n in per.items():
                tot[c] += n
        model["_totals"] = tot
    return tot


def _log_denominators(model: dict) -> dict[str, float]:
    den = model.get("_log_den")
    if den is None:
        a, vocab = model["alpha"], len(model["counts"])
        den = model["_log_den"] = {c: math.log(n + a * vocab) for c, n in _totals(model).items()}
    return den


def _loglik(model: dict, feat: str, cat: str) -> float:
    a = model["alpha"]
    den = _log_denominators(model).get(cat)
    if den is None:  # (a category the model never saw: no feature counted in it)
        den = math.log(a * len(model["counts"]))
    return math.log(model["counts"][feat].get(cat, 0) + a) - den


def classify(feats: set[str], lines: list[str], model: dict | None, cue_weight: float = 1.0,
             categories: tuple[str, ...] | None = None) -> Category:
    """The category the evidence points to, its probability and the lines that point to it most;
    "unknown" only when no feature the model knows and no cue points anywhere."""
    cats = list(categories or (model or {}).get("docs") or sorted({c for c, _, _ in CUES}))
    known = [f for f in feats if model and f in model["counts"]]
    line_cues = [cues_of(ln) for ln in lines]
    if not known and not any(line_cues):
        return Category("unknown", 0.0)
    n_docs = sum((model or {}).get("docs", {}).values()) or 1
    scores = {}
    for c in cats:
        s = 0.0
        if model:  # (a category no labelled log had: half a log's prior, every feature unseen in it)
            s = math.log(model["docs"].get(c, 0.5) / n_docs) + sum(_loglik(model, f, c) for f in known)
        s += cue_weight * sum(w for cues in line_cues for cat, w in set(cues) if cat == c)
        scores[c] = s
    ranked = sorted(scores, key=lambda c: -scores[c])
    top = ranked[0]
    # (naive Bayes adds one log-likelihood per feature as if each were independent evidence: the
    # probability it gives is tempered by the square root of their number)
    temper = math.sqrt(len(known) + 1)
    z = max(scores.values())
    total = sum(math.exp((v - z) / temper) for v in scores.values())
    confidence = 1.0 / total
    second = ranked[1] if len(ranked) > 1 else top

    def pull(ln: str, cues) -> float:
        fs = [f for f in line_features(ln) if model and f in model["counts"]]
        v = sum(_loglik(model, f, top) - _loglik(model, f, second) for f in fs) if model else 0.0
        return v + cue_weight * sum(w for cat, w in set(cues) if cat == top)

    pulls = sorted(((pull(ln, cues), k) for k, (ln, cues) in enumerate(zip(lines, line_cues))), reverse=True)
    evidence = [lines[k] for k in sorted(k for v, k in pulls[:2] if v > 0)]
    return Category(top, round(confidence, 2), evidence, scores, (model or {}).get("threshold", 0.0))


_MODEL: dict | None = None


def load_model(path: Path = MODEL_PATH) -> dict | None:
    """The shipped model (None when the file is absent: the lexicon alone decides)."""
    global _MODEL
    if _MODEL is None and path.is_file():
        _MODEL = json.loads(path.read_text())
    return _MODEL
