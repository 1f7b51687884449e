"""The host agent: what runs on a host beside the proxy and the engines.

- `layout`: the one spelling of the paths under deploy_dir (run/, logs/, conf/, bin/) and of the
  FLEET_TAG format; the one module of the host agent the control plane may import.
- `processes`: which processes are the deployment's (pid-file records, tag, session) and the stop that
  signals only those; runs from the deployed copy or fed on stdin where nothing is deployed yet.
- `instances`: one instance as status and the keeper both see it: `classify` (its state), /health, its
  recorded process, what holds its card, its log tail, the wait for /health.
- `proxyadmin`: the proxy's loopback admin API (backends, drain, enable, requests, drain-and-exit).
- `lock`: one run at a time per deployment (a flock under deploy_dir/run).
- `restart`: the one "restart instance i" (drain, stop by identity, wait for the card, start, /health,
  enable), used by `inv restart` and by the keeper.
- `lora`: runtime LoRA adapters: load and unload on a group's instances (vLLM's endpoints), the record
  run/lora_adapters.json, and its restore after a start (restart, wait-healthy).
- `keeper_decisions`: the keeper's decisions, a pure function of what it observed and the time.
- `keeper`: the loop that observes, decides (keeper_decisions) and acts: restarts dead or stalled
  instances, with backoff, and stops at a crash loop; in nginx mode it also watches /health (`watch`)
  and rotates nginx's access log.
- `drain`: drain-first stop of the front; `handover`, `launch`, `upstream`: the zero-gap proxy restart
  and the port handover between the aiohttp proxy and nginx; `nginx_front`: nginx mode (binary, command
  line, upstream and keys files, the watcher); `entryport`: who answers on the entry port, and binding it;
  `parts`: the proxy's, nginx's and the keeper's processes (identity-checked) and their group's stop.
- One spelling each: `httpcall` (the HTTP call), `exposition` (the Prometheus text parser), `files` (the
  atomic write), `config` (the config files), `errors` (the error tree: one error per part).
- `probes/`: the scripts that read a host's state (state, holders, doctor, cpu_mem), sent on standard
  input with the modules they import (fleet.transport.hostcode).

Shipped into deploy_dir/hostagent/ like the proxy's code and run there with the host's Python
(`python -m hostagent COMMAND ...`). Standard library only, never `fleet`, never `proxy`.
"""
