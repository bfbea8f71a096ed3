"""What one engine is, as servops needs it (a record of facts; the rooms fill it in)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Engine:
    name: str                       # as a variant names it: `engine: vllm`
    launch_module: str              # `python -m <launch_module> <argv>`
    template: str                   # launch script template under templates/
    check_program: str              # the remote program that parses a launch with the host's engine
    dists: tuple[str, ...]          # distributions its version is read from, in order
    health: dict                    # default health gate: endpoint, model_info, first_request
    gauges: dict = field(default_factory=dict)       # servops key -> engine metric (a gauge)
    histograms: dict = field(default_factory=dict)   # servops key -> histogram base name
    counters: dict = field(default_factory=dict)     # servops key -> counter name (without _total)
    request: dict = field(default_factory=dict)      # the bench's request shape
    process_names: tuple[str, ...] = ()              # what its server tree holds (for stop)
    launch_env: dict = field(default_factory=dict)   # env every launch gets (the host's and variant's env override it)
    crash_signatures: tuple[str, ...] = ()           # log lines that mean the server is dead
    model_flag: str = "model-path"                   # the server arg naming the model
    module_var: str = "server_module"                # the host var that replaces launch_module
    files_var: str | None = None                     # the host var listing local files a release ships
    jit_caches: tuple[tuple[str, str, str], ...] = ()  # (name, env var, phase it saves: jit_s | compile_s):
                                                     # the engine's own JIT/compile cache variables
                                                     # (servops.jitcache points them at jit_cache_dir)
    # The audit of the compiled region (servops/audit.py):
    packages: tuple[str, ...] = ()                   # its code's top-level packages (a break's engine frames)
    audit_overrides: dict = field(default_factory=dict)   # server args of the audit's side server
                                                     # ({model}, {port}, {mem} filled in); None drops a flag
    audit_mem_of: str = "total"                      # what its {mem} flag is a share of: the GPU's
                                                     # "total" memory, or the memory "free" at its start
    prefill_eager: tuple[tuple[str, dict], ...] = ()  # (version specifier, server args): the prefill
                                                     # without its compiled graph, per release
    workarounds: tuple[tuple[str, str], ...] = ()     # (version specifier, text): the release's own flag
                                                     # that keeps the prefill out of dynamo
    compile_flags: tuple[tuple[str, object], ...] = ()   # (server arg, value): a launch that compiles
    compiles_by_default: tuple[tuple[str, str], ...] = ()  # (version specifier, server arg that turns it off)


    def audit_args(self, model: str, port: str, mem: str) -> dict:
        fill = {"{model}": model, "{port}": port, "{mem}": mem}
        return {k: fill.get(v, v) if isinstance(v, str) else v for k, v in self.audit_overrides.items()}

    def by_version(self, rules, version: str | None):
        """The value of the first (version specifier, value) rule the version meets (None: none)."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
        try:
            v = Version(version) if version else None
        except InvalidVersion:
            v = None
        for spec, value in rules:
            if v is not None and v in SpecifierSet(spec, prereleases=True):
                return value
        return None

    def eager_prefill_args(self, version: str | None) -> dict:
        return dict(self.by_version(self.prefill_eager, version) or {})

    def workaround(self, version: str | None) -> str:
        """The flag that keeps the compiled graph out of dynamo on this release; every release's
        where the version is unknown."""
        found = self.by_version(self.workarounds, version)
        if found:
            return found
        if len(self.workarounds) == 1 or version is None and self.workarounds:
            return "; ".join(text if len(self.workarounds) == 1 else f"{text} on {self.name} {spec}"
                             for spec, text in self.workarounds)
        return f"no workaround flag known for {self.label(version)}: keep the variant's prefill graph off"

    def server_module(self, host) -> str:
        """What the host's launch runs (`python -m` it): the host's own module (the lab's
        SGLang double), else the engine's."""
        return str(host.get(self.module_var) or self.launch_module)

    def server_files(self, host) -> list[str]:
        return [str(f) for f in (host.get(self.files_var) or [])] if self.files_var else []

    def label(self, version: str | None) -> str:
        """'vllm 0.32.0' (the engine and its version, as messages name them)."""
        return f"{self.name} {version}" if version else self.name
