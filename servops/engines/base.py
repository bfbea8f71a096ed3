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

    def server_module(self, host) -> str:
        """What the host's launch runs (`python -m` it): the host's own module (the lab's
        SGLang double), else the engine's."""
        return str(host.get(self.module_var) or self.launch_module)

    def server_files(self, host) -> list[str]:
        return [str(f) for f in (host.get(self.files_var) or [])] if self.files_var else []

    def label(self, version: str | None) -> str:
        """'vllm 0.32.0' (the engine and its version, as messages name them)."""
        return f"{self.name} {version}" if version else self.name
