import shutil
import subprocess
import urllib.request


def main():
    out = {"site": []}
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % int(ARGS["port"]), timeout=10) as r:
            out["text"] = r.read().decode("utf-8", "replace")
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
