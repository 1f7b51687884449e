"""The host agent: what runs on a host beside the proxy and the engines.

Today: nginx in front of a deployment (the upstream file, the /health watcher and the port handover
between the aiohttp proxy and nginx). It is the one home for host-side process work: identity of the
deployment's processes, the run lock, and "restart instance i".

Shipped into deploy_dir/hostagent/ like the proxy's code and run there with the host's Python
(`python -m hostagent COMMAND ...`). Standard library only (plus what every vLLM environment has),
never `fleet`, never `proxy`.
"""
