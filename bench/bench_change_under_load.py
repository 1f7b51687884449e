"""A changed-setting deploy under load on the `cpu` host (vLLM's CPU build) against `inv restart --rolling`
under the same load, in one run: `inv deploy --host cpu` first, then

    .venv/bin/python bench/bench_change_under_load.py [PAUSE_S [CLIENTS]]

CLIENTS clients (default 2, every other one streamed) send chat requests through the proxy on :8100, each PAUSE_S apart (0: back to
back); prints each command's exit code and seconds, and the requests sent and failed. Leaves the host
running max_num_seqs 3: `inv deploy --host cpu` rolls it back."""
import json
import subprocess
import sys
import threading
import time

import openai

stop = threading.Event(); results = []
def client(stream):
    c = openai.OpenAI(base_url="http://127.0.0.1:8100/v1", api_key="x", max_retries=0, timeout=300)
    while not stop.is_set():
        try:
            r = c.chat.completions.create(model="tiny-llama", max_tokens=16, stream=stream,
                                          messages=[{"role": "user", "content": "hello there"}])
            if stream: r = list(r)
            results.append(True)
        except openai.OpenAIError as e:
            results.append(False); print("FAIL", e, flush=True)
        stop.wait(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
def run(*args):
    t0 = time.monotonic()
    r = subprocess.run([".venv/bin/inv", *args, "--host", "cpu"], capture_output=True, text=True)
    return r.returncode, round(time.monotonic() - t0, 1), r.stdout[-600:]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
threads = [threading.Thread(target=client, args=(k % 2 == 0,)) for k in range(n)]
for t in threads: t.start()
time.sleep(5)
out = {}
n0 = len(results)
out["restart_rolling"] = run("restart", "--rolling")[:2]
n1 = len(results)
out["deploy_changed_max_num_seqs"] = run("deploy", "-e", "max_num_seqs=3")[:2]
n2 = len(results)
stop.set(); [t.join() for t in threads]
out["requests"] = {"during_restart": n1 - n0, "during_deploy": n2 - n1, "failed": results.count(False)}
print(json.dumps(out))
