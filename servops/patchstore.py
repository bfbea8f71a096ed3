"""The local patch store: `patches/<distribution>/<name>.patch` + `<name>.yml` metadata.

The patch is a unified diff with paths relative to site-packages (`a/` and `b/` prefixes);
unidiff parses it, so a malformed file or a metadata `files` list that disagrees with the
diff is caught before anything touches a host.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from .errors import ServopsError, did_you_mean
from .schema import PATCH_META, load_mapping, read_text

# Resolved from the checkout, not the working directory; SERVOPS_PATCHES points elsewhere.
PATCH_ROOT = Path(os.environ.get("SERVOPS_PATCHES") or Path(__file__).resolve().parent.parent / "patches")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# dynamo_fullgraph: compile a call of the patched entry point (the flashinfer version query).
# dynamo_call_site: compile the ENGINE's call site with the model's tensors, pristine and with the
# fix set (this patch and its `with:` patches), on the host's GPU (servops/remote/preflight_dynamo.py).
PREFLIGHT_CHECKS = ("dynamo_fullgraph", "dynamo_call_site")
CALL_SITE_ARGS = ("block_fp8_linear",)


class PatchError(ServopsError):
    pass


@dataclass
class Patch:
    name: str
    distribution: str
    text: str
    applies_to: SpecifierSet
    why: str
    files: list[str]
    strip: int = 1
    preflight: dict | None = None
    path: Path = field(default_factory=Path)
    synthesised: dict | None = None   # a patch the audit wrote: what it wraps, its provenance, its proof

    def version_ok(self, version: str | None) -> bool:
        if not version:
            return False
        try:
            return Version(version) in self.applies_to
        except InvalidVersion:
            return False

    def proven(self) -> bool:
        """A hand-written patch is reviewed; a synthesised one only counts once its audit proof passed."""
        proof = self.synthesised.get("proven") if self.synthesised else None
        return not self.synthesised or (isinstance(proof, dict) and proof.get("ok") is True)  # 'false' is no proof

    def remote_spec(self) -> dict:
        return {"name": self.name, "dist": self.distribution, "text": self.text, "strip": self.strip,
                "files": self.files}


def _split_requirement(spec: str, path: Path) -> tuple[str | None, SpecifierSet]:
    """`flashinfer-python>=0.2,<0.8` -> ('flashinfer-python', SpecifierSet('>=0.2,<0.8'))."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)?\s*(.*)", spec)
    name, rest = m.group(1), m.group(2)
    if name and not rest and re.match(r"\d", name):  # a bare version like "0.7"
        name, rest = None, "==" + name
    try:
        return name, SpecifierSet(rest)
    except InvalidSpecifier:
        raise PatchError(f"{path}: 'applies_to' {spec!r} is not a PEP 440 specifier (e.g. flashinfer-python>=0.2,<0.8)") from None


def patch_files(text: str, strip: int, where: str) -> list[str]:
    # A symlink in a patch could point site-packages anywhere: refused outright.
    if re.search(r"^(new file mode|new mode|old mode|deleted file mode) 120000", text, re.M):
        raise PatchError(f"{where}: the patch creates or changes a symlink; servops patches regular files only")
    try:
        ps = PatchSet(text)
    except UnidiffParseError as exc:
        raise PatchError(f"{where}: not a valid unified diff: {exc}") from None
    if not len(ps):
        raise PatchError(f"{where}: the patch contains no file changes")
    files = []
    for pf in ps:
        target = pf.target_file if pf.target_file != "/dev/null" else pf.source_file
        parts = target.split("/")[strip:]
        rel = "/".join(parts)
        if not rel or rel.startswith("/") or ".." in parts:
            raise PatchError(f"{where}: file path {target!r} must be relative to site-packages")
        files.append(rel)
    return files


def load_patch(path: Path) -> Patch:
    meta_path = path.with_suffix(".yml")
    if not meta_path.exists():
        raise PatchError(f"{path}: metadata {meta_path} is missing")
    meta = load_mapping(meta_path, PATCH_META, PatchError)
    for key in ("applies_to", "why", "files"):
        if not meta.get(key):
            raise PatchError(f"{meta_path}: '{key}' is required")
    dist_dir = path.parent.name
    spec_name, spec = _split_requirement(str(meta["applies_to"]), meta_path)
    dist = meta.get("distribution") or dist_dir
    if spec_name and _norm(spec_name) != _norm(dist):
        raise PatchError(f"{meta_path}: 'applies_to' names {spec_name} but the patch is for {dist}")
    strip = int(meta.get("strip", 1))
    text = read_text(path, PatchError, limit=16 << 20)
    diff_files = patch_files(text, strip, str(path))
    if sorted(meta["files"]) != sorted(diff_files):
        raise PatchError(f"{meta_path}: 'files' {meta['files']} does not match the files in the diff {diff_files}")
    preflight = meta.get("preflight")
    if preflight is not None:
        if preflight.get("check") not in PREFLIGHT_CHECKS:
            raise PatchError(f"{meta_path}: 'preflight.check' must be one of {', '.join(PREFLIGHT_CHECKS)}")
        for key in ("module", "call"):
            if not preflight.get(key):
                raise PatchError(f"{meta_path}: 'preflight.{key}' is required")
        args = preflight.get("args")
        if preflight["check"] == "dynamo_call_site" and not (
                args in CALL_SITE_ARGS or (isinstance(args, list) and all(
                    isinstance(a, dict) and isinstance(a.get("shape"), list) for a in args))):
            raise PatchError(f"{meta_path}: 'preflight.args' of a dynamo_call_site check is one of "
                             f"{', '.join(CALL_SITE_ARGS)} or a list of {{shape: [..], dtype: ..}} tensors")
    synthesised = meta.get("synthesised")
    if synthesised is not None and not (isinstance(synthesised, dict) and isinstance(synthesised.get("wraps"), str)):
        raise PatchError(f"{meta_path}: 'synthesised' must be a mapping naming what the patch wraps (module:function)")
    if synthesised is not None and not isinstance(synthesised.get("proven") or {}, dict):
        raise PatchError(f"{meta_path}: 'synthesised.proven' must be the audit's proof (a mapping), not "
                         f"{str(synthesised.get('proven'))[:60]!r}")
    return Patch(name=path.stem, distribution=dist, text=text, applies_to=spec, why=str(meta["why"]).strip(),
                 files=list(meta["files"]), strip=strip, preflight=preflight, path=path, synthesised=synthesised)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def all_patches(root: Path = PATCH_ROOT) -> list[Patch]:
    return [load_patch(p) for p in sorted(root.glob("*/*.patch"))]


def find_patch(name: str, root: Path = PATCH_ROOT) -> Patch:
    """A patch by NAME, or DIST/NAME when two distributions have a patch of that name."""
    dist, _, stem = name.rpartition("/") if "/" in (name or "") else ("", "", name)
    if not NAME_RE.fullmatch(stem or "") or (dist and not NAME_RE.fullmatch(dist)):
        raise PatchError(f"patch name {name!r}: use NAME or DIST/NAME (letters, digits, '.', '_' or '-')")
    name = stem
    if dist:
        candidates = [root / dist / f"{name}.patch"]
    else:
        candidates = sorted(root.glob(f"*/{name}.patch"))
    candidates = [c for c in candidates if c.exists()]
    if not candidates:
        names = [p.stem for p in sorted(root.glob("*/*.patch"))]
        raise PatchError(f"no patch named {name!r} under {root}/{did_you_mean(name, names)} (known: "
                         f"{', '.join(names) or 'none'})")
    if len(candidates) > 1:
        raise PatchError(f"patch name {name!r} is ambiguous: {', '.join(map(str, candidates))}; use DIST/NAME")
    return load_patch(candidates[0])


def write_patch(root: Path, dist: str, name: str, text: str, files: list[str], version: str, why: str = "") -> Path:
    if not NAME_RE.fullmatch(name or ""):
        raise PatchError(f"--name {name!r}: use letters, digits, '.', '_' or '-'")
    # dist and version come from the host: they name a directory here and go into the metadata
    if not NAME_RE.fullmatch(dist or "") or not re.fullmatch(r"[A-Za-z0-9.+!_-]+", version or ""):
        raise PatchError(f"the host named distribution {dist!r} version {version!r}: not a distribution "
                         "name and version; nothing written")
    patch_files(text, 1, f"generated patch {name}")
    d = root / dist
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.patch"
    if path.exists():
        raise PatchError(f"{path} already exists; choose another --name or delete it")
    path.write_text(text)
    meta = {
        "distribution": dist,
        "applies_to": f"{dist}=={version}",
        "why": why or "TODO: the failure this fixes (error message, how to reproduce)",
        "files": files,
    }
    path.with_suffix(".yml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return path
