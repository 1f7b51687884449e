"""nginx in front of a deployment, on the host itself: the upstream file, the /health watcher and the
port handover between the aiohttp proxy and nginx.

Shipped into deploy_dir/fleet_nginx/ like the proxy's code and run there with the host's Python
(`python -m fleet_nginx COMMAND --config conf/nginx_front.json`). Standard library only, never `fleet`.
"""
