"""The host agent: what runs on a host beside the proxy and the engines.

- `processes`: which processes are the deployment's (pid-file records, tag, session) and the stop that
  signals only those; runs from the deployed copy or fed on stdin where nothing is deployed yet.
- `lock`: one run at a time per deployment (a flock under deploy_dir/run).
- `restart`: the one "restart instance i" (drain, stop by identity, wait for the card, start, /health,
  enable), used by `inv restart` and by the keeper.
- `keeper`: restarts dead or stalled instances, with backoff, and stops at a crash loop; in nginx mode it
  also watches /health (`watch`) and rotates nginx's access log.
- `drain`: drain-first stop of the front; `handover`, `host`, `launch`, `upstream`: the zero-gap proxy
  restart and the port handover between the aiohttp proxy and nginx.

Shipped into deploy_dir/hostagent/ like the proxy's code and run there with the host's Python
(`python -m hostagent COMMAND ...`). Standard library only, never `fleet`, never `proxy`.
"""
