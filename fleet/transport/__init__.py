"""Reaching a host: commands and files over SSH or locally (connection), the one way to run host code
(agent, with the host agent's modules it sends: hostcode), and a request through the entry port (client)."""
