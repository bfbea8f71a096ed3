import shutil
import subprocess

# What is read of /metrics, at most (as `logs` bounds a log): a real server's, TP8 with every
# rank's series, is well under 1 MiB; a bigger one is cut at its last whole line within this.
METRICS_MAX_BYTES = 4 << 20


def main():
    out = {"site": []}
    try:
        with local_urlopen("http://127.0.0.1:%d/metrics" % int(ARGS["port"]), 10) as r:
            data = r.read(METRICS_MAX_BYTES + 1)
            if len(data) > METRICS_MAX_BYTES:
                data = data[:data.rfind(b"\n", 0, METRICS_MAX_BYTES) + 1]
                out["cut_at"] = METRICS_MAX_BYTES
            out["text"] = data.decode("utf-8", "replace")
    except Exception as exc:
        out["fetch_error"] = "%s: %s" % (type(exc).__name__, exc)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out["gpu_csv"] = subprocess.run(
                [smi, "--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    reply(out)


main()
