"""A hostile server for the process-tree tests, shipped to a lab host via `server_files` and run
as `server_module: tree_server`: it answers the health gate like a server, and its process tree
misbehaves as TREE_MODE says:

  ignore-term   two children that ignore SIGTERM (TP schedulers stuck in NCCL)
  leader-dies   the leader forks a child that keeps serving the port, then exits itself
                (TREE_LEADER_LIFETIME seconds after the port opens, default 2)
  setsid        a child that calls setsid() (leaves the server's session) and ignores SIGTERM

Flags other than --port are accepted and ignored, so any sglang variant launches it.
"""

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"model_path": "tree", "pid": os.getpid()}).encode()
        self.send_response(200 if self.path in ("/health", "/model_info", "/get_model_info", "/server_info") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def deaf_child(leave_session: bool) -> None:
    if os.fork() == 0:
        if leave_session:
            os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"child {os.getpid()} (session {os.getsid(0)}) ignoring SIGTERM", flush=True)
        while True:
            time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args, _rest = parser.parse_known_args()
    mode = os.environ.get("TREE_MODE", "")
    server = ThreadingHTTPServer(("0.0.0.0", args.port), Handler)
    print(f"tree_server {mode} on {args.port}, leader {os.getpid()}", flush=True)
    if mode == "ignore-term":
        deaf_child(False)
        deaf_child(False)
    elif mode == "setsid":
        deaf_child(True)
    elif mode == "leader-dies":
        if os.fork() == 0:
            print(f"child {os.getpid()} serving port {args.port}", flush=True)
            server.serve_forever()
        time.sleep(float(os.environ.get("TREE_LEADER_LIFETIME", "2")))
        print("leader exits; its child keeps serving", flush=True)
        sys.exit(0)
    server.serve_forever()


if __name__ == "__main__":
    main()
